"""`sparsex demo` on the real SmolLM2, run through the command line: the rows it prints are the
requests' own counters, its questions reuse the ingested passages, and its reference is a full
prefill of the same prompts."""
from __future__ import annotations

import contextlib
import io

import pytest

from sparsex import cli
from sparsex import demo as demo_module
from sparsex.demo import DemoConfig, DemoReport, demo_table


@pytest.fixture(scope="module")
def demo_report() -> DemoReport:
    """`sparsex demo --quick --max-tokens 4 --dtype float32` in this process: the report of the run it
    printed."""
    reports = []
    run = demo_module.demo

    def keep(cfg, console):
        reports.append(run(cfg, console))
        return reports[-1]
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(demo_module, "demo", keep)
        assert cli.main(["demo", "--quick", "--max-tokens", "4", "--dtype", "float32"]) == 0
    (report,) = reports
    printed = out.getvalue()
    assert "TTFT" in printed and "done in" in printed            # it printed its table
    return report


@pytest.mark.model
def test_rows_are_the_request_outputs_counters(demo_report: DemoReport) -> None:
    rep = demo_report
    assert len(rep.rows) == len(rep.outputs) == len(rep.full_outputs) == DemoConfig(quick=True).num_questions
    for row, out, full in zip(rep.rows, rep.outputs, rep.full_outputs):
        assert row.prompt_tokens == len(out.prompt_token_ids)
        assert (row.num_cached_tokens, row.num_reused_tokens, row.num_recomputed_tokens) == \
            (out.num_cached_tokens, out.num_reused_tokens, out.num_recomputed_tokens)
        assert row.ttft == out.metrics.ttft and row.ttft_full == full.metrics.ttft
        assert row.answer == out.outputs[0].text.strip() and row.answer_full == full.outputs[0].text.strip()
        assert row.speedup == full.metrics.ttft / out.metrics.ttft
        assert row.same_answer == (out.outputs[0].text.strip() == full.outputs[0].text.strip())


@pytest.mark.model
def test_the_printed_table_is_built_from_the_rows(demo_report: DemoReport) -> None:
    rows = demo_report.rows
    table = demo_table(rows, "sparsex")
    columns = {c.header: list(c.cells) for c in table.columns}
    assert columns["prompt\ntokens"] == [str(r.prompt_tokens) for r in rows] + [str(sum(r.prompt_tokens for r in rows))]
    assert columns["reused"][:-1] == [str(r.num_reused_tokens) for r in rows]
    assert columns["recom-\nputed"][:-1] == [str(r.num_recomputed_tokens) for r in rows]
    assert columns["TTFT\nsparsex"][:-1] == [f"{r.ttft * 1e3:.0f} ms" for r in rows]
    assert columns["TTFT\nfull"][:-1] == [f"{r.ttft_full * 1e3:.0f} ms" for r in rows]
    assert columns["same\nanswer"][-1] == f"{sum(bool(r.same_answer) for r in rows)}/{len(rows)}"


@pytest.mark.model
def test_questions_reuse_the_ingested_passages(demo_report: DemoReport) -> None:
    outs = demo_report.outputs
    assert any(o.num_reused_tokens > 0 for o in outs), [o.reuse_skipped for o in outs]
    for o in outs:
        n = len(o.prompt_token_ids)
        assert o.num_cached_tokens + o.num_reused_tokens < n            # the question itself is new
        assert o.num_recomputed_tokens <= o.num_reused_tokens
        if o.num_reused_tokens:
            # a few selected tokens recomputed, not the whole reused span
            assert o.num_recomputed_tokens < o.num_reused_tokens / 2


@pytest.mark.model
def test_the_reference_is_a_full_prefill_of_the_same_prompts(demo_report: DemoReport) -> None:
    for out, full in zip(demo_report.outputs, demo_report.full_outputs):
        assert full.prompt_token_ids == out.prompt_token_ids
        assert full.num_cached_tokens == full.num_reused_tokens == full.num_recomputed_tokens == 0


@pytest.mark.unit
def test_bad_config_is_a_value_error() -> None:
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match=f"max-tokens must be an integer >= 1, got {bad!r}"):
            DemoConfig(max_tokens=bad).verify()
