"""The HTTP API's request and response bodies: OpenAI's shapes plus SparseX's extension fields.

Requests ignore unknown fields (OpenAI clients send new ones all the time) but reject values of
known OpenAI features the engine does not implement, so a client never silently gets something
other than what it asked for. Field bounds live here so they show up in `/openapi.json`; the
engine re-checks everything (`SamplingParams.verify`, prompt length) and its ValueErrors become 400s.
"""
from __future__ import annotations

import dataclasses
import time
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from sparsex.config import ReuseConfig, knob_field, knob_meta, knob_others, knob_type
from sparsex.entrypoints.ingest import IngestParams
from sparsex.sampling_params import MAX_LOGPROBS

# torch.Generator.manual_seed takes at most 64 bits and the engine seeds choice i with seed + i:
# the signed 64-bit range leaves room for any n.
_SEED_MIN, _SEED_MAX = -(2 ** 63), 2 ** 63 - 1
# Each choice is a separate engine sequence: bound the fan-out one request can ask for.
MAX_N = 128


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Response(BaseModel):
    model_config = ConfigDict(allow_inf_nan=True)


# ---- shared pieces ----------------------------------------------------------------------------
class CacheSegment(_Request):
    """Which cache namespace a prompt piece may be shared in. `tenant` (default): only with
    requests of the same tenant / cache_salt. `shared`: with everyone (needs --allow-shared-segments)."""
    scope: Literal["tenant", "shared"] = "tenant"


class StreamOptions(_Request):
    include_usage: bool = False


class _ReuseOptionsBase(_Request):
    # a misspelt knob is an error here, not silently the engine default
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def overrides(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


def _knob_field(f: dataclasses.Field, *, optional: bool = False, **bounds: Any) -> Any:
    """A request field with a knob's default (None if `optional`), bounds and help; `bounds`: the HTTP
    layer's own, for a knob that declares none."""
    meta = knob_meta(f)
    return Field(default=None if optional else f.default, **{"ge": meta["ge"], "le": meta["le"], **bounds},
                 description=meta["help"] or None)


def _reuse_options_model() -> type[_ReuseOptionsBase]:
    """One optional field per ReuseConfig field, typed, bounded and described by its knob metadata:
    a new ReuseConfig knob is a request field without further code."""
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(ReuseConfig):
        others = knob_others(ReuseConfig, f)
        if others:     # recompute_ratio: a bounded number or "auto" (the bounds go on the number alone)
            meta = knob_meta(f)
            number = Annotated[knob_type(ReuseConfig, f), Field(ge=meta["ge"], le=meta["le"])]
            fields[f.name] = (typing.Union[(number, *others, None)],
                              Field(default=None, description=meta["help"] or None))
        else:
            fields[f.name] = (knob_type(ReuseConfig, f) | None, _knob_field(f, optional=True))
    return create_model("ReuseOptions", __base__=_ReuseOptionsBase,
                        __doc__="Per-request overrides of the segment-reuse knobs (cache mode `sparsex` "
                                "only; refused unless the server runs with --allow-reuse-overrides).",
                        **fields)


ReuseOptions = _reuse_options_model()


class _SamplingFields(_Request):
    """Sampling fields common to both endpoints (OpenAI's, then vLLM-style extensions)."""
    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=_SEED_MIN, le=_SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted for compatibility; anything but the neutral value is rejected
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, description="isolates this request's cache entries (see docs/server.md)")
    reuse: ReuseOptions | None = Field(default=None, description="per-request segment-reuse knobs (needs "
                                       "--allow-reuse-overrides; docs/configuration.md)")
    # vLLM's structured-output extensions (chat also takes OpenAI's response_format)
    structured_outputs: dict[str, Any] | None = Field(default=None, description="the output must match: "
                                                      "{'json': schema} | {'json_object': true} | {'grammar': ebnf}")
    guided_json: dict[str, Any] | str | None = Field(default=None, description="older vLLM spelling of "
                                                     "structured_outputs={'json': schema}")


# ---- chat -------------------------------------------------------------------------------------
class TextPart(_Request):
    type: Literal["text"] = "text"
    text: str
    cache_segment: CacheSegment | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type", "text") != "text":
            raise ValueError(f"only text content parts are supported, got type {data.get('type')!r}")
        return data


