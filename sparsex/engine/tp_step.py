"""The one message a tensor-parallel step sends from rank 0 to the other ranks, and its two ends.

Rank 0 owns everything that decides (scheduler, block pool, prefix and segment indexes, span
search, reuse plans, sampling). The other ranks only run the forward on their shard, so they need
what `ModelRunner.launch` reads of a step and nothing else:

  per scheduled request   num_computed_tokens and num_new_tokens; the prompt and the params that
                          shape the forward (prompt_logprobs, distributions_from), the first time;
                          output tokens and block ids the rank does not have yet; the reuse plan of
                          the step that admits a blended request (its hits' spans and block ids)
  per step                the requests that finished; KV writes made outside a forward (merged
                          encodings, segment/segment_registrar.py; host-tier spills and installs,
                          kvstore/segment_store.py), in the order rank 0 made them; whether to reseed
                          the blend state

`StepMessageBuilder` (rank 0) remembers what each rank was sent; `StepMirror` (ranks > 0) keeps a
`MirrorRequest` per live request and turns each message into the `SchedulerOutput` the local
`ModelRunner.launch` runs, so every rank takes the same code path and makes the same collectives.
A decode step's message is a few integers per request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from sparsex.config import ReuseConfig
from sparsex.engine.scheduler import ScheduledRequest, SchedulerOutput
from sparsex.request import TokenCounts
from sparsex.segment.reuse_plan import ReusePlan, ReuseRecord, SpanHit


class _Block(NamedTuple):
    """A block as the forward reads it: its id."""
    block_id: int


@dataclass(frozen=True)
class MirrorParams:
    """The sampling params that change what the forward computes (not how rank 0 samples)."""
    prompt_logprobs: int | None
    distributions_from: int | None


@dataclass(frozen=True)
class PlanMessage:
    reuse: ReuseConfig
    hits: tuple[tuple[int, int, int, tuple[int, ...]], ...]   # (start, end, start_pos, block ids)


@dataclass(frozen=True)
class RequestDelta:
    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    new_output_tokens: tuple[int, ...]                # appended to the rank's copy
    new_block_ids: tuple[int, ...]                     # appended (or the whole table when reset_blocks)
    reset_blocks: bool
    prompt_token_ids: tuple[int, ...] | None = None    # the first time only, with params and horizon
    params: MirrorParams | None = None
    query_horizon: int | None = None
    plan: PlanMessage | None = None                    # the admission step of a blended request


@dataclass(frozen=True)
class KVMerge:
    """A merged-encoding write (segment_registrar.SegmentRegistrar._merge) to replay on every rank."""
    src: np.ndarray
    mean: np.ndarray
    dst: np.ndarray
    delta: np.ndarray
    weight: float


@dataclass(frozen=True)
class HostMove:
    """A host-tier move of rank 0's shard (kvstore/segment_store.py) to make with this rank's:
    "spill" (gather `slots` into the rank's host copy under `key`), "evict" (drop it), "take" (rank 0
    took the record back: it is installed next, or gone), "install" (write the taken record to `slots`),
    "clear" (drop every record)."""
    op: str
    key: str | None
    slots: np.ndarray | None


@dataclass(frozen=True)
class StepMessage:
    requests: tuple[RequestDelta, ...] = ()
    finished: tuple[str, ...] = ()
    kv_ops: tuple[KVMerge | HostMove, ...] = ()       # applied before the step's forward, in order
    reset_blend_state: bool = False
    stop: bool = False                                  # the engine is closing: ranks exit


@dataclass
class _Sent:
    blocks: list                    # rank 0's block list object the ids came from
    num_blocks: int
    num_outputs: int


class StepMessageBuilder:
    """Rank 0's side: builds each step's message from its `SchedulerOutput`."""

    def __init__(self):
        self._sent: dict[str, tuple[object, _Sent]] = {}      # request id -> (request, what was sent)
        self._kv_ops: list[KVMerge | HostMove] = []
        self._reset = False

    def add_kv_op(self, op: KVMerge | HostMove) -> None:
        self._kv_ops.append(op)

    def reset_blend_state(self) -> None:
        self._reset = True

    def build(self, sched: SchedulerOutput) -> StepMessage:
        finished = tuple(rid for rid, (req, _) in self._sent.items() if req.is_finished)
        for rid in finished:
            del self._sent[rid]
        deltas = []
        for s in sched.scheduled:
            req = s.request
            known = self._sent.get(req.request_id)
            first = known is None
            if first:
                sent = _Sent(req.blocks, 0, 0)
                self._sent[req.request_id] = (req, sent)
            else:
                sent = known[1]
            reset = sent.blocks is not req.blocks or sent.num_blocks > len(req.blocks)
            start = 0 if reset else sent.num_blocks
            new_blocks = tuple(b.block_id for b in req.blocks[start:])
            sent.blocks, sent.num_blocks = req.blocks, len(req.blocks)
            outputs = tuple(req.output_token_ids[sent.num_outputs:])
            sent.num_outputs = len(req.output_token_ids)
            plan = s.reuse_plan
            deltas.append(RequestDelta(
                req.request_id, req.num_computed_tokens, s.num_new_tokens, outputs, new_blocks, reset,
                prompt_token_ids=tuple(req.prompt_token_ids) if first else None,
                params=MirrorParams(req.params.prompt_logprobs, req.params.distributions_from) if first else None,
                query_horizon=req.query_horizon if first else None,
                plan=None if plan is None else PlanMessage(plan.reuse, tuple(
                    (h.start, h.end, h.start_pos, tuple(b.block_id for b in h.blocks)) for h in plan.hits))))
        msg = StepMessage(tuple(deltas), finished, tuple(self._kv_ops), self._reset)
        self._kv_ops, self._reset = [], False
        return msg


@dataclass(eq=False)
class MirrorRequest(TokenCounts):
    """A rank's copy of what the forward reads of a request (sparsex.request.Request's names)."""
    request_id: str
    prompt_token_ids: list[int]
    params: MirrorParams
    query_horizon: int | None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    blocks: list = field(default_factory=list)
    reuse_record: ReuseRecord | None = None


class StepMirror:
    """A rank's side: the live requests' copies, updated by each message."""

    def __init__(self):
        self.requests: dict[str, MirrorRequest] = {}

    def apply(self, msg: StepMessage) -> SchedulerOutput:
        for rid in msg.finished:
            self.requests.pop(rid, None)
        out = SchedulerOutput()
        for d in msg.requests:
            if d.prompt_token_ids is not None:
                self.requests[d.request_id] = MirrorRequest(d.request_id, list(d.prompt_token_ids), d.params,
                                                            d.query_horizon)
            req = self.requests.get(d.request_id)
            if req is None:
                raise RuntimeError(f"tensor-parallel step names request {d.request_id!r}, which this rank never saw")
            req.output_token_ids.extend(d.new_output_tokens)
            req.num_computed_tokens = d.num_computed_tokens
            if d.reset_blocks:
                req.blocks = [_Block(b) for b in d.new_block_ids]     # a new list: BlockTables rebuilds
            else:
                req.blocks.extend(_Block(b) for b in d.new_block_ids)
            req.reuse_record = None
            if d.plan is not None:
                hits = tuple(SpanHit(start, end, start_pos, tuple(_Block(b) for b in ids), "segment", None)
                             for start, end, start_pos, ids in d.plan.hits)
                req.reuse_record = ReuseRecord(plan=ReusePlan(d.plan.reuse, hits))
            out.scheduled.append(ScheduledRequest(req, d.num_new_tokens, admitted=d.plan is not None))
        return out
