"""Continuous batching under a token budget: FCFS, chunked prefill, decode and prefill mixed in one
step, preemption by recompute when the KV pool runs out (the newest running request goes first).

There is no separate "prefill phase": every request just has `num_computed_tokens` of its
`num_tokens`; a step gives it `num_new_tokens` more (1 for a decode, a chunk for a prefill).
A request that blends reused segments (SparseX) must run its whole uncomputed prompt in one step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sparsex.cache.kv_cache_manager import KVCacheManager
from sparsex.config import EngineConfig
from sparsex.outputs import ReusedSpan
from sparsex.request import Request, RequestStatus
from sparsex.segment.reuse_planner import ReusePlan, ReusePlanner


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    reuse_plan: ReusePlan | None = None     # the segment hits a blended prefill copies in this step
    admitted: bool = False                  # the request's first step since (re)admission
    num_approx_tokens: int = 0              # admitted: approximate-chain prefix tokens, after the exact hit


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)     # can never fit in the KV pool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, segment_planner: ReusePlanner | None = None):
        self.config = config
        self.kv = kv
        self.segment_planner = segment_planner     # plans segment reuse for a request's first prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        if self.segment_planner is not None:
            self.segment_planner.release(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        # recomputed from scratch on readmission: whatever KV it gets then decides what is exact
        req.exact_prefix_len = None
        req.approx_block_hashes, req.num_approx_cached_blocks = [], 0
        req.num_exact_cached_blocks = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()

        # 1) running requests, oldest first
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:          # preempted earlier in this loop
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new <= 0:
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = next((r for r in reversed(self.running) if r.request_id not in scheduled_ids), None)
                if victim is None:
                    break
                self._preempt(victim, out)
                if victim is req:
                    break
            if req not in self.running or req.request_id in scheduled_ids:
                continue
            if len(req.blocks) * self.kv.block_size < req.num_computed_tokens + num_new:
                continue                          # could not get room even after preempting
            out.scheduled.append(ScheduledRequest(req, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new

        # 2) waiting requests, FCFS; none are admitted in a step that had to preempt
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # prompt_logprobs ask for every prompt position, and a cached position has no logits:
            # such a request reads no cache (as in vLLM); its blocks are still cached for others
            reads_cache = req.params.prompt_logprobs is None
            hits, num_hit = self.kv.get_computed_blocks(req) if reads_cache else ([], 0)
            approx_hits: list = []
            if self.segment_planner is not None and req.approx_prefix_enabled and reads_cache:
                approx_hits = self.kv.get_approx_blocks(req, hits)
            num_approx = len(approx_hits) * self.kv.block_size
            plan = None
            if self.segment_planner is not None and req.reuse is not None and reads_cache:
                plan = self.segment_planner.plan(req, num_hit + num_approx)
            num_new = req.num_tokens - req.num_computed_tokens - num_hit - num_approx
            if plan is not None:
                # a blended prefill cannot be chunked; it may exceed the budget only alone
                if num_new > budget and out.scheduled:
                    self.segment_planner.release(req)
                    break
            else:
                num_new = min(num_new, budget)
            if not self.kv.allocate_slots(req, num_new, hits + approx_hits):
                if plan is not None:
                    self.segment_planner.release(req)
                if not self.running and not out.scheduled:
                    # nothing will ever free blocks for it: the pool is too small for this request
                    self.waiting.popleft()
                    req.status = RequestStatus.FINISHED_ABORTED
                    req.stop_reason = "kv_cache_too_small"
                    out.aborted.append(req)
                    continue
                break
            self.waiting.popleft()
            if self.segment_planner is not None and req.reuse is not None:
                self.segment_planner.admitted(req)
            self.kv.prefix_queries += req.num_tokens
            self.kv.prefix_hits += num_hit
            req.num_computed_tokens += num_hit + num_approx
            req.num_cached_tokens = num_hit
            if num_approx:
                self.kv.approx_prefix_hits += num_approx
            if num_approx or plan is not None:
                # KV from here on is approximate (continued along the approximate chain, or blended in
                # this step); known before the forward, so its block hashes can be made during it
                req.exact_prefix_len = num_hit if num_approx else plan.first_reused_position
            req.reused_spans = ([ReusedSpan(num_hit, num_hit + num_approx, "approx_prefix")] if num_approx else []) + (
                [ReusedSpan(h.start, h.end, h.source) for h in plan.hits] if plan is not None else [])
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, plan, admitted=True, num_approx_tokens=num_approx))
            scheduled_ids.add(req.request_id)
            budget -= num_new
        return out

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length, aborted) and release its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        if self.segment_planner is not None:
            self.segment_planner.release(req)
