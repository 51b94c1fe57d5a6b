"""benchmarks/answer_pareto.py: its points and table from a run's summary, and the rounding band, on synthetic
runs in the workload bench's file layout (test_workload_bench.py::test_rag_end_to_end reads a real run)."""
from __future__ import annotations

import json

import pytest

from benchmarks.answer_pareto import floor, main, points, table

pytestmark = pytest.mark.unit


def _run(tmp_path, name: str, f1: dict[str, list[float]], summary: list[dict] | None = None) -> str:
    """A run directory: requests.json with each policy's per-request F1, summary.json with `summary`."""
    run = tmp_path / name
    run.mkdir()
    reqs = [dict(policy=p, index=i, f1=x) for p, xs in f1.items() for i, x in enumerate(xs)]
    (run / "requests.json").write_text(json.dumps({"requests": reqs}))
    (run / "summary.json").write_text(json.dumps({"summary": summary or [dict(policy=p) for p in f1]}))
    return str(run)


def _row(policy, compute, f1, low, high, agreement, n):
    return dict(policy=policy, compute_share=compute, f1_minus_none=f1, f1_minus_none_low=low,
                f1_minus_none_high=high, answer_agreement=agreement, num_requests=n)


def test_points_are_the_rules_of_the_run_summary(tmp_path):
    run = _run(tmp_path, "a", {"none": [0.5, 0.2, 0.4], "fast": [0.3, 0.2, 0.4]},
               [_row("none", 1.0, None, None, None, 1.0, 3), _row("fast", 0.2, -0.2 / 3, -0.2, 0.0, 2 / 3, 3)])
    [p] = points(run)
    assert p.policy == "fast" and p.num_requests == 3 and p.changed == 1
    assert p.compute == pytest.approx(80 / 400)
    assert p.f1.mean == pytest.approx(-0.2 / 3) and p.f1.low <= p.f1.mean <= p.f1.high
    assert "| fast | 20.0% | -0.067" in table([p], None)


def test_the_floor_pairs_another_full_prefill_with_the_first_run(tmp_path):
    fp32 = _run(tmp_path, "fp32", {"none": [0.5, 0.2], "fast": [0.5, 0.2]})
    bf16 = _run(tmp_path, "bf16", {"none": [0.4, 0.2]})
    band = floor(bf16, fp32)
    assert band.mean == pytest.approx(-0.05)
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
    main([ok])
    assert "| fast | 10.0% | +0.000" in capsys.readouterr().out
