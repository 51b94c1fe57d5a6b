"""POST /v1/segments: ingest a corpus's segments ahead of the requests that will reuse them.

The same plan as `LLM.ingest` (sparsex/entrypoints/ingest.py), run through the async engine like any
request: the prompts are built on the engine thread, each pass's prompts are queued together and
awaited before the next pass (a later pass merges into the entries the earlier ones made). The
entries land in the request's cache namespace, chosen as for completions (tenant header, else
`cache_salt`), so only that tenant's later requests reuse them.
"""
from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sparsex.entrypoints.ingest import INGEST_PARAMS, IngestParams, IngestPlan, ingest_result, plan_ingest
from sparsex.entrypoints.protocol import IngestRequest, IngestResponse
from sparsex.entrypoints.serving_common import (
    SCOPE_HEADER,
    ServingContext,
    engine_error,
    final_outputs,
    new_id,
    start_requests,
)


async def ingest_segments(body: IngestRequest, request: Request, ctx: ServingContext) -> Response:
    ctx.check_model(body.model)
    ns = ctx.namespace(request, body.cache_salt, [], "segments")

    def plan(engine) -> IngestPlan:
        params = IngestParams(passes=body.passes, group_size=body.group_size, seed=body.seed)
        return plan_ingest(engine, body.segments, prefix=body.prefix, cache_salt=ns.salt, params=params)

    try:
        ingest = await ctx.engine.call(plan)
    except Exception as e:         # noqa: BLE001 - engine_error maps what it knows and re-raises the rest
        raise engine_error(e, ctx.settings, "segments") from e
    request_id = new_id("ingest")
    outputs = []
    for i, (prompts, reuse) in enumerate(zip(ingest.passes, ingest.reuse)):
        streams = await start_requests(ctx, f"{request_id}-p{i}", prompts, INGEST_PARAMS, reuse, "segments")
        try:
            outputs += await final_outputs(streams)
        finally:
            for s in streams:
                s.abort()       # no-op once finished; frees everything if the client went away
    result = await ctx.engine.call(lambda engine: ingest_result(engine, ingest, outputs))
    resp = IngestResponse(num_prompts=result.num_prompts, num_segments=result.num_segments,
                          num_tokens_computed=result.num_tokens_computed,
                          num_segment_entries=result.num_segment_entries)
    return JSONResponse(resp.model_dump(), headers={SCOPE_HEADER: ns.scope})
