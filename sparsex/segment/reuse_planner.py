"""Admission-time planning of a blended prefill: which spans of a request's prompt reuse KV the
engine holds, held until the forward that copies them has run.

For a request whose prompt is P (prefix hit: exact, then approximate) + reused spans R1..Rm + new
tokens N, the scheduler asks `ReusePlanner.plan` for its `ReuseRecord` (segment/reuse_plan.py) once
it knows P. A record whose plan blends holds locks; the plan is released exactly once
(`release`): by the scheduler if the admission fails, else by the engine once the step's forward
has copied the hits. `admit` attaches the record to the admitted request and counts its lookups.
The forward side is `step_blend.py`; what the engine does with the request's prompt after the step
is `segment_registrar.py`.

Spans are found two ways, in this order:
  segment      an explicit segment of the prompt (a message, a `segments` piece) found whole in the
               segment index (`SegmentIndex.lookup`);
  transparent  every other maximal run of at least `min_segment_tokens` tokens equal to tokens whose
               KV the engine holds, found by content (`span_index.SpanIndex.find`): inside an index
               entry ("indexed") or in the exact prefix-cached KV of an earlier request ("request").
               A run that covers explicit hits and the glue between them replaces them.
               `ReuseConfig.transparent_segments` turns it off.
  shared       with a shared store that shares spans (EngineConfig.segment_store_spans), the
               stretches of at least `min_segment_tokens` tokens that neither found are looked up by
               content in the store's anchor index (`SegmentTiers.load_by_content`: fetched, verified
               token by token, installed as entries), and the span search runs again to find them.
               A local hit by content on KV not yet in the store (a request run, a found stretch)
               publishes that stretch there at admission: it recurred (`SegmentTiers.publish_span`).

A request whose hits total fewer than `min_blend_tokens` does not blend at all (its hits are
recomputed and it is served exact), and KV computed right after a short head (`min_context_tokens`)
serves only early positions; either is reported on the request (`RequestOutput.reuse_skipped`).
Hit entries are locked (not evicted or replaced) and the blocks of request-KV hits pinned (not
reallocated) until the plan is released.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from sparsex.config import AUTO, ReuseConfig
from sparsex.outputs import ReusedSpan
from sparsex.segment.segment_request import SegmentRequest
from sparsex.segment.recompute_budget import auto_recompute_ratio
from sparsex.segment.reuse_plan import ReusePlan, ReuseRecord, SpanHit
from sparsex.segment.segment_index import SegmentEntry, SegmentIndex
from sparsex.segment.segment_tiers import SegmentTiers
from sparsex.segment.span_index import SpanIndex, resolve_spans


class ReusePlanner:
    def __init__(self, index: SegmentIndex, spans: SpanIndex | None, store: SegmentTiers | None):
        self.index = index
        self.spans = spans
        self.store = store        # the tiers below the device, or None
        self._live: dict[int, ReusePlan] = {}      # id -> plan: locked, not yet released
        self.num_plans = 0        # plans made (locked)
        self.num_released = 0
        # (request id, stretches) looked up in the shared anchor index: a request that waits is planned
        # again each step, and asks the store again only for stretches it did not ask about (bounded)
        self._looked_up: dict[tuple, None] = {}

    def plan(self, req: SegmentRequest, num_exact_hit: int, num_approx: int, search: bool = True) -> ReuseRecord:
        """`req`'s reuse for this admission: after its first `num_exact_hit` exact and `num_approx`
        approximate-chain prefix tokens, the spans it blends (`record.plan`, locked until
        `release`; None: computed exactly). `search=False` (the request reads no cache) finds nothing."""
        num_prefix_hit = num_exact_hit + num_approx
        prefix = (ReusedSpan(num_exact_hit, num_prefix_hit, "approx_prefix"),) if num_approx else ()
        record = self._find(req, num_prefix_hit) if search else ReuseRecord()
        if record.plan is not None and record.plan.reuse.recompute_ratio == AUTO:
            # up to `prompt_end`: a teacher-forced evaluation gets the ratio the plain request gets
            num_new = req.prompt_end - num_prefix_hit - record.plan.num_reused_tokens
            ratio = auto_recompute_ratio(num_new, num_approx + record.plan.num_reused_tokens)
            record.plan = ReusePlan(dataclasses.replace(record.plan.reuse, recompute_ratio=ratio), record.plan.hits)
        plan = record.plan
        record.reused_spans = prefix + tuple(ReusedSpan(h.start, h.end, h.source) for h in (plan.hits if plan else ()))
        record.exact_prefix_len = num_exact_hit if num_approx else (plan.first_reused_position if plan else None)
        if plan is not None:
            for h in plan.hits:
                if h.entry is not None:
                    self.index.lock(h.entry)
                else:
                    self.index.pool.touch(list(h.blocks))
            self._live[id(plan)] = plan
            self.num_plans += 1
        return record

    def _find(self, req: SegmentRequest, num_prefix_hit: int) -> ReuseRecord:
        """The spans `req` could blend after `num_prefix_hit` tokens, and why found ones are not used."""
        reuse = req.reuse
        hits: list[SpanHit] = []
        found_unblended = False   # blend=False: an entry exists that this request will not reuse
        early = []            # segments found, but computed too early for their position here
        queried = 0
        toks = req.prompt_token_ids
        end = req.prompt_end
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
            return ReuseRecord(skipped="blend=False: computed exactly" if found_unblended else None)
        if reuse.transparent_segments and self.spans is not None and end - 1 > num_prefix_hit:
            if req.prompt_token_array is None:
                req.prompt_token_array = np.asarray(toks, dtype=np.int32)
            runs = self.spans.find(req.prompt_token_array, num_prefix_hit, end - 1, req.cache_salt,
                                   reuse.min_segment_tokens, early, reuse.min_context_tokens)
            if self.store is not None and self.store.shares_spans:
                served = [(m.start, m.end) for m in runs] + [(h.start, h.end) for h in hits] + early
                unserved = [(a, b) for a, b in fresh_intervals(num_prefix_hit, end - 1, served)
                            if b - a >= reuse.min_segment_tokens]
                if unserved and self._first_lookup(req.request_id, unserved) and self.store.load_by_content(
                        req.prompt_token_array, unserved, req.cache_salt, self.index, reuse.min_segment_tokens):
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
        # too little to blend: computed exactly
        return ReuseRecord(plan=plan if blends else None, skipped="; ".join(reasons) or None, num_query_tokens=queried)

    def _fetch_missing(self, req: SegmentRequest, num_prefix_hit: int, end: int) -> None:
        """Segments of `req` the device does not hold, brought in from the tiers below it (host
        memory, the shared store) as ordinary entries, before the request is planned."""
        toks, reuse = req.prompt_token_ids, req.reuse
        missing = [toks[s.start:s.end] for s in req.segments
                   if s.start >= num_prefix_hit and s.end - s.start >= reuse.min_segment_tokens and s.end < end
                   and self.index.lookup(toks[s.start:s.end], req.cache_salt, count=False) is None]
        if not missing:
            return
        self.store.load([(m, req.cache_salt) for m in missing], self.index)

    def _first_lookup(self, request_id: str, stretches: list[tuple[int, int]]) -> bool:
        key = (request_id, tuple(stretches))
        if key in self._looked_up:
            return False
        if len(self._looked_up) >= 4096:
            del self._looked_up[next(iter(self._looked_up))]
        self._looked_up[key] = None
        return True

    def admit(self, req: SegmentRequest, record: ReuseRecord) -> None:
        """The scheduler admitted `req` with `record`: attach it, and count its lookups once (a
        request that waits is planned again at each step)."""
        hits = record.plan.hits if record.plan is not None else ()
        # request-KV hits are served by no entry: counted as hit tokens too
        self.index.record_lookups(record.num_query_tokens, [(h.entry, h.num_tokens) for h in hits if h.entry is not None],
                                  request_hit_tokens=sum(h.num_tokens for h in hits if h.entry is None))
        req.reuse_record = record
        if hits and self.store is not None and self.store.shares_spans:
            # what recurred here by content goes to the shared store (explicit segments went at insert)
            toks = req.prompt_token_ids
            for h in hits:
                if h.source == "request" or (h.source == "indexed" and not h.entry.explicit and not h.entry.shared):
                    self.store.publish_span(toks[h.start:h.end], req.cache_salt, h.blocks, h.start_pos)

    def release(self, plan: ReusePlan) -> None:
        """Unlock a plan: its admission failed, or the forward that copies its hits has launched
        (later kernels on the stream read the copies, not the entries). Exactly once per plan."""
        if self._live.pop(id(plan), None) is None:
            raise RuntimeError("release of a reuse plan that is not live (released twice, or never planned)")
        self.num_released += 1
        for h in plan.hits:
            if h.entry is not None:
                self.index.unlock(h.entry)
            else:
                self.index.pool.free_blocks(list(reversed(h.blocks)))

    def check_integrity(self) -> None:
        """Between steps no plan is live: each was released exactly once."""
        if self._live or self.num_plans != self.num_released:
            raise RuntimeError(f"{len(self._live)} reuse plans still locked between steps "
                               f"({self.num_plans} planned, {self.num_released} released)")


def too_early_for(entry: SegmentEntry, start: int, reuse: ReuseConfig) -> bool:
    """`entry` was computed with too little before it (`min_context_tokens`) to serve a span that
    starts at `start`, which has more."""
    return early(entry.start_pos, reuse) and not early(start, reuse)


def early(start: int, reuse: ReuseConfig) -> bool:
    """A segment starting at `start` has only the prompt's start before it (`min_context_tokens`)."""
    return start < reuse.min_context_tokens


def fresh_intervals(start: int, end: int, taken: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) minus the `taken` intervals, as sorted disjoint intervals."""
    out, at = [], start
    for a, b in sorted(taken):
        if b <= at or a >= end:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < end:
        out.append((at, end))
    return out
