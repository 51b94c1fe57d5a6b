"""The OpenAI-compatible HTTP app: `build_app(async_engine, settings)`.

    POST /v1/chat/completions   POST /v1/completions   POST /v1/segments   GET /v1/models
    POST /tokenize              GET /health            GET /metrics

Serve it with any ASGI server (`sparsex serve` uses uvicorn). On shutdown the app drains the
engine: uvicorn first stops accepting connections and waits for in-flight responses, then the
lifespan hook below lets the engine finish whatever is left and stops its thread.
"""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sparsex.entrypoints.async_engine import AsyncLLM, EngineClosedError, EngineDeadError
from sparsex.entrypoints.auth import APIKeyMiddleware
from sparsex.entrypoints.errors import APIError, bad_request, error_body, install_error_handlers
from sparsex.entrypoints.logprobs import TokenText
from sparsex.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    IngestRequest,
    IngestResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from sparsex.entrypoints.serving_chat import create_chat_completion
from sparsex.entrypoints.serving_common import ServingContext
from sparsex.entrypoints.serving_completion import create_completion, segment_pieces
from sparsex.entrypoints.serving_segments import ingest_segments
from sparsex.entrypoints.settings import ServerSettings
from sparsex.entrypoints.tool_parsers import resolve_parser
from sparsex.version import __version__

_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "invalid request"},
    401: {"model": ErrorResponse, "description": "missing or wrong API key"},
    503: {"model": ErrorResponse, "description": "queue full (see Retry-After), shutting down, or engine down"},
}
_STREAM = {200: {"content": {"text/event-stream": {}}, "description": "JSON, or server-sent events when stream=true"}}


def build_app(async_engine: AsyncLLM, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    ctx = ServingContext(engine=async_engine, settings=settings,
                         model_name=settings.served_model_name or async_engine.model_name,
                         token_text=TokenText(async_engine.tokenizer),
                         tool_parser=resolve_parser(settings.tool_call_parser,
                                                    getattr(async_engine.tokenizer, "chat_template", None)))

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if settings.shutdown_engine:
            await async_engine.shutdown(drain=True)

    app = FastAPI(title="SparseX", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM server with segment-level KV-cache reuse.")
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        # the engine died while this request was in it (a lost tensor-parallel rank, a device error)
        return JSONResponse(error_body(503, str(exc), code="engine_dead"), status_code=503)

    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_STREAM, **_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(body, request, ctx)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_STREAM, **_ERRORS})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(body, request, ctx)

    @app.post("/v1/segments", response_model=IngestResponse, responses=_ERRORS)
    async def segments(body: IngestRequest, request: Request) -> IngestResponse:
        return await ingest_segments(body, request, ctx)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=ctx.model_name, max_model_len=async_engine.max_model_len)])

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        ctx.check_model(body.model)
        given = [name for name in ("prompt", "messages", "segments") if getattr(body, name) is not None]
        if len(given) != 1:
            raise bad_request("give exactly one of 'prompt', 'messages' and 'segments'", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages must be a non-empty list", param="messages")
            messages, add_gen, tools = [m.to_template() for m in body.messages], body.add_generation_prompt, body.tools
            source: Any = lambda engine: engine.chat_to_prompt(messages, add_gen, None, tools)  # noqa: E731
        elif body.segments is not None:
            source = {"segments": segment_pieces(body.segments)[0]}
        else:
            source = {"prompt": body.prompt}
        try:
            tp = await async_engine.tokenize(source)
        except ValueError as e:
            raise bad_request(str(e), param=given[0]) from e
        except (EngineDeadError, EngineClosedError) as e:
            raise APIError(503, str(e), code="engine_unavailable") from e
        return TokenizeResponse(count=len(tp.token_ids), max_model_len=async_engine.max_model_len,
                                tokens=list(tp.token_ids), segments=[(s.start, s.end) for s in tp.segments])

    @app.get("/health", responses={503: {"model": ErrorResponse, "description": "engine loop not running"}})
    async def health() -> Response:
        if async_engine.is_running:
            return JSONResponse({"status": "ok"})
        why = "shutting down" if async_engine.error is None else f"engine loop died: {async_engine.error!r}"
        return JSONResponse(error_body(503, why, code="engine_unavailable"), status_code=503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(async_engine.metrics.render(), media_type=async_engine.metrics.content_type)

    return app
