"""Bootstrap intervals of the workload benchmark (sparsex.bench.stats) on samples with known answers,
and the paired comparison the summary prints against the engine default."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparsex.bench import stats
from sparsex.bench.flop_model import FlopModel
from sparsex.bench.policies import parse_policies
from sparsex.bench.policy_summary import compare_to_default, summarize
from sparsex.bench.replay import RequestRecord, _through_eos
from sparsex.bench.report import fidelity_markdown

pytestmark = pytest.mark.unit


def test_constant_sample_has_a_point_interval() -> None:
    ci = stats.bootstrap_mean([0.25] * 7)
    assert (ci.mean, ci.low, ci.high) == (0.25, 0.25, 0.25)


def test_interval_brackets_the_mean_and_narrows_with_more_data() -> None:
    rng = np.random.default_rng(1)
    small, large = rng.exponential(0.01, 16), rng.exponential(0.01, 400)
    a, b = stats.bootstrap_mean(small), stats.bootstrap_mean(large)
    assert small.min() <= a.low < a.mean < a.high <= small.max()
    assert a.mean == pytest.approx(small.mean())
    assert (b.high - b.low) < (a.high - a.low) / 3          # ~ 1/sqrt(n): 5x narrower at 25x the data
    assert stats.bootstrap_mean(small, seed=3) == stats.bootstrap_mean(small, seed=3)    # deterministic
    wide = stats.bootstrap_mean(small, confidence=0.99)
    assert wide.low <= a.low and wide.high >= a.high


def test_coverage_of_a_known_mean() -> None:
    # 95% intervals of 30 normal draws hold the true mean about 95% of the time (percentile bootstrap
    # runs a little narrow at this size)
    rng = np.random.default_rng(7)
    cis = [stats.bootstrap_mean(rng.normal(2.0, 1.0, 30), num_resamples=2000, seed=i) for i in range(300)]
    hits = sum(ci.low <= 2.0 <= ci.high for ci in cis)
    assert 0.88 <= hits / 300 <= 0.99


def test_paired_difference_removes_the_spread_between_requests() -> None:
    rng = np.random.default_rng(2)
    base = rng.exponential(0.02, 24)                       # requests differ a lot
    other = base + 0.001 + rng.normal(0, 1e-4, 24)         # one policy a little worse on every request
    d = stats.paired_difference(other, base)
    assert d.low > 0 and d.mean == pytest.approx(0.001, abs=1e-4)
    unpaired_a, unpaired_b = stats.bootstrap_mean(other), stats.bootstrap_mean(base)
    assert unpaired_a.low < unpaired_b.high                  # unpaired, the intervals overlap
    shift = stats.paired_difference([x + 1.0 for x in base], base)
    assert shift.low == pytest.approx(1.0) and shift.high == pytest.approx(1.0)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(values=[]), "non-empty"),
    (dict(values=[[0.1, 0.2]]), "1-d"),
    (dict(values=[0.1, float("nan")]), "non-finite"),
    (dict(values=[0.1], confidence=1.0), "confidence"),
    (dict(values=[0.1], confidence=0.0), "confidence"),
    (dict(values=[0.1], num_resamples=0), "num_resamples"),
])
def test_bad_samples_raise(kwargs, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        stats.bootstrap_mean(**kwargs)


def test_paired_samples_must_match() -> None:
    with pytest.raises(ValueError, match="same length"):
        stats.paired_difference([0.1, 0.2], [0.1])


def _record(policy: str, index: int, kl: float, top1: float) -> RequestRecord:
    return RequestRecord(workload="rag", policy=policy, index=index, request_id=f"rag-{index}",
                         prompt_tokens=100, cached_tokens=0, reused_tokens=0, recomputed_tokens=0,
                         computed_tokens=100, token_layers=3000.0, prefill_gflops=1.0, ttft_s=0.1,
                         selection_ms=0.0, segment_lookup_tokens=0, segment_hit_tokens=0, fidelity=True,
                         top1=top1, kl=kl, match_len=4)


def test_summary_compares_every_policy_to_the_default_on_the_same_requests() -> None:
    kl_default = [0.01, 0.03, 0.002, 0.02, 0.005]
    recs = [_record("sparsex", i, kl, 0.9) for i, kl in enumerate(kl_default)]
    recs += [_record("cacheblend", i, kl + 0.004, 0.8) for i, kl in enumerate(kl_default)]
    recs += [_record("naive", 0, 0.05, 0.5)]                # one fidelity request: no interval
    fm = FlopModel(num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                   vocab=49152)
    summaries = [summarize("rag", p, [r for r in recs if r.policy == p.name], fm)
                 for p in parse_policies("sparsex,cacheblend,naive")]
    compare_to_default(summaries, recs)
    by = {s.policy: s for s in summaries}
    cb = by["cacheblend"]
    assert cb.kl_minus_sparsex == pytest.approx(0.004)
    assert cb.kl_minus_sparsex_low == pytest.approx(0.004) and cb.kl_minus_sparsex_high == pytest.approx(0.004)
    assert by["sparsex"].kl_minus_sparsex is None and by["naive"].kl_minus_sparsex is None
    assert by["sparsex"].kl_low < by["sparsex"].kl < by["sparsex"].kl_high
    assert by["naive"].kl_low is None
    table = fidelity_markdown(summaries)
    assert "| cacheblend | 5 |" in table and "+0.0040 [+0.0040, +0.0040]" in table
    assert "| naive |" not in table


def test_answer_f1_is_compared_to_full_prefill_on_the_same_requests() -> None:
    """rag's free-running answers: each policy's token F1 minus full prefill's, paired per request;
    without `none` (or without reference answers) the column is absent."""
    f1_none = [0.4, 0.1, 0.3, 0.25]
    recs = [dataclasses.replace(_record("none", i, 0.0, 1.0), f1=f, em=0.0) for i, f in enumerate(f1_none)]
    recs += [dataclasses.replace(_record("sparsex", i, 0.01, 0.9), f1=f - 0.05, em=0.0) for i, f in enumerate(f1_none)]
    recs += [dataclasses.replace(_record("cacheblend", i, 0.02, 0.9), f1=f + (0.1 if i == 0 else 0.0), em=0.0)
             for i, f in enumerate(f1_none)]
    fm = FlopModel(num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                   vocab=49152)
    policies = parse_policies("none,sparsex,cacheblend")
    summaries = [summarize("rag", p, [r for r in recs if r.policy == p.name], fm) for p in policies]
    compare_to_default(summaries, recs)
    by = {s.policy: s for s in summaries}
    assert by["none"].f1_minus_none is None
    assert by["sparsex"].f1_minus_none == pytest.approx(-0.05)
    assert by["sparsex"].f1_minus_none_low == pytest.approx(-0.05) == by["sparsex"].f1_minus_none_high
    assert by["cacheblend"].f1_minus_none == pytest.approx(0.025)
    assert by["cacheblend"].f1_minus_none_low == pytest.approx(0.0)     # 3 of 4 differences are 0
    assert 0.025 < by["cacheblend"].f1_minus_none_high <= 0.1
    table = fidelity_markdown(summaries)
    assert "answer F1 − none, paired [95% CI]" in table and "-0.050 [-0.050, -0.050]" in table
    no_ref = [s for s in summaries if s.policy != "none"]
    for s in no_ref:
        s.f1_minus_none = None
    assert "answer F1" not in fidelity_markdown(no_ref)
    compare_to_default(no_ref, [r for r in recs if r.policy != "none"])
    assert all(s.f1_minus_none is None for s in no_ref)


def _lp(probs: list[float]):
    import torch
    return torch.tensor(probs, dtype=torch.float64).log()


def test_position_metrics_on_hand_made_distributions() -> None:
    """Three positions over a 3-token vocabulary: the policy agrees at the first, flips a near-tie at
    the second (full prefill 0.46 / 0.44: margin 0.02) and a decisive one at the third (0.9 / 0.05)."""
    import math
    from sparsex.engine.teacher_forcing import compare_positions
    ref = [_lp([0.7, 0.2, 0.1]), _lp([0.46, 0.44, 0.10]), _lp([0.05, 0.9, 0.05])]
    pol = [_lp([0.6, 0.3, 0.1]), _lp([0.44, 0.46, 0.10]), _lp([0.5, 0.4, 0.1])]
    m = compare_positions(ref, pol, [0, 0, 1])
    assert m.top1 == pytest.approx(1 / 3) and m.match_len == 1
    assert m.miss_margins == pytest.approx((0.02, 0.85))
    kl = lambda p, q: sum(a * math.log(a / b) for a, b in zip(p, q))
    want = (kl([0.7, 0.2, 0.1], [0.6, 0.3, 0.1]) + kl([0.46, 0.44, 0.1], [0.44, 0.46, 0.1])
            + kl([0.05, 0.9, 0.05], [0.5, 0.4, 0.1])) / 3
    assert m.kl == pytest.approx(want)
    assert m.miss_positions == (1, 2)
    assert m.position_kl == pytest.approx((kl([0.7, 0.2, 0.1], [0.6, 0.3, 0.1]), kl([0.46, 0.44, 0.1], [0.44, 0.46, 0.1]),
                                           kl([0.05, 0.9, 0.05], [0.5, 0.4, 0.1])))
    same = compare_positions(ref, ref, [0, 0, 1])
    assert same.top1 == 1.0 and same.kl == pytest.approx(0.0) and same.match_len == 3 and same.miss_margins == ()
    assert same.miss_positions == () and same.position_kl == pytest.approx((0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="one reference and one policy distribution"):
        compare_positions(ref, pol[:2], [0, 0, 1])


def test_summary_counts_top1_misses_and_near_ties() -> None:
    recs = [_record("sparsex", i, 0.01, 0.9) for i in range(3)]
    for r, margins in zip(recs, ([0.02, 0.5], [], [0.09])):
        r.miss_margins = margins
    fm = FlopModel(num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                   vocab=49152)
    s = summarize("rag", parse_policies("sparsex")[0], recs, fm)
    assert (s.top1_misses, s.near_tie_misses) == (3, 2)
    assert "| 3 (2) |" in fidelity_markdown([s])
    recs[1].miss_margins = None                      # a record without margins
    s = summarize("rag", parse_policies("sparsex")[0], recs, fm)
    assert s.top1_misses is None and "| — |" in fidelity_markdown([s])


def test_weighted_mean_and_its_interval() -> None:
    # two requests: 1 of 2 positions right, 10 of 10 right -> 11 of 12 positions, not the requests' mean 0.75
    ci = stats.bootstrap_mean([0.5, 1.0], weights=[2, 10])
    assert ci.mean == pytest.approx(11 / 12)
    assert 0.5 <= ci.low <= ci.mean <= ci.high <= 1.0
    same = stats.bootstrap_mean([0.5, 1.0], weights=[3, 3])
    assert same == stats.bootstrap_mean([0.5, 1.0])             # equal weights: the plain mean
    d = stats.paired_difference([0.3, 0.1], [0.1, 0.1], weights=[1, 3])
    assert d.mean == pytest.approx(0.05)
    for bad in ([1, 2, 3], [1, 0], [1, float("inf")]):
        with pytest.raises(ValueError, match="weight"):
            stats.bootstrap_mean([0.5, 1.0], weights=bad)


def test_summary_weighs_requests_by_their_teacher_forced_positions() -> None:
    """A request whose reference stopped at EOS after 2 tokens counts 2 positions, one of 10 counts 10:
    the summary's top-1 and KL are means over positions."""
    short, long_ = _record("sparsex", 0, 0.04, 0.5), _record("sparsex", 1, 0.01, 1.0)
    short.position_kl, short.miss_positions = [0.06, 0.02], [1]
    long_.position_kl, long_.miss_positions = [0.01] * 10, []
    fm = FlopModel(num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                   vocab=49152)
    s = summarize("rag", parse_policies("sparsex")[0], [short, long_], fm)
    assert s.top1 == pytest.approx(11 / 12)
    assert s.kl == pytest.approx((0.06 + 0.02 + 0.1) / 12)


def test_reference_stops_at_eos_unless_asked_past_it() -> None:
    assert _through_eos([5, 7, 2, 9, 2], (2,)) == [5, 7, 2]
    assert _through_eos([5, 7], (2,)) == [5, 7]
    assert _through_eos([], (2,)) == []