class ChatMessage(_Request):
    role: str = Field(min_length=1)
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def to_template(self) -> dict[str, Any]:
        """The dict the chat template sees (content parts keep their text only)."""
        out = self.model_dump(exclude_none=True, include={"role", "content", "name", "tool_calls", "tool_call_id"})
        if isinstance(self.content, list):
            out["content"] = [{"type": "text", "text": p.text} for p in self.content]
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: dict[str, Any] | None = None
    # extension: render the assistant cue after the last message (off to continue a message)
    add_generation_prompt: bool = True


# ---- completions ------------------------------------------------------------------------------
class SegmentPart(_Request):
    """One piece of a `segments` prompt given as an object (plain strings / id lists also work)."""
    text: str | None = None
    token_ids: list[int] | None = None
    cache_segment: CacheSegment | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] | None = None
    # extension: the prompt as reusable pieces, in place of `prompt`
    segments: list[str | list[int] | SegmentPart] | None = None
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


# ---- segment ingestion ------------------------------------------------------------------------
class IngestRequest(_Request):
    """POST /v1/segments: compute these segments ahead of the requests that will reuse them
    (sparsex/entrypoints/ingest.py)."""
    model: str | None = None
    segments: list[str] = Field(min_length=1, description="the texts to ingest (e.g. a corpus's passages)")
    prefix: str | None = Field(default=None, description="text every ingestion prompt starts with: the "
                               "application's system prompt or preamble")
    cache_salt: str | None = Field(default=None, description="namespace of the entries (the tenant header "
                                   "overrides it, as for completions)")
    passes: int = _knob_field(knob_field(IngestParams, "passes"))
    group_size: int = _knob_field(knob_field(IngestParams, "group_size"))
    seed: int = _knob_field(knob_field(IngestParams, "seed"), ge=_SEED_MIN, le=_SEED_MAX)


class IngestResponse(_Response):
    object: Literal["segments.ingest"] = "segments.ingest"
    num_prompts: int
    num_segments: int
    num_tokens_computed: int
    num_segment_entries: int | None = Field(description="entries in the segment index afterwards, all "
                                            "tenants (null: cache mode is not sparsex)")


# ---- tokenize ---------------------------------------------------------------------------------
class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None           # with messages: rendered by the chat template, as in chat
    segments: list[str | list[int] | SegmentPart] | None = None
    add_generation_prompt: bool = True


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    segments: list[tuple[int, int]] = Field(description="[start, end) token spans the engine may reuse")


# ---- responses --------------------------------------------------------------------------------
class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class ReusedSpanInfo(_Response):
    start: int                          # prompt positions [start, end)
    end: int
    source: str = Field(description="'segment' (an explicit segment found whole in the segment index), "
                                    "'indexed' (found by content inside a segment-index entry), 'request' "
                                    "(found by content in the cached KV of an earlier request), or "
                                    "'approx_prefix' (blocks an earlier blended request left)")
    prompt_index: int = Field(default=0, description="which prompt of a batched completions request")


class SparseXUsage(_Response):
    prefix_cached_tokens: int = 0       # exact prefix-cache hits
    segment_reused_tokens: int = 0      # served from the segment cache (approximate KV, then blended)
    transparent_reused_tokens: int = 0  # of those, found by content (sources 'indexed' and 'request')
    recomputed_tokens: int = 0          # reused tokens the sparse layers recomputed
    reused_spans: list[ReusedSpanInfo] = Field(default_factory=list,
                                               description="where segment_reused_tokens sit in the prompt")
    reuse_skipped: str | None = Field(default=None, description="why indexed segments were found but not "
                                                                "reused (null: all reused, or none found)")


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    sparsex: SparseXUsage = Field(default_factory=SparseXUsage)


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCallInfo(_Response):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCallInfo(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallInfo


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallInfo] | None = None


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None     # vLLM extension: the stop string / token that matched


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    # OpenAI's shape: {"index", "id", "type", "function": {"name", "arguments"}} on a call's first
    # delta, then {"index", "function": {"arguments": <fragment>}}
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sparsex"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
