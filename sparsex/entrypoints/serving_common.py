"""What the chat and completions endpoints share: the serving context, starting engine requests
(with engine errors mapped to HTTP ones), usage accounting, and merging several requests' streams."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request

from sparsex.entrypoints.async_engine import (
    AsyncLLM,
    EngineClosedError,
    EngineDeadError,
    PromptSource,
    QueueFullError,
    RequestStream,
)
from sparsex.entrypoints.errors import APIError, bad_request
from sparsex.entrypoints.logprobs import TokenText
from sparsex.entrypoints.protocol import PromptTokensDetails, ReusedSpanInfo, SparseXUsage, Usage
from sparsex.entrypoints.settings import ServerSettings
from sparsex.entrypoints.tenancy import CacheNamespace, resolve_namespace
from sparsex.entrypoints.tool_parsers import ToolParser
from sparsex.outputs import TRANSPARENT_SOURCES, RequestOutput
from sparsex.sampling_params import InvalidParamError, SamplingParams

SCOPE_HEADER = "X-SparseX-Cache-Scope"


@dataclass
class ServingContext:
    engine: AsyncLLM
    settings: ServerSettings
    model_name: str             # the name clients use
    token_text: TokenText
    tool_parser: type[ToolParser] | None = None     # None: the model has no tool-call convention we know

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in (self.model_name, self.engine.model_name):
            raise bad_request(f"model {model!r} is not served here; available: [{self.model_name!r}]",
                              param="model", code="model_not_found")

    def namespace(self, request: Request, body_salt: str | None, part_scopes: list[str], param: str) -> CacheNamespace:
        header = request.headers.get(self.settings.tenant_header) if self.settings.tenant_header else None
        return resolve_namespace(header_value=header, body_salt=body_salt, part_scopes=part_scopes,
                                 allow_shared=self.settings.allow_shared_segments, param=param)


def new_id(prefix: str) -> str:
    # engine ids must not contain '#': it separates the choices of an n > 1 request
    return f"{prefix}-{uuid.uuid4().hex}"


def engine_error(e: Exception, settings: ServerSettings, param: str | None = None,
                 fields: dict[str, str] | None = None) -> APIError:
    """`fields`: SamplingParams field -> the request's field, for an InvalidParamError that names one."""
    if isinstance(e, QueueFullError):
        return APIError(503, f"the server is overloaded: {e}; retry later", code="queue_full",
                        headers={"Retry-After": str(settings.retry_after_s)})
    if isinstance(e, EngineClosedError):
        return APIError(503, str(e), code="shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_dead")
    if isinstance(e, InvalidParamError):    # names the bad field (a schema that does not compile, a token id)
        return bad_request(str(e), param=(fields or {}).get(e.param, e.param), code=e.code)
    if isinstance(e, ValueError):       # the engine validates before queuing: this is the input's fault
        return bad_request(str(e), param=param)
    raise e


async def start_requests(ctx: ServingContext, request_id: str, prompts: list[PromptSource], params: SamplingParams,
                         reuse: dict | None, param: str, fields: dict[str, str] | None = None) -> list[RequestStream]:
    """Queue one engine request per prompt; all or nothing (earlier ones are aborted on failure).
    `fields`: see engine_error."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await ctx.engine.add_request(rid, prompt, params, reuse=reuse))
    except BaseException as e:
        for s in streams:
            s.abort()
        if isinstance(e, Exception):
            raise engine_error(e, ctx.settings, param, fields) from e
        raise
    return streams


def usage_of(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    prefix = sum(o.num_cached_tokens for o in outputs)
    reused = sum(o.num_reused_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=prefix + reused),
                 sparsex=SparseXUsage(prefix_cached_tokens=prefix, segment_reused_tokens=reused,
                                      transparent_reused_tokens=sum(s.num_tokens for o in outputs for s in o.reused_spans
                                                                    if s.source in TRANSPARENT_SOURCES),
                                      recomputed_tokens=sum(o.num_recomputed_tokens for o in outputs),
                                      reused_spans=[ReusedSpanInfo(start=s.start, end=s.end, source=s.source,
                                                                   prompt_index=i)
                                                    for i, o in enumerate(outputs) for s in o.reused_spans],
                                      reuse_skipped=next((o.reuse_skipped for o in outputs if o.reuse_skipped),
                                                         None)))


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    """Run every stream to its end; the last (finished) output of each."""
    async def last(stream: RequestStream) -> RequestOutput:
        out = None
        async for out in stream:
            pass
        assert out is not None and out.finished
        return out
    return list(await asyncio.gather(*(last(s) for s in streams)))


_END = object()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from all streams as they come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                q.put_nowait((i, out))
        except Exception as e:      # noqa: BLE001 - re-raised by the consumer
            q.put_nowait((i, e))
        q.put_nowait((i, _END))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await q.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
