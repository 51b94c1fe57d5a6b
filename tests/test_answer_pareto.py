"""benchmarks/answer_pareto.py: paired answer-score points and the rounding band, on synthetic runs."""
from __future__ import annotations

import json

import pytest

from benchmarks.answer_pareto import floor, main, points, table

pytestmark = pytest.mark.unit


def _run(tmp_path, name: str, rows: dict[str, list[tuple[float, float, str]]]) -> str:
    """rows: policy -> per request (f1, token_layers, answer)."""
    reqs = [dict(policy=p, index=i, f1=f1, token_layers=tl, answer=a)
            for p, rs in rows.items() for i, (f1, tl, a) in enumerate(rs)]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"requests": reqs}))
    return str(path)


def test_points_pair_each_rule_with_full_prefill_of_its_run(tmp_path):
    run = _run(tmp_path, "a", {"none": [(0.5, 100, "x"), (0.2, 100, "y"), (0.4, 200, "z")],
                               "fast": [(0.3, 20, "x'"), (0.2, 20, "y"), (0.4, 40, "z")]})
    [p] = points(run)
    assert p.policy == "fast" and p.num_requests == 3 and p.changed == 1
    assert p.compute == pytest.approx(80 / 400)
    assert p.f1.mean == pytest.approx(-0.2 / 3) and p.f1.low <= p.f1.mean <= p.f1.high
    assert "| fast | 20.0% | -0.067" in table([p], None)


def test_the_floor_pairs_another_full_prefill_with_the_first_run(tmp_path):
    fp32 = _run(tmp_path, "fp32", {"none": [(0.5, 100, "x"), (0.2, 100, "y")], "fast": [(0.5, 10, "x"), (0.2, 10, "y")]})
    bf16 = _run(tmp_path, "bf16", {"none": [(0.4, 100, "w"), (0.2, 100, "y")]})
    band = floor(bf16, fp32)
    assert band.mean == pytest.approx(-0.05)
    short = _run(tmp_path, "short", {"none": [(0.4, 100, "w")]})
    with pytest.raises(ValueError, match="do not hold the same requests"):
        floor(short, fp32)


def test_a_run_without_full_prefill_is_refused(tmp_path, capsys):
    run = _run(tmp_path, "b", {"fast": [(0.5, 10, "x")]})
    with pytest.raises(ValueError, match="no `none` policy"):
        points(run)
    ok = _run(tmp_path, "c", {"none": [(0.5, 100, "x")], "fast": [(0.5, 10, "x")]})
    main([ok])
    assert "| fast | 10.0% | +0.000" in capsys.readouterr().out
