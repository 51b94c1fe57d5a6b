"""Continuous batching under a token budget: FCFS, chunked prefill, decode and prefill mixed in one
step, preemption by recompute when the KV pool runs out (the newest running request goes first).

There is no separate "prefill phase": every request just has `num_computed_tokens` of its
`num_tokens`; a step gives it `num_new_tokens` more (1 for a decode, a chunk for a prefill).
A request that blends reused segments (SparseX) must run its whole uncomputed prompt in one step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from sparsex.cache.kv_cache_manager import KVCacheManager, PrefixHit
from sparsex.config import EngineConfig
from sparsex.request import Request, RequestStatus
from sparsex.segment.reuse_plan import ReusePlan, ReuseRecord
from sparsex.segment.reuse_planner import ReusePlanner


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    admitted: bool = False                  # the request's first step since (re)admission

    @property
    def reuse_plan(self) -> ReusePlan | None:
        """The segment hits a blended prefill copies in this step: its admission's plan (the
        request's reuse record holds it; a plan runs only in the step that admitted it)."""
        record = self.request.reuse_record
        return record.plan if self.admitted and record is not None else None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)     # can never fit in the KV pool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def reuse_plans(self) -> list[ReusePlan]:
        return [s.reuse_plan for s in self.scheduled if s.reuse_plan is not None]


class Scheduler:
    """The one writer of a request's status, stop_reason, num_computed_tokens, num_cached_tokens
    and num_preemptions."""

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
        req.status = RequestStatus.PREEMPTED
        # recomputed from scratch on readmission: whatever KV it gets then decides what is exact
        # (readmission plans a new reuse record)
        req.num_computed_tokens = 0
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
            planner = self.segment_planner if req.reuse is not None else None
            hit = (self.kv.find_prefix(req, approx=planner is not None and req.approx_prefix_enabled)
                   if reads_cache else PrefixHit([], [], self.kv.block_size))
            record: ReuseRecord | None = None
            if planner is not None:
                record = planner.plan(req, hit.num_exact_tokens, hit.num_approx_tokens, search=reads_cache)
            plan = record.plan if record is not None else None
            num_new = req.num_tokens - req.num_computed_tokens - hit.num_tokens
            if plan is None:
                num_new = min(num_new, budget)
            # a blended prefill cannot be chunked; it may exceed the budget only alone
            fits = plan is None or num_new <= budget or not out.scheduled
            if not (fits and self.kv.admit(req, num_new, hit)):
                if plan is not None:
                    planner.release(plan)         # the plan of an admission that failed
                if fits and not self.running and not out.scheduled:
                    # nothing will ever free blocks for it: the pool is too small for this request
                    self.waiting.popleft()
                    self.finish(req, RequestStatus.FINISHED_ABORTED, "kv_cache_too_small")
                    out.aborted.append(req)
                    continue
                break
            self.waiting.popleft()
            if record is not None:
                planner.admit(req, record)
            req.num_computed_tokens += hit.num_tokens
            req.num_cached_tokens = hit.num_exact_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, admitted=True))
            scheduled_ids.add(req.request_id)
            budget -= num_new
        return out

    def advance(self, sched: SchedulerOutput) -> None:
        """The step's forward has launched: its scheduled tokens count as computed (on the GPU the
        kernels still run; anything that reads their KV is scheduled by a later step)."""
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        """Retire a request (stopped, length, aborted) and release its blocks. It holds no reuse
        plan: a plan never outlives the step that made it (segment/reuse_plan.py)."""
        req.status = status
        req.stop_reason = stop_reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
