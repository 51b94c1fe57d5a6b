"""POST /v1/completions: a prompt (text, token ids, a batch of either) or SparseX's `segments`.

`segments` is the prompt as reusable pieces: each piece is tokenized on its own and may be
served from the segment cache wherever it appears in a later prompt. Each piece is a string, a
token-id list, or {"text" | "token_ids", "cache_segment": {"scope": ...}}.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sparsex.entrypoints.async_engine import RequestAbortedError, RequestStream
from sparsex.entrypoints.errors import bad_request, error_body
from sparsex.entrypoints.incremental import TextDeltas
from sparsex.entrypoints.logprobs import completion_logprobs
from sparsex.entrypoints.protocol import (
    MAX_N,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SegmentPart,
)
from sparsex.entrypoints.request_params import check_supported, completion_sampling_params, engine_fields
from sparsex.entrypoints.serving_common import (
    SCOPE_HEADER,
    ServingContext,
    final_outputs,
    merged,
    new_id,
    start_requests,
    usage_of,
)
from sparsex.entrypoints.sse import DONE, EventStreamResponse, sse_event, unless_disconnected
from sparsex.sampling_params import SamplingParams


def segment_pieces(segments: list[str | list[int] | SegmentPart]) -> tuple[list[str | list[int]], list[str]]:
    """The engine's pieces, and the cache scope of each."""
    pieces: list[str | list[int]] = []
    scopes: list[str] = []
    for i, seg in enumerate(segments):
        if isinstance(seg, SegmentPart):
            if (seg.text is None) == (seg.token_ids is None):
                raise bad_request(f"segments[{i}] needs exactly one of 'text' and 'token_ids'", param=f"segments.{i}")
            pieces.append(seg.text if seg.text is not None else seg.token_ids)
            scopes.append(seg.cache_segment.scope if seg.cache_segment else "tenant")
        else:
            pieces.append(seg)
            scopes.append("tenant")
    return pieces, scopes


def _prompts(body: CompletionRequest, salt: str | None) -> list[dict[str, Any]]:
    """The engine prompt dicts (one per prompt of a batch)."""
    p = body.prompt
    if isinstance(p, str):
        return [{"prompt": p, "cache_salt": salt}]
    if p and isinstance(p[0], str):
        return [{"prompt": s, "cache_salt": salt} for s in p]
    if p and isinstance(p[0], list):
        return [{"prompt_token_ids": ids, "cache_salt": salt} for ids in p]
    return [{"prompt_token_ids": p, "cache_salt": salt}]


async def create_completion(body: CompletionRequest, request: Request, ctx: ServingContext) -> Response:
    ctx.check_model(body.model)
    check_supported(body, ctx.settings)
    if body.segments is not None and body.prompt in ("", []):
        body.prompt = None      # clients whose `prompt` is mandatory (the openai SDK) send "" with segments
    if (body.prompt is None) == (body.segments is None):
        raise bad_request("give exactly one of 'prompt' and 'segments'", param="prompt")
    params = completion_sampling_params(body)
    if body.segments is not None:
        if not body.segments:
            raise bad_request("segments must be a non-empty list", param="segments")
        pieces, scopes = segment_pieces(body.segments)
        ns = ctx.namespace(request, body.cache_salt, scopes, "segments")
        prompts: list[Any] = [{"segments": pieces, "cache_salt": ns.salt}]
        param = "segments"
    else:
        ns = ctx.namespace(request, body.cache_salt, [], "prompt")
        prompts = _prompts(body, ns.salt)
        param = "prompt"
    if len(prompts) * body.n > MAX_N:
        raise bad_request(f"{len(prompts)} prompts x n={body.n} exceeds {MAX_N} sequences per request", param=param)

    request_id = new_id("cmpl")
    reuse = body.reuse.overrides() if body.reuse else None
    streams = await start_requests(ctx, request_id, prompts, params, reuse, param, engine_fields(body))
    headers = {SCOPE_HEADER: ns.scope}
    created = int(time.time())

    def abort_all() -> None:
        for s in streams:
            s.abort()

    if body.stream:
        return EventStreamResponse(_events(body, params, ctx, streams, request_id, created), on_close=abort_all,
                                   headers=headers)
    try:
        connected, outs = await unless_disconnected(final_outputs(streams), request.receive)
    finally:
        abort_all()
    if not connected:
        return Response(status_code=499)
    choices = [CompletionChoice(index=i * body.n + c.index, text=c.text, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                                logprobs=completion_logprobs(c.token_ids, c.logprobs or [], ctx.token_text, 0)
                                if body.logprobs is not None else None)
               for i, out in enumerate(outs) for c in out.outputs]
    resp = CompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage_of(outs))
    return JSONResponse(resp.model_dump(), headers=headers)


@dataclass
class _Choice:
    text: TextDeltas
    tokens_sent: int = 0
    done: bool = False


async def _events(body: CompletionRequest, params: SamplingParams, ctx: ServingContext,
                  streams: list[RequestStream], request_id: str, created: int) -> AsyncIterator[str]:
    with_usage = bool(body.stream_options and body.stream_options.include_usage)
    n = body.n
    choices = [_Choice(TextDeltas(params.stop, params.include_stop_str_in_output)) for _ in range(len(streams) * n)]
    last: dict[int, Any] = {}

    def event(choice: CompletionChoice | None, usage=None) -> str:
        d = CompletionResponse(id=request_id, created=created, model=ctx.model_name,
                               choices=[choice] if choice else [], usage=usage).model_dump()
        if not with_usage:
            d.pop("usage")
        return sse_event(d)

    try:
        async for i, out in merged(streams):
            last[i] = out
            for c in out.outputs:
                index = i * n + c.index
                st = choices[index]
                if st.done:
                    continue
                finished = c.finish_reason is not None
                offset = st.text.sent
                delta = st.text.next(c.text, finished)
                logprobs = None
                if body.logprobs is not None and len(c.token_ids) > st.tokens_sent:
                    logprobs = completion_logprobs(c.token_ids[st.tokens_sent:], (c.logprobs or [])[st.tokens_sent:],
                                                   ctx.token_text, offset)
                    st.tokens_sent = len(c.token_ids)
                if not delta and logprobs is None and not finished:
                    continue
                st.done = finished
                yield event(CompletionChoice(index=index, text=delta, logprobs=logprobs, finish_reason=c.finish_reason,
                                             stop_reason=c.stop_reason if finished else None))
    except RequestAbortedError:
        return
    except Exception as e:                  # noqa: BLE001 - headers are out: report in-band
        yield sse_event(error_body(503, f"generation failed: {e}", code="engine_error"))
        yield DONE
        return
    if with_usage and last:
        yield event(None, usage_of([last[i] for i in sorted(last)]))
    yield DONE
