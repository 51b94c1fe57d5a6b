"""Segment ingestion: computing a corpus's segments ahead of the requests that will reuse them.

`LLM.ingest` and `POST /v1/segments` share this plan. The segments are computed in prompts of
`group_size` segments after `prefix` (the application's system prompt or preamble, if any): pass 1
in the given order, passes 2..N regrouped in seeded shuffles and sent with `reuse={"blend": False}`,
so each segment is computed exactly in another context and its index entry becomes the mean of its
encodings (ReuseConfig.merge_encodings). A mean over contexts is nearer any new context than one
encoding (docs/benchmarks/defaults.md, merged encodings). Every prompt generates one token: only its KV matters.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from sparsex.config import check_knobs, knob
from sparsex.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.outputs import RequestOutput

# later passes compute exactly and merge into the index entries instead of blending
MERGE_PASS_REUSE = {"blend": False}
INGEST_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


@dataclass(frozen=True)
class IngestParams:
    """How a corpus is ingested: the defaults and bounds of both `LLM.ingest` and `POST /v1/segments`."""
    # each pass computes the whole corpus again: the bound caps what one request can ask for
    passes: int = knob(3, "pass 1 in order; later passes regroup the segments and merge each one's encodings",
                       ge=1, le=16)
    group_size: int = knob(8, "segments per ingestion prompt", ge=1)
    seed: int = knob(0, "seed of the later passes' shuffles")

    def __post_init__(self) -> None:
        check_knobs(self)


@dataclass(frozen=True)
class IngestResult:
    num_prompts: int                    # prompts run, over all passes
    num_segments: int                   # segments given
    num_tokens_computed: int            # prompt tokens computed (prefix-cache hits not counted)
    num_segment_entries: int | None     # entries in the engine's segment index afterwards (None: cache != sparsex)


@dataclass(frozen=True)
class IngestPlan:
    passes: list[list[Any]]             # per pass, the TokenizedPrompts to run (in any order within a pass)
    reuse: list[dict | None]            # per pass, its reuse overrides (MERGE_PASS_REUSE after the first)
    num_segments: int

    @property
    def num_prompts(self) -> int:
        return sum(len(p) for p in self.passes)


def check_ingest_args(segments: Any, prefix: Any) -> list[str]:
    """The segments as a list of non-empty strings; ValueError naming the bad argument otherwise."""
    if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence):
        raise ValueError(f"segments must be a list of strings, got {type(segments).__name__}")
    segments = list(segments)
    if not segments:
        raise ValueError("segments must be a non-empty list of strings")
    for i, s in enumerate(segments):
        if not isinstance(s, str) or not s:
            raise ValueError(f"segments[{i}] must be a non-empty string, got {s!r:.40}")
    if prefix is not None and (not isinstance(prefix, str) or not prefix):
        raise ValueError(f"prefix must be a non-empty string or None, got {prefix!r:.40}")
    return segments


def plan_ingest(engine: LLMEngine, segments: Sequence[str], *, prefix: str | None, cache_salt: str | None,
                params: IngestParams) -> IngestPlan:
    """Tokenize every ingestion prompt (on the engine's thread); ValueError before anything runs if
    an argument is bad or a prompt does not fit max_model_len."""
    segments = check_ingest_args(segments, prefix)
    passes, group_size = params.passes, params.group_size
    if not engine.config.enable_prefix_caching:
        raise ValueError("ingesting segments needs cache='sparsex' (or 'prefix'); this engine caches nothing")
    lead = [prefix] if prefix is not None else []
    limit = engine.max_model_len
    for i, seg in enumerate(segments):
        n = len(engine.tokenize({"segments": [*lead, seg], "cache_salt": cache_salt}).token_ids)
        if n >= limit:
            raise ValueError(f"segments[{i}] (after the prefix) has {n} tokens; max_model_len is {limit}")
    rng = random.Random(params.seed)
    plan: list[list[Any]] = []
    for p in range(passes):
        order = segments if p == 0 else rng.sample(segments, len(segments))
        prompts = []
        for start in range(0, len(order), group_size):
            tp = engine.tokenize({"segments": [*lead, *order[start:start + group_size]], "cache_salt": cache_salt})
            if len(tp.token_ids) >= limit:
                raise ValueError(f"a group of {group_size} segments has {len(tp.token_ids)} tokens; max_model_len "
                                 f"is {limit}: lower group_size")
            prompts.append(tp)
        plan.append(prompts)
    merge = MERGE_PASS_REUSE if engine.config.enable_segment_reuse else None
    return IngestPlan(plan, [None] + [merge] * (passes - 1), len(segments))


def ingest_result(engine: LLMEngine, plan: IngestPlan, outputs: list[RequestOutput]) -> IngestResult:
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens - o.num_reused_tokens + o.num_recomputed_tokens
                   for o in outputs)
    entries = engine.stats().num_segment_entries if engine.config.enable_segment_reuse else None
    return IngestResult(num_prompts=plan.num_prompts, num_segments=plan.num_segments,
                        num_tokens_computed=computed, num_segment_entries=entries)
