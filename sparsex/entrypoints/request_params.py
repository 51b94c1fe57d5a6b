"""From an HTTP request body to the engine's SamplingParams, refusing what the engine cannot do."""
from __future__ import annotations

import dataclasses
import re
from typing import Any

from sparsex.config import ReuseConfig
from sparsex.entrypoints.errors import APIError, bad_request
from sparsex.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from sparsex.entrypoints.settings import ServerSettings
from sparsex.entrypoints.tool_parsers import ToolSpecError, check_tools
from sparsex.sampling_params import InvalidParamError, SamplingParams, StructuredOutputsParams

_TOKEN_ID = re.compile(r"[0-9]+")
# vLLM's structured_outputs keys this server implements
_STRUCTURED_KEYS = ("json", "json_object", "grammar")


def _unsupported(field: str, why: str = "is not supported by this server") -> None:
    raise bad_request(f"{field} {why}", param=field, code="unsupported_parameter")


def check_supported(req: _SamplingFields, settings: ServerSettings) -> None:
    """400 for OpenAI features that would otherwise be silently ignored, and for `reuse` overrides
    the operator did not allow."""
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            _unsupported(name)
    if req.stream_options is not None and not req.stream:
        _unsupported("stream_options", "is only allowed when stream is true")
    if isinstance(req, ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            _unsupported("top_logprobs", "needs logprobs: true")
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


def logit_bias(req: _SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}) -> {token id: bias}; a key that is no token id is a
    400 naming it. The bias range is SamplingParams.verify's, a token id past the vocabulary the engine's."""
    if not req.logit_bias:
        return None
    out: dict[int, float] = {}
    for key, bias in req.logit_bias.items():
        if not _TOKEN_ID.fullmatch(key.strip()):
            raise bad_request(f"logit_bias key {key!r} is not a token id (a non-negative integer)",
                              param="logit_bias", code="invalid_logit_bias")
        out[int(key)] = bias
    return out


def _response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (no constraint), json_object, json_schema {name, schema, strict}.
    The output always follows the schema, strict or not (strict only shapes what OpenAI accepts)."""
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                          param="response_format", code="unsupported_parameter")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format json_schema must be an object {name, schema, strict}",
                          param="response_format.json_schema")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"response_format json_schema.schema must be a JSON schema object, got "
                          f"{type(schema).__name__}", param="response_format.json_schema.schema",
                          code="invalid_json_schema")
    if spec.get("strict") not in (None, True, False):
        raise bad_request(f"response_format json_schema.strict must be a boolean, got {spec.get('strict')!r}",
                          param="response_format.json_schema.strict")
    return StructuredOutputsParams(json=schema)


def _structured_extension(so: dict[str, Any]) -> StructuredOutputsParams:
    unknown = sorted(set(so) - set(_STRUCTURED_KEYS))
    if unknown:
        raise bad_request(f"structured_outputs keys {unknown} are not supported (supported: "
                          f"{list(_STRUCTURED_KEYS)})", param="structured_outputs", code="unsupported_parameter")
    return StructuredOutputsParams(**so)


def _structured_field(req: _SamplingFields) -> str | None:
    """The request field that constrains the output: chat's response_format, or vLLM's
    structured_outputs / guided_json on either endpoint; at most one of them (None: no constraint)."""
    given = [name for name in ("response_format", "structured_outputs", "guided_json")
             if getattr(req, name, None) is not None and not (name == "response_format"
                                                              and req.response_format.get("type", "text") == "text")]
    if len(given) > 1:
        raise bad_request(f"give at most one of {given}", param=given[1], code="unsupported_parameter")
    return given[0] if given else None


def structured_outputs(req: _SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the spec, the request field it came from: `_structured_field`)."""
    field = _structured_field(req)
    if field is None:
        return None, None
    try:
        if field == "response_format":
            return _response_format(req.response_format), field
        if field == "structured_outputs":
            return _structured_extension(req.structured_outputs), field
        return StructuredOutputsParams(json=req.guided_json), field
    except ValueError as e:         # StructuredOutputsParams.verify names the problem
        raise bad_request(str(e), param=field, code="invalid_structured_output") from e


def engine_fields(req: _SamplingFields) -> dict[str, str]:
    """SamplingParams field -> this request's field, for errors the engine raises (a schema xgrammar
    cannot compile is reported against response_format on chat)."""
    field = _structured_field(req)
    return {"structured_outputs": field} if field else {}


def to_sampling_params(req: _SamplingFields, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """`max_tokens=None`: up to the context length."""
    spec, _ = structured_outputs(req)
    bias = logit_bias(req)
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
            structured_outputs=spec,
            logit_bias=bias,
        )
    except InvalidParamError as e:
        raise bad_request(str(e), param=e.param, code=e.code) from e
    except ValueError as e:
        raise bad_request(str(e)) from e


def chat_sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    return to_sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)


def completion_sampling_params(req: CompletionRequest) -> SamplingParams:
    return to_sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs)
