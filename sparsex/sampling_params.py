"""Per-request sampling parameters (vLLM's names and defaults)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

# A temperature below this is greedy (vLLM's _SAMPLING_EPS): dividing logits by it would overflow
# and the resulting distribution is argmax anyway. Shared with the sampler so both agree.
GREEDY_TEMPERATURE_EPS = 1e-5

# Largest top-k a request may ask for (logprobs / prompt_logprobs); vLLM's default max_logprobs.
MAX_LOGPROBS = 20

# logit_bias values are clipped to this range by OpenAI; here a value outside it is an error.
MAX_LOGIT_BIAS = 100.0


class InvalidParamError(ValueError):
    """A request the engine refuses, naming the SamplingParams field (`param`) and, for the server's
    400, an error `code`."""

    def __init__(self, message: str, param: str, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def _is_int(x: object) -> bool:
    # bool is a subclass of int; `top_k=True` is a caller bug, not the integer 1.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match; exactly one of these is set (verify() names the problem).

    Compiled by engine/structured_output.py (xgrammar) when the request is queued; a schema or
    grammar it cannot compile is refused there, before anything is allocated."""
    json: dict | str | None = None        # a JSON schema (a dict or its JSON text)
    json_object: bool = False             # any JSON object
    grammar: str | None = None            # an EBNF grammar in xgrammar's dialect (root rule `root`)

    def __post_init__(self) -> None:
        self.verify()

    def verify(self) -> None:
        chosen = [name for name, on in (("json", self.json is not None), ("json_object", self.json_object is not False),
                                        ("grammar", self.grammar is not None)) if on]
        if len(chosen) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, json_object, grammar; "
                             f"got {chosen or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            else:
                schema = self.json
            # a JSON schema is an object (or the boolean schema `true`, which constrains nothing: refused)
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {type(schema).__name__}")
        if self.json_object is not False and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"structured_outputs.grammar must be a non-empty EBNF string, got {self.grammar!r}")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                 # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None        # per-request generator: same seed, same tokens, whatever the batch
    max_tokens: int | None = 16    # None: up to max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None    # top-k logprobs of each generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    # scoring: the full next-token log-distribution at every position >= this one that the request
    # computes (the prompt's tail, then each generated token), in RequestOutput.distributions
    distributions_from: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # the output must match this (JSON schema, any JSON object, EBNF grammar): engine/structured_output.py
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None      # token id -> bias in [-100, 100], added to the logits

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.verify()

    def verify(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        # `not x >= 0` rather than `x < 0`: NaN compares False both ways and must be rejected.
        if not _is_real(self.temperature) or not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or k < 0 or k > MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {k!r}")
        if self.distributions_from is not None and (not _is_int(self.distributions_from) or self.distributions_from < 0):
            raise ValueError(f"distributions_from must be an integer >= 0, got {self.distributions_from!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError(f"structured_outputs must be StructuredOutputsParams, "
                                 f"got {type(self.structured_outputs).__name__}")
            self.structured_outputs.verify()
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for tok, bias in self.logit_bias.items():
                if not _is_int(tok) or tok < 0:
                    raise InvalidParamError(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}",
                                            param="logit_bias", code="invalid_logit_bias")
                if not _is_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise InvalidParamError(f"logit_bias[{tok}] must be in [-100, 100], got {bias!r}",
                                            param="logit_bias", code="invalid_logit_bias")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS
