"""The reuse record's lifecycle on synthetic blocks (no model): a plan is locked while its request is
admitted and released exactly once, by the scheduler when the admission fails or by the engine after
the step; whatever ends the request afterwards (finish, abort, preemption) holds no plan; the
counters are written once, at admission."""
from __future__ import annotations

import numpy as np
import pytest

from sparsex.cache.block_pool import BlockPool
from sparsex.cache.kv_cache_manager import KVCacheManager
from sparsex.config import EngineConfig, ReuseConfig
from sparsex.engine.scheduler import Scheduler
from sparsex.inputs import SegmentSpan
from sparsex.request import Request, RequestStatus
from sparsex.sampling_params import SamplingParams
from sparsex.segment.reuse_planner import ReusePlanner
from sparsex.segment.segment_index import SegmentIndex
from sparsex.segment.span_index import SpanIndex

pytestmark = pytest.mark.unit

BS = 16
rng = np.random.default_rng(3)
REUSE = ReuseConfig(min_blend_tokens=64, min_context_tokens=0).resolved(4)


def toks(n: int) -> list[int]:
    return rng.integers(100, 30000, size=n).tolist()


class Engine:
    """The scheduler's world as LLMEngine wires it, on a pool of `num_blocks` blocks."""

    def __init__(self, num_blocks: int = 64, budget: int = 4096, transparent: bool = False):
        self.spans = SpanIndex(BS)
        pool = BlockPool(num_blocks, enable_caching=True, on_evict=self.spans.on_evict)
        self.index = SegmentIndex(pool, BS, "lru", spans=self.spans)
        self.kv = KVCacheManager(pool, BS, reclaim=self.index.evict_blocks, on_exact_run=self.spans.add_request_run)
        self.planner = ReusePlanner(self.index, self.spans, None)
        config = EngineConfig(block_size=BS, max_num_batched_tokens=budget, max_num_seqs=8)
        self.scheduler = Scheduler(config, self.kv, self.planner)
        self.reuse = ReuseConfig(min_blend_tokens=64, min_context_tokens=0,
                                 transparent_segments=transparent).resolved(4)

    def add_entry(self, tokens: list[int], start_pos: int = 64):
        first, last = start_pos // BS, (start_pos + len(tokens) - 1) // BS
        blocks = [None] * first + self.kv.pool.get_new_blocks(last - first + 1)
        entry = self.index.insert(tokens, None, blocks, start_pos)
        self.kv.pool.free_blocks([b for b in blocks if b is not None])
        return entry

    def request(self, rid: str, pieces: list[list[int]]) -> Request:
        """A prompt made of `pieces`, each an explicit segment."""
        ids, segments = [], []
        for p in pieces:
            segments.append(SegmentSpan(len(ids), len(ids) + len(p)))
            ids += p
        req = Request(rid, ids, SamplingParams(max_tokens=4), 0.0, segments=segments, reuse=self.reuse, max_tokens=4)
        self.scheduler.add(req)
        return req

    def step_done(self, sched) -> None:
        """What LLMEngine.step does with a step's plans and tokens (no forward here: a request
        whose prompt is computed samples token 7)."""
        for plan in sched.reuse_plans:
            self.planner.release(plan)
        self.scheduler.advance(sched)
        for s in sched.scheduled:
            if s.request.num_computed_tokens >= s.request.num_tokens:
                s.request.output_token_ids.append(7)

    def check(self) -> None:
        refs: dict[int, int] = {}
        for req in self.scheduler.running:
            for b in req.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for bid, c in self.index.block_refs().items():
            refs[bid] = refs.get(bid, 0) + c
        self.index.check_integrity()
        self.planner.check_integrity()
        self.kv.pool.check_integrity(refs)


