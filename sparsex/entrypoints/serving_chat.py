"""POST /v1/chat/completions: messages -> chat template (each message content a segment) -> engine.

The prompt is built with `LLMEngine.chat_to_prompt`, the very path `LLM.chat` takes, so greedy
output matches the offline API token for token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sparsex.entrypoints.async_engine import RequestAbortedError, RequestStream
from sparsex.entrypoints.errors import bad_request, error_body
from sparsex.entrypoints.incremental import TextDeltas
from sparsex.entrypoints.logprobs import chat_logprobs
from sparsex.entrypoints.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    FunctionCallInfo,
    ToolCallInfo,
)
from sparsex.entrypoints.request_params import chat_sampling_params, check_supported, engine_fields
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
from sparsex.entrypoints.tool_parsers import (
    PARSER_NAMES,
    ToolCallStream,
    ToolParser,
    ToolSpecError,
    constrain_to_tool_calls,
    effective_tool_choice,
    is_forcing,
)
from sparsex.sampling_params import SamplingParams


def _part_scopes(body: ChatCompletionRequest) -> list[str]:
    """Scope of every piece of content; a plain-string content is an unmarked (tenant) piece."""
    scopes: list[str] = []
    for m in body.messages:
        if isinstance(m.content, str) and m.content:
            scopes.append("tenant")
        elif isinstance(m.content, list):
            scopes += [p.cache_segment.scope if p.cache_segment else "tenant" for p in m.content]
    return scopes


def _tool_parser(body: ChatCompletionRequest, ctx: ServingContext,
                 params: SamplingParams) -> tuple[type[ToolParser] | None, SamplingParams]:
    """The parser for this request's answers (None: no tool calls to parse), and its sampling
    params, constrained to a valid call for tool_choice "required" or a named function."""
    tool_choice = effective_tool_choice(body.tools, body.tool_choice)
    if not body.tools or tool_choice == "none":
        return None, params                 # tools (if any) are still rendered into the prompt
    parser = ctx.tool_parser
    if parser is None:
        raise bad_request("this model's chat template has no tool-call convention the server recognises: start the "
                          "server with --tool-call-parser NAME (one of " + ", ".join(PARSER_NAMES) + ") to get "
                          "tool calls, or send tool_choice 'none'", param="tools", code="tool_parser_required")
    if is_forcing(tool_choice):
        if params.structured_outputs is not None:
            raise bad_request(f"tool_choice={tool_choice!r} constrains the output to a tool call: it cannot be combined "
                              "with response_format or structured_outputs", param="tool_choice")
        try:
            params = constrain_to_tool_calls(params, parser, body.tools, tool_choice, body.parallel_tool_calls)
        except ToolSpecError as e:
            raise bad_request(str(e), param=e.param) from e
    return parser, params


def _message(parser: type[ToolParser] | None, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
    if parser is None:
        return ChatResponseMessage(content=text), finish_reason
    content, calls = parser.extract(text)
    if not calls:
        return ChatResponseMessage(content=content), finish_reason
    return (ChatResponseMessage(content=content, tool_calls=[
        ToolCallInfo(id=c.id, function=FunctionCallInfo(name=c.name, arguments=c.arguments)) for c in calls]),
        "tool_calls")


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServingContext) -> Response:
    ctx.check_model(body.model)
    check_supported(body, ctx.settings)
    if not body.messages:
        raise bad_request("messages must be a non-empty list", param="messages")
    params = chat_sampling_params(body)
    parser, params = _tool_parser(body, ctx, params)
    ns = ctx.namespace(request, body.cache_salt, _part_scopes(body), "messages")
    messages = [m.to_template() for m in body.messages]
    tools, add_generation_prompt = body.tools, body.add_generation_prompt

    def prompt(engine):
        return engine.chat_to_prompt(messages, add_generation_prompt, ns.salt, tools)

    request_id = new_id("chatcmpl")
    reuse = body.reuse.overrides() if body.reuse else None
    streams = await start_requests(ctx, request_id, [prompt], params, reuse, "messages", engine_fields(body))
    headers = {SCOPE_HEADER: ns.scope}
    created = int(time.time())
    if body.stream:
        return EventStreamResponse(_events(body, params, ctx, streams, request_id, created, parser),
                                   on_close=streams[0].abort, headers=headers)
    try:
        connected, outs = await unless_disconnected(final_outputs(streams), request.receive)
    finally:
        streams[0].abort()          # no-op once finished; frees everything if we were cut short
    if not connected:
        return Response(status_code=499)    # nobody reads this: the client is gone
    out = outs[0]
    k = body.top_logprobs or 0
    choices = [ChatChoice(index=c.index, message=message, finish_reason=finish_reason, stop_reason=c.stop_reason,
                          logprobs=chat_logprobs(c.token_ids, c.logprobs or [], k, ctx.token_text) if body.logprobs else None)
               for c in out.outputs for message, finish_reason in [_message(parser, c.text, c.finish_reason)]]
    resp = ChatCompletionResponse(id=request_id, created=created, model=ctx.model_name, choices=choices,
                                  usage=usage_of(outs))
    return JSONResponse(resp.model_dump(), headers=headers)


@dataclass
class _Choice:
    text: TextDeltas
    tools: ToolCallStream | None = None     # parses tool calls out of the released text
    released: str = ""                      # the text TextDeltas released so far (with tools)
    tokens_sent: int = 0
    done: bool = False


def _chunk(request_id: str, created: int, model: str, choice: ChatChunkChoice, with_usage: bool) -> str:
    chunk = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice])
    d = chunk.model_dump(exclude=None if with_usage else {"usage"})
    d["choices"][0]["delta"] = {k: v for k, v in d["choices"][0]["delta"].items() if v is not None}
    return sse_event(d)


async def _events(body: ChatCompletionRequest, params: SamplingParams, ctx: ServingContext,
                  streams: list[RequestStream], request_id: str, created: int,
                  parser: type[ToolParser] | None = None) -> AsyncIterator[str]:
    with_usage = bool(body.stream_options and body.stream_options.include_usage)
    model, k = ctx.model_name, body.top_logprobs or 0
    choices = [_Choice(TextDeltas(params.stop, params.include_stop_str_in_output),
                       ToolCallStream(parser) if parser else None) for _ in range(body.n)]
    for i in range(body.n):
        yield _chunk(request_id, created, model, ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")),
                     with_usage)
    last = None
    try:
        async for _, out in merged(streams):
            last = out
            for c in out.outputs:
                st = choices[c.index]
                if st.done:
                    continue
                finished = c.finish_reason is not None
                delta = st.text.next(c.text, finished)
                tool_deltas: list = []
                finish_reason = c.finish_reason
                if st.tools is not None:
                    st.released += delta
                    delta, tool_deltas = st.tools.feed(st.released, finished)
                    if finished and st.tools.called:
                        finish_reason = "tool_calls"
                logprobs = None
                if body.logprobs and len(c.token_ids) > st.tokens_sent:
                    logprobs = chat_logprobs(c.token_ids[st.tokens_sent:], (c.logprobs or [])[st.tokens_sent:], k,
                                             ctx.token_text)
                    st.tokens_sent = len(c.token_ids)
                if not delta and not tool_deltas and logprobs is None and not finished:
                    continue
                st.done = finished
                yield _chunk(request_id, created, model,
                             ChatChunkChoice(index=c.index, delta=ChatDelta(content=delta or None,
                                                                            tool_calls=tool_deltas or None),
                                             logprobs=logprobs, finish_reason=finish_reason,
                                             stop_reason=c.stop_reason if finished else None),
                             with_usage)
    except RequestAbortedError:
        return                              # we aborted it ourselves: the client is gone
    except Exception as e:                  # noqa: BLE001 - headers are out: report in-band
        yield sse_event(error_body(503, f"generation failed: {e}", code="engine_error"))
        yield DONE
        return
    if with_usage and last is not None:
        usage = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[], usage=usage_of([last]))
        yield sse_event(usage.model_dump())
    yield DONE
