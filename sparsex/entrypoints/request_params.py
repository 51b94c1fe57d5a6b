"""From an HTTP request body to the engine's SamplingParams, refusing what the engine cannot do."""
from __future__ import annotations

import dataclasses

from sparsex.config import ReuseConfig
from sparsex.entrypoints.errors import APIError, bad_request
from sparsex.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from sparsex.entrypoints.settings import ServerSettings
from sparsex.entrypoints.tool_parsers import ToolSpecError, check_tools
from sparsex.sampling_params import SamplingParams


def _unsupported(field: str, why: str = "is not supported by this server") -> None:
    raise bad_request(f"{field} {why}", param=field, code="unsupported_parameter")


def check_supported(req: _SamplingFields, settings: ServerSettings) -> None:
    """400 for OpenAI features that would otherwise be silently ignored, and for `reuse` overrides
    the operator did not allow."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            _unsupported(name)
    if req.logit_bias:
        _unsupported("logit_bias")
    if req.stream_options is not None and not req.stream:
        _unsupported("stream_options", "is only allowed when stream is true")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            _unsupported("top_logprobs", "needs logprobs: true")
        if req.response_format and req.response_format.get("type", "text") != "text":
            _unsupported("response_format", "other than {'type': 'text'} is not supported")
        try:
            check_tools(req.tools, req.tool_choice)
        except ToolSpecError as e:
            raise bad_request(str(e), param=e.param) from e
    if req.reuse is not None and not settings.allow_reuse_overrides:
        raise APIError(400, "per-request 'reuse' overrides are disabled on this server: they change what the "
                            "shared segment cache keeps (start the server with --allow-reuse-overrides; to "
                            "ingest segments, POST /v1/segments)", param="reuse", code="reuse_overrides_disabled")
    if req.reuse is not None:
        try:    # the engine checks again (against the model's layer count) when it queues the request
            dataclasses.replace(ReuseConfig(), **req.reuse.overrides()).verify()
        except ValueError as e:
            raise bad_request(str(e), param="reuse") from e
    if isinstance(req, CompletionRequest):
        if req.echo:
            _unsupported("echo")
        if req.suffix:
            _unsupported("suffix")
        if req.best_of is not None and req.best_of != req.n:
            _unsupported("best_of", "other than n is not supported")


def to_sampling_params(req: _SamplingFields, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """`max_tokens=None`: up to the context length."""
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            min_p=req.min_p or 0.0,
            seed=req.seed,
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as e:
        raise bad_request(str(e)) from e


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return to_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    return to_sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
