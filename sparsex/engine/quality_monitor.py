"""The live quality monitor (`quality_sample`): what segment reuse did to the answers actually served.

For a sampled share of blended requests, once the response is out, the engine scores the served answer
by teacher forcing, with the offline fidelity bench's own functions (engine/teacher_forcing.py), in
capacity no request wants:
  reference  full prefill of prompt + answer (no segment reuse; exact prefix caching only, which is
             exact), its next-token log-distribution at every answer position;
  blended    prompt + answer under the request's own reuse knobs, the answer being a continuation
             (`TokenizedPrompt.query_horizon`), so the blend plans and selects what the served prompt did;
and records KL(reference || blended) and top-1 agreement, averaged over the answer's positions.

Scheduling contract: `run_pending` starts a comparison only when the engine has no request, and checks
`should_yield` between engine steps; when it says a request arrived, the comparison is aborted and
counted as dropped (at most the step in flight is waited for). Pending comparisons are bounded: the
oldest is dropped (and counted) when a new one would overflow the queue. With `quality_sample=0`
there is no monitor and nothing on the serving path changes.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from sparsex.engine.teacher_forcing import Engine, compare_positions, continuation_distributions
from sparsex.inputs import TokenizedPrompt

if TYPE_CHECKING:
    from sparsex.request import Request


MAX_PENDING = 8           # comparisons waiting for idle capacity; more and the oldest is dropped
MONITOR_TOKENS = 32       # answer tokens scored (the fidelity bench's default --fidelity-tokens)
REQUEST_PREFIX = "quality-monitor-"


@dataclass(frozen=True)
class QualitySample:
    """A served blended request, kept for scoring."""
    request_id: str
    prompt: TokenizedPrompt      # the served prompt: token ids, segments, cache salt
    answer: tuple[int, ...]      # the first MONITOR_TOKENS served tokens
    reuse: dict                  # the request's resolved reuse knobs


@dataclass(frozen=True)
class QualityResult:
    request_id: str
    kl: float                    # mean over the answer's positions, nats
    top1: float                  # share of positions where the blend's argmax is full prefill's
    num_tokens: int


class QualityMonitor:
    """Samples blended requests (`offer`) and scores them in idle capacity (`run_pending`). Owned by
    the engine; every method runs on the engine's thread."""

    def __init__(self, share: float, seed: int = 0, max_pending: int = MAX_PENDING,
                 num_tokens: int = MONITOR_TOKENS):
        if not 0.0 < share <= 1.0:
            raise ValueError(f"quality_sample must be in (0, 1] for a monitor, got {share!r}")
        self.share = share
        self.num_tokens = num_tokens
        self.pending: deque[QualitySample] = deque()
        self.max_pending = max_pending
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self.results: deque[QualityResult] = deque(maxlen=1024)    # the latest scores, newest last
        self.num_sampled = 0       # blended requests chosen for scoring
        self.num_compared = 0      # scored
        self.num_dropped = 0       # chosen but never scored: the queue overflowed, or a request arrived mid-score

    @staticmethod
    def is_internal(request_id: str) -> bool:
        return request_id.startswith(REQUEST_PREFIX)

    def offer(self, req: Request) -> None:
        """A finished request: sampled with probability `share` if segment reuse blended it."""
        record = req.reuse_record
        if (record is None or record.num_reused_tokens == 0 or req.reuse is None
                or not req.output_token_ids or self.is_internal(req.request_id)):
            return
        if self._rng.random() >= self.share:
            return
        self.num_sampled += 1
        if len(self.pending) >= self.max_pending:
            self.pending.popleft()
            self.num_dropped += 1
        prompt = TokenizedPrompt(list(req.prompt_token_ids), None, list(req.segments), req.cache_salt)
        self.pending.append(QualitySample(req.request_id, prompt, tuple(req.output_token_ids[: self.num_tokens]),
                                          dataclasses.asdict(req.reuse)))

    def run_pending(self, engine: Engine, should_yield: Callable[[], bool] = lambda: False) -> list[QualityResult]:
        """Score pending samples while the engine is idle and `should_yield()` is false."""
        results = []
        while self.pending and not engine.has_unfinished_requests() and not should_yield():
            sample = self.pending.popleft()
            result = self._score(engine, sample, should_yield)
            if result is None:
                self.num_dropped += 1
                if should_yield():
                    break
                continue
            self.num_compared += 1
            results.append(result)
            self.results.append(result)
        return results

    def _score(self, engine: Engine, s: QualitySample, should_yield: Callable[[], bool]) -> QualityResult | None:
        """The blend first: the reference leaves the whole prompt on the exact prefix chain, where a
        later blend of it would be an exact hit. None: it could not be scored (dropped)."""
        # the blend as served, but fresh (not the approximate chain the served request may have left)
        pol = self._run(engine, s.prompt, s.answer, {**s.reuse, "approx_prefix": False}, should_yield)
        if pol is None:
            return None
        # reference: no segments, no spans found by content, no approximate chain: what is not an exact
        # prefix hit is computed
        exact = TokenizedPrompt(s.prompt.token_ids, None, [], s.prompt.cache_salt)
        ref = self._run(engine, exact, s.answer, {"transparent_segments": False, "approx_prefix": False}, should_yield)
        if ref is None:
            return None
        m = compare_positions(ref, pol, [int(r.argmax()) for r in ref])
        return QualityResult(s.request_id, m.kl, m.top1, len(s.answer))

    def _run(self, engine: Engine, prompt: TokenizedPrompt, answer: tuple[int, ...], reuse: dict,
             should_yield: Callable[[], bool]) -> list | None:
        try:
            got = continuation_distributions(engine, f"{REQUEST_PREFIX}{next(self._ids)}", prompt, list(answer),
                                             reuse, should_yield)
        except ValueError:              # prompt + answer does not fit the model
            return None
        return None if got is None else got[1]
