"""benchmarks/answer_pareto.py: its points and table from a run's summary, and the rounding band, on synthetic
runs in the workload bench's file layout (test_workload_bench.py::test_rag_end_to_end reads a real run)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from benchmarks.answer_pareto import floor, main, points, selected, table

pytestmark = pytest.mark.unit


def _run(tmp_path, name: str, f1: dict[str, list[float]], summary: list[dict] | None = None,
         answers: dict[str, list[str]] | None = None) -> str:
    """A run directory: requests.json with each policy's per-request F1 (and answers), summary.json with
    `summary` and the environment of a CPU run."""
    run = tmp_path / name
    run.mkdir()
    reqs = [dict(policy=p, index=i, f1=x, answer=(answers or {}).get(p, [f"a{i}"] * len(xs))[i])
            for p, xs in f1.items() for i, x in enumerate(xs)]
    (run / "requests.json").write_text(json.dumps({"requests": reqs}))
    (run / "summary.json").write_text(json.dumps({"summary": summary or [dict(policy=p) for p in f1],
                                                  "environment": {"gpu": None, "cpu": "AMD EPYC", "device": "cpu"}}))
    return str(run)


def _row(policy, compute, f1, low, high, agreement, n, speedup=1.0):
    return dict(policy=policy, compute_share=compute, f1_minus_none=f1, f1_minus_none_low=low,
                f1_minus_none_high=high, answer_agreement=agreement, num_requests=n, ttft_speedup=speedup)


def test_points_are_the_rules_of_the_run_summary(tmp_path):
    run = _run(tmp_path, "a", {"none": [0.5, 0.2, 0.4], "fast": [0.3, 0.2, 0.4]},
               [_row("none", 1.0, None, None, None, 1.0, 3), _row("fast", 0.2, -0.2 / 3, -0.2, 0.0, 2 / 3, 3, 4.0)])
    [p] = points(run)
    assert p.policy == "fast" and p.num_requests == 3 and p.changed == 1
    assert p.compute == pytest.approx(80 / 400) and p.ttft == 0.25 and p.device == "AMD EPYC"
    assert p.f1.mean == pytest.approx(-0.2 / 3) and p.f1.low <= p.f1.mean <= p.f1.high
    assert "| fast | 20.0% | 0.250x (AMD EPYC) | -0.067" in table([p], None, {})
    assert selected(run + "@fast") == [p] and selected(run) == [p]
    with pytest.raises(ValueError, match="has no rule"):
        selected(run + "@slow")
    # a label names the rule (its spec, or the spec before its ':' options)
    assert "| the fast one | 20.0%" in table([p], None, {"fast": "the fast one"})
    assert "| fast | 20.0%" in table([p], None, {"fas": "no prefix match"})
    q = dataclasses.replace(p, policy="kv_deviation:2:0.25:min_blend_tokens=256")
    assert "| CacheBlend (F=2, r=0.25) |" in table([q], None, {"kv_deviation": "CacheBlend"})
    assert "| kv_deviation:2:0.25 |" in table([q], None, {})


def test_the_floor_pairs_another_full_prefill_with_the_first_run(tmp_path):
    fp32 = _run(tmp_path, "fp32", {"none": [0.5, 0.2], "fast": [0.5, 0.2]})
    bf16 = _run(tmp_path, "bf16", {"none": [0.4, 0.2]}, answers={"none": ["other", "a1"]})
    band = floor(bf16, fp32)
    assert band.f1.mean == pytest.approx(-0.05) and (band.changed, band.num_requests) == (1, 2)
    assert "| bf16 full prefill (rounding only) | 100.0% | | -0.050" in table([], band, {})
    assert table([], band, {}).endswith("| 1 of 2 |")
    short = _run(tmp_path, "short", {"none": [0.4]})
    with pytest.raises(ValueError, match="do not hold the same requests"):
        floor(short, fp32)


def test_a_run_without_full_prefill_is_refused(tmp_path, capsys):
    run = _run(tmp_path, "b", {"fast": [0.5]}, [_row("fast", 0.1, 0.0, 0.0, 0.0, 1.0, 1)])
    with pytest.raises(ValueError, match="no `none` policy"):
        points(run)
    with pytest.raises(ValueError, match="no `none` policy"):
        floor(run, run)
    ok = _run(tmp_path, "c", {"none": [0.5], "fast": [0.5]},
              [_row("none", 1.0, None, None, None, 1.0, 1), _row("fast", 0.1, 0.0, 0.0, 0.0, 1.0, 1)])
    main([ok, "--label", "fast=fast profile"])
    assert "| fast profile | 10.0% | 1.000x (AMD EPYC) | +0.000" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([ok, "--label", "fast"])
