"""Admission-time planning of a blended prefill: which of a request's segments the segment index
serves, locked until the forward that copies them has run.

For a request whose prompt is P (exact prefix hit) + reused segments R1..Rm + new tokens N, the
scheduler asks `ReusePlanner.plan` for R1..Rm once it knows P, confirms with `admitted` when the
request got its blocks, and `release`s a plan that will not run (preemption, allocation failure,
abort) or has run (the engine, after the step). The forward side is `step_blend.py`; what the engine
does with the request's segments after the step is `segment_registrar.py`.

A request whose hits total fewer than `min_blend_tokens` does not blend at all (its hits are
recomputed and it is served exact), and an entry computed right after a short head
(`min_context_tokens`) serves only early positions; either is reported on the request
(`RequestOutput.reuse_skipped`).
"""
from __future__ import annotations

from dataclasses import dataclass

from sparsex.config import ReuseConfig
from sparsex.inputs import SegmentSpan
from sparsex.request import Request
from sparsex.segment.segment_index import SegmentEntry, SegmentIndex


@dataclass(frozen=True)
class ReusePlan:
    """The segment hits one request blends in its (single) prefill step, locked in the index."""
    reuse: ReuseConfig
    hits: tuple[tuple[SegmentSpan, SegmentEntry], ...]

    @property
    def num_reused_tokens(self) -> int:
        return sum(span.end - span.start for span, _ in self.hits)

    @property
    def first_reused_position(self) -> int:
        return min(span.start for span, _ in self.hits)


@dataclass(frozen=True)
class _Pending:
    """What a planned, not yet admitted request looked up: counted once, at admission."""
    queried: int                        # tokens of the segments looked up
    entries: tuple[SegmentEntry, ...]   # the entries it blends
    skipped: str | None                 # why found entries are not (all) reused


class ReusePlanner:
    def __init__(self, index: SegmentIndex):
        self.index = index
        self._pending: dict[str, _Pending] = {}

    def plan(self, req: Request, num_prefix_hit: int) -> ReusePlan | None:
        """The hits `req` blends after its first `num_prefix_hit` (cached) tokens, locked; None:
        the request is computed exactly."""
        reuse = req.reuse
        hits = []
        found_unblended = False   # blend=False: an entry exists that this request will not reuse
        early = []            # entries found, but computed too early for their position here
        queried = 0
        toks = req.prompt_token_ids
        # evaluation (teacher forcing): the prompt proper ends at the query horizon, so a teacher-
        # forced run plans exactly the hits the plain request plans
        end = req.num_prompt_tokens if req.query_horizon is None else min(req.query_horizon, req.num_prompt_tokens)
        for span in req.segments:
            if span.start < num_prefix_hit or span.end - span.start < reuse.min_segment_tokens:
                continue
            if span.end >= end:
                continue          # the last prompt token must be computed: its logits start decoding
            if not reuse.blend:
                # computed exactly (the registrar merges its segments); looked up only to report it
                found_unblended |= self.index.lookup(toks[span.start:span.end], req.cache_salt, count=False) is not None
                continue
            queried += span.end - span.start
            # counted in `admitted`: a request that waits is planned again next step
            entry = self.index.lookup(toks[span.start:span.end], req.cache_salt, count=False)
            if entry is not None and too_early_for(entry, span.start, reuse):
                early.append(span)
                entry = None      # recomputed here; the registrar then replaces the early encoding
            if entry is not None:
                hits.append((span, entry))
        if not reuse.blend:
            skipped = "blend=False: computed exactly" if found_unblended else None
            self._pending[req.request_id] = _Pending(0, (), skipped)
            return None
        reasons = []
        if early:
            reasons.append(f"{len(early)} segment{'s' if len(early) > 1 else ''} computed right after a short head "
                           f"(min_context_tokens={reuse.min_context_tokens}): recomputed")
        plan = ReusePlan(reuse, tuple(hits))
        blends = bool(hits) and plan.num_reused_tokens >= reuse.min_blend_tokens
        if hits and not blends:
            reasons.append(f"hits below min_blend_tokens ({plan.num_reused_tokens} < {reuse.min_blend_tokens})")
        skipped = "; ".join(reasons) or None
        if not blends:
            self._pending[req.request_id] = _Pending(queried, (), skipped)   # too little to blend: exact
            return None
        for _, entry in hits:
            self.index.lock(entry)
        self._pending[req.request_id] = _Pending(queried, tuple(e for _, e in hits), skipped)
        req.reuse_plan = plan
        return plan

    def admitted(self, req: Request) -> None:
        """The scheduler admitted the request with its plan: count the lookups once, and say why
        found segments are not reused (`Request.reuse_skipped`)."""
        pending = self._pending.pop(req.request_id, _Pending(0, (), None))
        self.index.record_lookups(pending.queried, list(pending.entries))
        req.reuse_skipped = pending.skipped

    def release(self, req: Request) -> None:
        """Unlock a plan that will not run (preemption, allocation failure, abort) or has run."""
        self._pending.pop(req.request_id, None)
        plan = req.reuse_plan
        if plan is not None:
            for _, entry in plan.hits:
                self.index.unlock(entry)
            req.reuse_plan = None


def too_early_for(entry: SegmentEntry, start: int, reuse: ReuseConfig) -> bool:
    """`entry` was computed with too little before it (`min_context_tokens`) to serve a span that
    starts at `start`, which has more."""
    return early(entry.start_pos, reuse) and not early(start, reuse)


def early(start: int, reuse: ReuseConfig) -> bool:
    """A segment starting at `start` has only the prompt's start before it (`min_context_tokens`)."""
    return start < reuse.min_context_tokens