def test_a_plan_is_locked_while_admitted_and_released_once_after_the_step():
    eng = Engine()
    passage = toks(96)
    entry = eng.add_entry(passage)
    req = eng.request("a", [toks(20), passage, toks(10)])
    sched = eng.scheduler.schedule()
    record = req.reuse_record
    assert record is not None and record.plan is not None and sched.reuse_plans == [record.plan]
    assert entry.locks == 1                                   # locked for the step's copy
    with pytest.raises(RuntimeError, match="still locked"):
        eng.planner.check_integrity()                         # live until the step releases it
    eng.step_done(sched)
    assert entry.locks == 0
    eng.check()
    with pytest.raises(RuntimeError, match="not live"):
        eng.planner.release(record.plan)                      # exactly once
    # the record stays what the admission decided; the counters were written once, at admission
    assert [(s.start, s.end, s.source) for s in record.reused_spans] == [(20, 116, "segment")]
    assert record.num_reused_tokens == 96 and record.exact_prefix_len == 20
    assert (eng.index.query_tokens, eng.index.hit_tokens) == (116, 96)   # the 20- and 96-token segments (the last one holds the last token)
    # a later step of the same request carries no plan
    assert eng.scheduler.schedule().reuse_plans == []


def test_a_failed_admission_releases_its_plan_and_counts_nothing():
    eng = Engine(budget=64)
    passage = toks(96)
    entry = eng.add_entry(passage)
    running = eng.request("r", [toks(40)])                    # takes part of the budget first
    sched = eng.scheduler.schedule()
    eng.step_done(sched)
    blended = eng.request("b", [toks(20), passage, toks(10)])
    sched = eng.scheduler.schedule()                          # r decodes; b's blend cannot be chunked
    assert [s.request for s in sched.scheduled] == [running]
    assert entry.locks == 0 and blended.reuse_record is None  # planned, released, not admitted
    eng.check()
    before = (eng.index.query_tokens, eng.index.hit_tokens, eng.kv.prefix_queries)
    eng.step_done(sched)
    eng.scheduler.finish(running, RequestStatus.FINISHED_STOPPED)
    sched = eng.scheduler.schedule()                          # alone, it may exceed the budget
    assert [s.request for s in sched.scheduled] == [blended] and sched.reuse_plans
    assert eng.index.query_tokens - before[0] == 116 and eng.index.hit_tokens - before[1] == 96
    assert eng.kv.prefix_queries - before[2] == blended.num_tokens
    eng.step_done(sched)
    eng.check()


def test_preemption_and_abort_hold_no_plan_and_readmission_plans_anew():
    # 17 blocks: the entry (6) and a (8) leave 3; b (9) is admitted by evicting the entry, and
    # a's ninth block (at its 129th token) then preempts b, the newest
    eng = Engine(num_blocks=17)
    passage = toks(96)
    eng.add_entry(passage)
    a = eng.request("a", [toks(20), passage, toks(10)])
    sched = eng.scheduler.schedule()
    first = a.reuse_record
    eng.step_done(sched)
    b = eng.request("b", [toks(140)])
    for _ in range(8):
        sched = eng.scheduler.schedule()
        eng.step_done(sched)
        eng.check()
        if a.num_preemptions or b.num_preemptions:
            break
    victim = a if a.num_preemptions else b
    assert victim.num_preemptions == 1 and victim.blocks == [] and victim.num_exact_cached_blocks == 0
    eng.planner.check_integrity()                             # preemption released nothing: nothing was held
    eng.scheduler.finish(b if victim is a else a, RequestStatus.FINISHED_ABORTED)
    preempted_record = victim.reuse_record
    assert preempted_record is not None and (victim is b or preempted_record is first)
    sched = eng.scheduler.schedule()
    assert victim in [s.request for s in sched.scheduled]
    assert victim.reuse_record is not preempted_record        # readmission: a new record
    eng.step_done(sched)
    eng.scheduler.finish(victim, RequestStatus.FINISHED_ABORTED)
    eng.check()
    assert eng.kv.pool.usage().num_in_use == sum(len(e.blocks) for e in eng.index.entries.values())


def test_a_request_that_reads_no_cache_gets_an_empty_record():
    eng = Engine()
    passage = toks(96)
    entry = eng.add_entry(passage)
    req = eng.request("p", [toks(20), passage, toks(10)])
    req.params = SamplingParams(max_tokens=4, prompt_logprobs=0)   # prompt logprobs: every position computed
    sched = eng.scheduler.schedule()
    assert req.reuse_record is not None and req.reuse_record.plan is None and req.reuse_record.reused_spans == ()
    assert entry.locks == 0 and sched.reuse_plans == []
    eng.step_done(sched)
    eng.check()
