"""A request as the engine tracks it: tokens, progress (`num_computed_tokens`), blocks, outputs."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from sparsex.cache.block_hash import BlockHash
from sparsex.config import ReuseConfig
from sparsex.inputs import SegmentSpan
from sparsex.outputs import RequestMetrics, ReusedSpan
from sparsex.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    cache_salt: str | None = None
    segments: list[SegmentSpan] = field(default_factory=list)
    reuse: ReuseConfig | None = None          # per-request segment-reuse knobs (None: no reuse)
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    distributions: dict[int, torch.Tensor] | None = None     # SamplingParams.distributions_from
    num_computed_tokens: int = 0
    blocks: list = field(default_factory=list)          # the block table, as KVCacheBlock objects
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_exact_cached_blocks: int = 0          # blocks[:n] are registered on the exact chain
    generator: torch.Generator | None = None
    output_text: str = ""
    detokenizer: object | None = None         # engine.detokenizer.IncrementalDetokenizer, made at the first token
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # segment reuse
    reuse_plan: object | None = None          # segment.reuse_planner.ReusePlan, locked until its forward ran
    reuse_skipped: str | None = None          # why found segments were not (all) reused (set at admission)
    exact_prefix_len: int | None = None       # KV at positions >= this is approximate (blended)
    approx_block_hashes: list[BlockHash] = field(default_factory=list)   # approximate chain from block exact_prefix_len // block_size
    num_approx_cached_blocks: int = 0         # of approx_block_hashes, how many are registered in the pool
    segments_registered: bool = False
    prompt_token_array: object | None = None  # [num_prompt_tokens] int32 numpy copy, made by the planner's span search
    query_horizon: int | None = None          # TokenizedPrompt.query_horizon: tokens at/after it are a
                                              # scored continuation, hidden from reuse planning and selection
    # cache statistics of the (last) prefill: num_cached_tokens set at admission, the reuse counters
    # and spans from the step result of its first prefill step (RequestOutput's fields of those names)
    num_cached_tokens: int = 0
    num_reused_tokens: int = 0        # approximate-prefix tokens + segment-hit tokens
    num_recomputed_tokens: int = 0
    num_candidate_tokens: int = 0     # two-stage selection: reused tokens the first stage kept
    reused_spans: list[ReusedSpan] = field(default_factory=list)
    metrics: RequestMetrics = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        if self.params.distributions_from is not None:
            self.distributions = {}

    @property
    def approx_prefix_enabled(self) -> bool:
        """Reads and writes the approximate prefix chain (see cache/kv_cache_manager.py)."""
        return (self.reuse is not None and self.reuse.approx_prefix and self.reuse.blend
                and self.reuse.selector != "all")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
