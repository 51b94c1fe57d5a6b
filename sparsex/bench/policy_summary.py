"""One policy's replay summed up (`PolicySummary`): hit rates, compute, TTFT, fidelity with
bootstrap intervals, and paired differences against the default and full prefill."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparsex.bench import stats
from sparsex.bench.flop_model import FlopModel
from sparsex.bench.replay import RequestRecord

if TYPE_CHECKING:
    from sparsex.bench.policies import Policy


@dataclass
class PolicySummary:
    workload: str
    policy: str
    family: str
    description: str
    num_requests: int
    prompt_tokens: int
    prefix_hit_rate: float        # token-weighted: cached / prompt tokens
    approx_prefix_rate: float     # token-weighted: approximate-chain prefix hits / prompt tokens
    segment_hit_rate: float       # token-weighted: segment-reused / prompt tokens (approximate chain excluded)
    segment_lookup_hit_rate: float | None   # hit / looked-up tokens in the segment index
    recompute_share: float | None  # recomputed / reused tokens
    computed_tokens: int
    compute_share: float          # token-layers computed / full prefill of every prompt
    prefill_gflops: float         # summed over requests
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_speedup: float | None    # none's mean TTFT / this policy's (when none ran)
    selection_ms: float           # per request, mean
    fidelity_requests: int
    top1: float | None
    kl: float | None
    match_len: float | None
    f1: float | None
    em: float | None
    twin_mismatches: int
    # 95% bootstrap intervals over the fidelity requests (sparsex.bench.stats); None below 2 requests
    top1_low: float | None = None
    top1_high: float | None = None
    kl_low: float | None = None
    kl_high: float | None = None
    # paired over the same requests: this policy's KL minus the engine default's (`sparsex`), when it ran
    kl_minus_sparsex: float | None = None
    kl_minus_sparsex_low: float | None = None
    kl_minus_sparsex_high: float | None = None
    # paired over the same requests: this policy's answer token F1 minus full prefill's (`none`),
    # when both ran and the workload has reference answers (rag)
    f1_minus_none: float | None = None
    f1_minus_none_low: float | None = None
    f1_minus_none_high: float | None = None
    # top-1 disagreements over the fidelity requests, and how many were near-ties under full prefill
    # (its top two tokens within NEAR_TIE of each other in probability)
    top1_misses: int | None = None
    near_tie_misses: int | None = None
    # token-weighted: recurring tokens (units an earlier request or the ingestion held) served from
    # cache, with a 95% bootstrap interval over the requests that have any; None when none recur
    recurring_tokens: int = 0
    recurring_served_share: float | None = None
    recurring_served_low: float | None = None
    recurring_served_high: float | None = None
    # rag: share of requests whose greedy answer is the same text as full prefill's (when `none` ran)
    answer_agreement: float | None = None
    # transparent segments: host time finding spans, per request (mean), and its share of the TTFT
    span_search_ms: float = 0.0
    span_search_share: float | None = None


def percentile(xs: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else float("nan")


def mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(workload: str, policy: Policy, recs: list[RequestRecord], flops: FlopModel) -> PolicySummary:
    prompt = sum(r.prompt_tokens for r in recs)
    reused = sum(r.reused_tokens for r in recs)
    approx = sum(r.approx_prefix_tokens for r in recs)
    lookups = sum(r.segment_lookup_tokens for r in recs)
    ttft = [1000 * r.ttft_s for r in recs]
    fr = [r for r in recs if r.fidelity and r.top1 is not None]
    scored = [r for r in recs if r.f1 is not None]
    return PolicySummary(
        workload=workload, policy=policy.name, family=policy.family, description=policy.description,
        num_requests=len(recs), prompt_tokens=prompt,
        prefix_hit_rate=sum(r.cached_tokens for r in recs) / max(1, prompt),
        approx_prefix_rate=approx / max(1, prompt),
        segment_hit_rate=(reused - approx) / max(1, prompt),
        segment_lookup_hit_rate=(sum(r.segment_hit_tokens for r in recs) / lookups) if lookups else None,
        recompute_share=(sum(r.recomputed_tokens for r in recs) / reused) if reused else None,
        computed_tokens=sum(r.computed_tokens for r in recs),
        compute_share=sum(r.token_layers for r in recs) / max(1, prompt * flops.num_layers),
        prefill_gflops=sum(r.prefill_gflops for r in recs),
        ttft_mean_ms=mean(ttft) or 0.0, ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        ttft_speedup=None, selection_ms=mean([r.selection_ms for r in recs]) or 0.0,
        fidelity_requests=len(fr), top1=_weighted_mean([r.top1 for r in fr], _positions(fr)),
        kl=_weighted_mean([r.kl for r in fr], _positions(fr)),
        match_len=mean([r.match_len for r in fr]), f1=mean([r.f1 for r in scored]),
        em=mean([r.em for r in scored]),
        twin_mismatches=sum(1 for r in recs if r.twin_match is False),
        **_fidelity_intervals(fr), **_top1_misses(fr), **_recurring(recs),
        span_search_ms=mean([r.span_search_ms for r in recs]) or 0.0,
        span_search_share=(sum(r.span_search_ms for r in recs) / sum(ttft)) if sum(ttft) > 0 else None,
    )


def _recurring(recs: list[RequestRecord]) -> dict:
    rr = [r for r in recs if r.recurring_tokens > 0]
    if not rr:
        return {}
    total = sum(r.recurring_tokens for r in rr)
    out = dict(recurring_tokens=total, recurring_served_share=sum(r.recurring_served for r in rr) / total)
    if len(rr) >= 2:
        iv = stats.bootstrap_mean([r.recurring_served / r.recurring_tokens for r in rr],
                                  weights=[r.recurring_tokens for r in rr])
        out.update(recurring_served_low=iv.low, recurring_served_high=iv.high)
    return out


NEAR_TIE = 0.1      # a reference margin p(top-1) - p(second) below this makes a top-1 miss a near-tie


def _positions(fr: list[RequestRecord]) -> list[int]:
    """Teacher-forced positions of each fidelity record: the summary's top-1 and KL are means over
    positions, so a request whose reference stopped early weighs less (1 each for a record without
    per-position KL)."""
    return [len(r.position_kl) if r.position_kl else 1 for r in fr]


def _weighted_mean(xs: list[float], weights: list[int]) -> float | None:
    return sum(x * w for x, w in zip(xs, weights)) / sum(weights) if xs else None


def _fidelity_intervals(fr: list[RequestRecord]) -> dict:
    if len(fr) < 2:
        return {}
    top1 = stats.bootstrap_mean([r.top1 for r in fr], weights=_positions(fr))
    kl = stats.bootstrap_mean([r.kl for r in fr], weights=_positions(fr))
    return dict(top1_low=top1.low, top1_high=top1.high, kl_low=kl.low, kl_high=kl.high)


def _top1_misses(fr: list[RequestRecord]) -> dict:
    """Top-1 disagreements over the fidelity requests and how many were near-ties (none when a
    record has no margins)."""
    if not fr or any(r.miss_margins is None for r in fr):
        return {}
    margins = [m for r in fr for m in r.miss_margins]
    return dict(top1_misses=len(margins), near_tie_misses=sum(m < NEAR_TIE for m in margins))


def compare_to_default(summaries: list[PolicySummary], records: list[RequestRecord]) -> None:
    """Fill every summary's paired KL difference against `sparsex` (the engine default), over the
    fidelity requests both measured (weighted by scored positions), and its paired answer-F1
    difference against `none` (full prefill): teacher forcing counts a flipped near-tie once, a
    free-running answer goes on from it; and the share of its greedy answers equal to full prefill's."""
    kl, f1 = {}, {}
    for r in records:
        if r.fidelity and r.kl is not None:
            kl.setdefault(r.policy, {})[r.index] = (r.kl, _positions([r])[0])
        if r.f1 is not None:
            f1.setdefault(r.policy, {})[r.index] = (r.f1, 1)
    answers: dict[str, dict[int, str]] = {}
    for r in records:
        if r.answer is not None:
            answers.setdefault(r.policy, {})[r.index] = r.answer
    for s in summaries:
        mine, ref = answers.get(s.policy, {}), answers.get("none", {})
        common = set(mine) & set(ref)
        if common:
            s.answer_agreement = sum(mine[i] == ref[i] for i in common) / len(common)
        if (d := _paired(kl, s.policy, "sparsex")) is not None:
            s.kl_minus_sparsex, s.kl_minus_sparsex_low, s.kl_minus_sparsex_high = d.mean, d.low, d.high
        if (d := _paired(f1, s.policy, "none")) is not None:
            s.f1_minus_none, s.f1_minus_none_low, s.f1_minus_none_high = d.mean, d.low, d.high


def _paired(by_policy: dict[str, dict[int, tuple[float, float]]], policy: str, base: str) -> stats.Interval | None:
    """`policy`'s (value, weight) per request minus `base`'s, paired over the requests both have
    (base's weights); None for the base itself or below two common requests."""
    mine, ref = by_policy.get(policy, {}), by_policy.get(base, {})
    common = sorted(set(mine) & set(ref))
    if policy == base or len(common) < 2:
        return None
    return stats.paired_difference([mine[i][0] for i in common], [ref[i][0] for i in common],
                                   weights=[ref[i][1] for i in common])
