"""Admission-time planning of a blended prefill: which spans of a request's prompt reuse KV the
engine holds, held until the forward that copies them has run.

For a request whose prompt is P (exact prefix hit) + reused spans R1..Rm + new tokens N, the
scheduler asks `ReusePlanner.plan` for R1..Rm once it knows P, confirms with `admitted` when the
request got its blocks, and `release`s a plan that will not run (preemption, allocation failure,
abort) or has run (the engine, after the step). The forward side is `step_blend.py`; what the engine
does with the request's prompt after the step is `segment_registrar.py`.

Spans are found two ways, in this order:
  segment      an explicit segment of the prompt (a message, a `segments` piece) found whole in the
               segment index (`SegmentIndex.lookup`);
  transparent  every other maximal run of at least `min_segment_tokens` tokens equal to tokens whose
               KV the engine holds, found by content (`span_index.SpanIndex.find`): inside an index
               entry ("indexed") or in the exact prefix-cached KV of an earlier request ("request").
               A run that covers explicit hits and the glue between them replaces them.
               `ReuseConfig.transparent_segments` turns it off.

A request whose hits total fewer than `min_blend_tokens` does not blend at all (its hits are
recomputed and it is served exact), and KV computed right after a short head (`min_context_tokens`)
serves only early positions; either is reported on the request (`RequestOutput.reuse_skipped`).
Hit entries are locked (not evicted or replaced) and the blocks of request-KV hits pinned (not
reallocated) until the plan is released.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparsex.cache.block_pool import KVCacheBlock
from sparsex.config import ReuseConfig
from sparsex.request import Request
from sparsex.segment.segment_index import SegmentEntry, SegmentIndex
from sparsex.segment.span_index import SpanIndex, resolve_spans


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


@dataclass(frozen=True)
class ReusePlan:
    """The spans one request blends in its (single) prefill step, sorted by start."""
    reuse: ReuseConfig
    hits: tuple[SpanHit, ...]

    @property
    def num_reused_tokens(self) -> int:
        return sum(h.num_tokens for h in self.hits)

    @property
    def first_reused_position(self) -> int:
        return self.hits[0].start


@dataclass(frozen=True)
class _Pending:
    """What a planned, not yet admitted request looked up: counted once, at admission."""
    queried: int                                   # tokens looked up (segments, or the searched range)
    entries: tuple[tuple[SegmentEntry, int], ...]  # the entries it blends, with the tokens each serves
    skipped: str | None                            # why found spans are not (all) reused


class ReusePlanner:
    def __init__(self, index: SegmentIndex, spans: SpanIndex | None = None, store=None):
        self.index = index
        self.spans = spans
        self.store = store        # kvstore.segment_store.SegmentStore: tiers below the device, or None
        self._pending: dict[str, _Pending] = {}

    def plan(self, req: Request, num_prefix_hit: int) -> ReusePlan | None:
        """The spans `req` blends after its first `num_prefix_hit` (cached) tokens, held; None:
        the request is computed exactly."""
        reuse = req.reuse
        hits: list[SpanHit] = []
        found_unblended = False   # blend=False: an entry exists that this request will not reuse
        early = []            # segments found, but computed too early for their position here
        queried = 0
        toks = req.prompt_token_ids
        # evaluation (teacher forcing): the prompt proper ends at the query horizon, so a teacher-
        # forced run plans exactly the hits the plain request plans
        end = req.num_prompt_tokens if req.query_horizon is None else min(req.query_horizon, req.num_prompt_tokens)
        if self.store is not None and reuse.blend:
            self._fetch_missing(req, num_prefix_hit, end)
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
                early.append((span.start, span.end))
                entry = None      # recomputed here; the registrar then replaces the early encoding
            if entry is not None:
                hits.append(SpanHit(span.start, span.end, entry.start_pos, tuple(entry.blocks), "segment", entry))
        if not reuse.blend:
            skipped = "blend=False: computed exactly" if found_unblended else None
            self._pending[req.request_id] = _Pending(0, (), skipped)
            return None
        if reuse.transparent_segments and self.spans is not None and end - 1 > num_prefix_hit:
            if req.prompt_token_array is None:
                req.prompt_token_array = np.asarray(toks, dtype=np.int32)
            runs = self.spans.find(req.prompt_token_array, num_prefix_hit, end - 1, req.cache_salt,
                                   reuse.min_segment_tokens, early, reuse.min_context_tokens)
            # A run found by content that covers explicit hits and serves more than they do (the
            # template glue between re-sent messages, which no segment holds) replaces them, unless
            # one of them holds merged encodings (nearer this context than the run's one encoding);
            # otherwise the explicit hits stand and the runs keep only what lies outside them
            replaced = set()
            for m in runs:
                covered = [i for i, h in enumerate(hits) if m.start <= h.start and h.end <= m.end]
                if covered and sum(hits[i].num_tokens for i in covered) < m.num_tokens \
                        and all(hits[i].entry.num_encodings == 1 for i in covered):
                    replaced.update(covered)
            hits = [h for i, h in enumerate(hits) if i not in replaced]
            taken = [(h.start, h.end) for h in hits] + early
            for m in resolve_spans(runs, taken, reuse.min_segment_tokens):
                pos, blocks = m.source.blocks_for(m.offset, m.num_tokens)
                entry = m.source.entry
                hits.append(SpanHit(m.start, m.end, pos, blocks, "indexed" if entry is not None else "request", entry))
            queried = end - 1 - num_prefix_hit
            hits.sort(key=lambda h: h.start)
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
        for h in hits:
            if h.entry is not None:
                self.index.lock(h.entry)
            else:
                self.index.pool.touch(list(h.blocks))
        self._pending[req.request_id] = _Pending(
            queried, tuple((h.entry, h.num_tokens) for h in hits if h.entry is not None), skipped)
        req.reuse_plan = plan
        return plan

    def _fetch_missing(self, req: Request, num_prefix_hit: int, end: int) -> None:
        """Segments of `req` the device does not hold, brought in from the tiers below it (host
        memory, the shared store) as ordinary entries, before the request is planned."""
        toks, reuse = req.prompt_token_ids, req.reuse
        missing = [toks[s.start:s.end] for s in req.segments
                   if s.start >= num_prefix_hit and s.end - s.start >= reuse.min_segment_tokens and s.end < end
                   and self.index.lookup(toks[s.start:s.end], req.cache_salt, count=False) is None]
        if not missing:
            return
        self.store.load([(m, req.cache_salt) for m in missing])

    def admitted(self, req: Request) -> None:
        """The scheduler admitted the request with its plan: count the lookups once, and say why
        found spans are not reused (`Request.reuse_skipped`)."""
        pending = self._pending.pop(req.request_id, _Pending(0, (), None))
        self.index.record_lookups(pending.queried, list(pending.entries))
        plan = req.reuse_plan
        if plan is not None:      # request-KV hits are served by no entry: counted as hit tokens too
            self.index.hit_tokens += sum(h.num_tokens for h in plan.hits if h.entry is None)
        req.reuse_skipped = pending.skipped

    def release(self, req: Request) -> None:
        """Unlock a plan that will not run (preemption, allocation failure, abort) or has run."""
        self._pending.pop(req.request_id, None)
        plan = req.reuse_plan
        if plan is not None:
            for h in plan.hits:
                if h.entry is not None:
                    self.index.unlock(h.entry)
                else:
                    self.index.pool.free_blocks(list(reversed(h.blocks)))
            req.reuse_plan = None


def too_early_for(entry: SegmentEntry, start: int, reuse: ReuseConfig) -> bool:
    """`entry` was computed with too little before it (`min_context_tokens`) to serve a span that
    starts at `start`, which has more."""
    return early(entry.start_pos, reuse) and not early(start, reuse)


def early(start: int, reuse: ReuseConfig) -> bool:
    """A segment starting at `start` has only the prompt's start before it (`min_context_tokens`)."""
    return start < reuse.min_context_tokens
