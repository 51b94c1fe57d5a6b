"""A request as the engine tracks it: tokens, progress (`num_computed_tokens`), blocks, outputs.

Each field has one writer (docs/architecture.md has the table with the when):
  LLMEngine.add_request   everything passed to the constructor (`grammar` included)
  Scheduler               status, stop_reason, num_computed_tokens, num_cached_tokens, num_preemptions
  LLMEngine (step)        output_token_ids, output_logprobs, output_text, detokenizer, prompt_logprobs,
                          distributions, metrics, the state of `grammar` (its matcher accepts each token)
  KVCacheManager          blocks, block_hashes, num_exact_cached_blocks, approx_block_hashes,
                          num_approx_cached_blocks
  ReusePlanner            reuse_record, prompt_token_array
  SegmentRegistrar        segments_registered
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from sparsex.cache.block_hash import BlockHash
from sparsex.config import ReuseConfig
from sparsex.inputs import SegmentSpan
from sparsex.outputs import RequestMetrics
from sparsex.sampling_params import SamplingParams
from sparsex.segment.reuse_plan import ReuseRecord


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


class TokenCounts:
    """`num_prompt_tokens` and `num_tokens` of anything with `prompt_token_ids` and `output_token_ids`
    (a request, or a tensor-parallel rank's copy of one: engine/tp_step.py)."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(eq=False)
class Request(TokenCounts):
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
    generator: torch.Generator | None = None  # SamplingParams.seed: this request's own draws
    query_horizon: int | None = None          # TokenizedPrompt.query_horizon: tokens at/after it are a
                                              # scored continuation, hidden from reuse planning and selection
    grammar: object | None = None             # engine.structured_output.RequestGrammar (SamplingParams.
                                              # structured_outputs): this request's own matcher

    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0                # exact prefix-cache hit of the (last) admission
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    distributions: dict[int, torch.Tensor] | None = None     # SamplingParams.distributions_from
    output_text: str = ""
    detokenizer: object | None = None         # engine.detokenizer.IncrementalDetokenizer, made at the first token
    metrics: RequestMetrics = None  # type: ignore[assignment]
    # KV blocks (cache/kv_cache_manager.py)
    blocks: list = field(default_factory=list)          # the block table, as KVCacheBlock objects
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_exact_cached_blocks: int = 0          # blocks[:n] are registered on the exact chain
    approx_block_hashes: list[BlockHash] = field(default_factory=list)   # approximate chain from block exact_prefix_len // block_size
    num_approx_cached_blocks: int = 0         # of approx_block_hashes, how many are registered in the pool
    # segment reuse
    reuse_record: ReuseRecord | None = None   # the latest admission's (segment/reuse_plan.py); None: no reuse
    prompt_token_array: object | None = None  # [num_prompt_tokens] int32 numpy copy, made by the planner's span search
    segments_registered: bool = False

    def __post_init__(self) -> None:
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        if self.params.distributions_from is not None:
            self.distributions = {}

    @property
    def exact_prefix_len(self) -> int | None:
        """KV at positions >= this is approximate (blended, or continued along the approximate
        chain); None: all of it is exact."""
        return None if self.reuse_record is None else self.reuse_record.exact_prefix_len

    @property
    def prompt_end(self) -> int:
        """Where the prompt proper ends for reuse: the query horizon, if any (a teacher-forced
        evaluation plans, selects and indexes exactly what the plain request does)."""
        n = len(self.prompt_token_ids)
        return n if self.query_horizon is None else min(self.query_horizon, n)

    @property
    def approx_prefix_enabled(self) -> bool:
        """Reads and writes the approximate prefix chain (see cache/kv_cache_manager.py)."""
        return (self.reuse is not None and self.reuse.approx_prefix and self.reuse.blend
                and self.reuse.selector != "all")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
