"""Teacher forcing: a continuation's next-token distributions under an engine, and how two sets of them compare.

One definition for the offline fidelity bench (sparsex/bench/fidelity.py) and the live quality monitor
(engine/quality_monitor.py), so the monitor's numbers are the bench's. The engine is driven through its
public calls only (it owns the monitor, which imports this: no import of llm_engine here).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

import torch

from sparsex.inputs import TokenizedPrompt
from sparsex.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sparsex.outputs import RequestOutput


class Engine(Protocol):
    """What teacher forcing drives (engine/llm_engine.LLMEngine)."""
    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    arrival_time: float | None = None, reuse: dict | None = None) -> None: ...
    def step(self) -> list[RequestOutput]: ...
    def abort_request(self, request_ids: str | Iterable[str]) -> None: ...
    def has_unfinished_requests(self) -> bool: ...


@dataclass
class PositionMetrics:
    top1: float
    kl: float
    match_len: int
    miss_margins: tuple[float, ...]
    position_kl: tuple[float, ...] = ()       # KL at each position of the continuation
    miss_positions: tuple[int, ...] = ()      # positions of the top-1 disagreements


def compare_positions(ref_lps: list[torch.Tensor], pol_lps: list[torch.Tensor], cont: list[int]) -> PositionMetrics:
    """Teacher-forced fidelity from the reference's and the policy's next-token log-distributions
    ([vocab] each, one per position of the continuation `cont`): top-1 = share of positions where the
    policy's argmax is `cont`'s token (the reference's greedy token), KL(ref || policy) in nats, the
    positions before the first miss, and at each miss the reference's top-two margin."""
    if not (len(ref_lps) == len(pol_lps) == len(cont)) or not cont:
        raise ValueError(f"need one reference and one policy distribution per continuation token, got "
                         f"{len(ref_lps)} / {len(pol_lps)} / {len(cont)}")
    hits, kls, margins, misses, match, diverged = 0, [], [], [], 0, False
    for t, (ref, pol, tok) in enumerate(zip(ref_lps, pol_lps, cont)):
        ok = int(pol.argmax()) == tok
        hits += ok
        kls.append(float((ref.exp() * (ref - pol)).sum()))
        if not ok:
            diverged = True
            misses.append(t)
            top2 = torch.topk(ref.exp(), 2).values
            margins.append(float(top2[0] - top2[1]))
        if not diverged:
            match += 1
    return PositionMetrics(hits / len(cont), sum(kls) / len(kls), match, tuple(margins), tuple(kls), tuple(misses))


def run_alone(engine: Engine, request_id: str, prompt: Any, params: SamplingParams, reuse: dict | None = None,
              should_yield: Callable[[], bool] | None = None) -> RequestOutput | None:
    """Run one request on an engine with nothing else to do, to its finished output. `should_yield`,
    checked before every step: when true the request is aborted and None returned."""
    engine.add_request(request_id, prompt, params, reuse=reuse)
    out = None
    while engine.has_unfinished_requests():
        if should_yield is not None and should_yield():
            engine.abort_request(request_id)
            return None
        for o in engine.step():
            if o.request_id == request_id and o.finished:
                out = o
    return out


def continuation_distributions(engine: Engine, request_id: str, prompt: TokenizedPrompt, cont: list[int],
                               reuse: dict | None = None, should_yield: Callable[[], bool] | None = None
                               ) -> tuple[RequestOutput, list[torch.Tensor]] | None:
    """prompt + `cont` in one prefill, `cont` a continuation being scored (`query_horizon`: the prompt
    alone plans and selects any reuse), and the next-token log-distribution before each of `cont`'s
    tokens. None when the run was aborted (`should_yield`, or the engine could not hold it)."""
    n = len(prompt.token_ids)
    full = TokenizedPrompt(prompt.token_ids + list(cont), None, list(prompt.segments), prompt.cache_salt,
                           query_horizon=n)
    params = SamplingParams(temperature=0.0, max_tokens=1, distributions_from=n - 1)
    out = run_alone(engine, request_id, full, params, reuse, should_yield)
    if out is None or out.outputs[0].finish_reason == "abort" or not out.distributions:
        return None
    return out, [out.distributions[n - 1 + t] for t in range(len(cont))]
