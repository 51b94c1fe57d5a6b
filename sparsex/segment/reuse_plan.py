"""What segment reuse decided for one request: the spans its blended prefill copies (`ReusePlan`)
and the per-request record of that admission (`ReuseRecord`).

Lifetimes:
  ReusePlan    made and locked by `ReusePlanner.plan` while the scheduler admits the request, and
               released exactly once by `ReusePlanner.release`: by the scheduler when the admission
               fails (budget, allocation), else by the engine once the step that copies the hits has
               launched its forward. A plan never outlives the step it was made in, so preemption,
               abort and finish never hold one (`ReusePlanner.check_integrity` asserts it).
  ReuseRecord  made by the planner at admission, attached to the request by `ReusePlanner.admit`
               (a readmission after preemption replaces it); what `RequestOutput` reports.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparsex.cache.block_pool import KVCacheBlock
from sparsex.config import ReuseConfig
from sparsex.outputs import ReusedSpan
from sparsex.segment.segment_index import SegmentEntry


@dataclass(frozen=True)
class SpanHit:
    """One reused span: prompt positions [start, end) take the KV computed at positions
    [start_pos, start_pos + end - start), held by `blocks` (blocks[0] holds start_pos's block)."""
    start: int
    end: int
    start_pos: int
    blocks: tuple[KVCacheBlock, ...]
    source: str                       # "segment" | "indexed" | "request" (ReusedSpan.source)
    entry: SegmentEntry | None        # the index entry it came from ("segment", "indexed")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, eq=False)
class ReusePlan:
    """The spans one request blends in its (single) prefill step, sorted by start. Identity
    matters (eq=False): the planner tracks each live plan until it is released."""
    reuse: ReuseConfig
    hits: tuple[SpanHit, ...]

    @property
    def num_reused_tokens(self) -> int:
        return sum(h.num_tokens for h in self.hits)

    @property
    def first_reused_position(self) -> int:
        return self.hits[0].start


@dataclass(eq=False)
class ReuseRecord:
    """A request's segment reuse for its latest admission. Every field has one writer:

      field                  writer                       when
      plan                   ReusePlanner.plan            admission (None: computed exactly)
      reused_spans           ReusePlanner.plan            admission
      exact_prefix_len       ReusePlanner.plan            admission
      skipped                ReusePlanner.plan            admission
      num_query_tokens       ReusePlanner.plan            admission (counted by the index at `admit`)
      num_recomputed_tokens  LLMEngine (step result)      after the admission's first step
      num_candidate_tokens   LLMEngine (step result)      after the admission's first step
    """
    plan: ReusePlan | None = None
    # the approximate-chain prefix the request continued, then the spans of its plan, by position
    reused_spans: tuple[ReusedSpan, ...] = ()
    # KV at positions >= this is approximate (continued along the approximate chain, or blended);
    # None: every position is exact
    exact_prefix_len: int | None = None
    skipped: str | None = None        # why found spans were not (all) reused
    num_query_tokens: int = 0         # tokens looked up in the segment index (segments, or the searched range)
    num_recomputed_tokens: int = 0    # reused tokens the selection recomputed
    num_candidate_tokens: int = 0     # two-stage selection: reused tokens the first stage kept

    @property
    def num_reused_tokens(self) -> int:
        """Approximate-prefix tokens + span-hit tokens."""
        return sum(span.num_tokens for span in self.reused_spans)
