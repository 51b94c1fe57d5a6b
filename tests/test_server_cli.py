"""`sparsex serve` as a process: flags reach the engine, and SIGTERM drains a running request
before the process exits."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def serve_process():
    proc, url, _ = start_serve(["--port", "0", "--cache", "prefix", "--num-blocks", "64", "--max-model-len", "512",
                                "--served-model-name", "tiny", "--api-key", "k", "--torch-threads", "1",
                                "--log-level", "info"])
    yield proc, url
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def start_serve(args: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    """`sparsex serve ARGS` from this checkout: (process, its URL once uvicorn listens, its log lines
    from then on, read by a thread so a full pipe never blocks the server)."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "sparsex.entrypoints.serve_cli", *args],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    url = None
    deadline = time.monotonic() + 300           # a hang guard for model loading, not a timing check
    for line in proc.stderr:
        m = re.search(r"Uvicorn running on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
        assert time.monotonic() < deadline
    if url is None:
        proc.kill()
        proc.wait()
        raise AssertionError("server did not start")
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True).start()
    return proc, url, log


@pytest.mark.model
def test_sigterm_drains_then_exits(serve_process):
    proc, url = serve_process
    headers = {"Authorization": "Bearer k"}
    assert httpx.get(url + "/v1/models", headers=headers).json()["data"][0]["id"] == "tiny"
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers, timeout=300) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)         # mid-stream
        rest = [line for line in lines if line.startswith("data: ")]
    events = [first, *rest]
    assert events[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in events[-2]
    assert len(events) == 24 + 1                # every token arrived, then [DONE]
    # uvicorn re-raises the signal after its graceful shutdown: exit status is "terminated by SIGTERM"
    assert proc.wait(timeout=300) in (0, -signal.SIGTERM)


@pytest.mark.unit
def test_engine_flags_reach_the_reuse_config():
    import argparse

    from sparsex.entrypoints.serve_cli import add_serve_parser, engine_config
    p = argparse.ArgumentParser()
    add_serve_parser(p.add_subparsers(dest="command", required=True))
    assert engine_config(p.parse_args(["serve"])).reuse.approx_prefix is True
    cfg = engine_config(p.parse_args(["serve", "--no-approx-prefix", "--recompute-ratio", "0.3"]))
    assert cfg.reuse.approx_prefix is False and cfg.reuse.recompute_ratio == 0.3
    assert engine_config(p.parse_args(["serve"])).reuse.min_context_tokens == 128
    assert engine_config(p.parse_args(["serve", "--min-context-tokens", "0"])).reuse.min_context_tokens == 0
    assert engine_config(p.parse_args(["serve"])).reuse.min_blend_tokens == 256
    assert engine_config(p.parse_args(["serve", "--min-blend-tokens", "0"])).reuse.min_blend_tokens == 0
    for flag in ("--min-blend-tokens", "--min-context-tokens"):     # out of the knob's bounds: a usage error
        with pytest.raises(SystemExit):
            p.parse_args(["serve", flag, "-1"])
    assert engine_config(p.parse_args(["serve"])).reuse.boundary_share == 0.25
    assert engine_config(p.parse_args(["serve", "--boundary-share", "0.5"])).reuse.boundary_share == 0.5
    cfg = engine_config(p.parse_args(["serve", "--rescore-layers", "3", "--candidate-ratio", "0.4"]))
    assert cfg.reuse.rescore_layers == 3 and cfg.reuse.candidate_ratio == 0.4
    with pytest.raises(ValueError, match="below recompute_ratio"):
        engine_config(p.parse_args(["serve", "--rescore-layers", "2", "--candidate-ratio", "0.1"])).reuse.verify()
    assert engine_config(p.parse_args(["serve"])).warmup is None                       # on for CUDA only
    assert engine_config(p.parse_args(["serve", "--no-warmup"])).warmup is False
    assert engine_config(p.parse_args(["serve", "--warmup", "--device", "cpu"])).warmup_enabled is True
    assert engine_config(p.parse_args(["serve"])).cache == "sparsex"
    assert engine_config(p.parse_args(["serve", "--no-blend", "--merge-encodings", "2"])).reuse.blend is False


@pytest.mark.unit
def test_server_flags_reach_the_settings(monkeypatch):
    import argparse

    from sparsex.entrypoints import serve_cli
    from sparsex.entrypoints.async_engine import AsyncLLM
    seen = {}

    def fake_app(engine, settings):
        seen["settings"] = settings
        raise SystemExit(0)          # stop before uvicorn starts

    monkeypatch.setattr(AsyncLLM, "from_config", classmethod(lambda cls, config, **kw: config))
    monkeypatch.setattr("sparsex.entrypoints.openai_server.build_app", fake_app)
    p = argparse.ArgumentParser()
    serve_cli.add_serve_parser(p.add_subparsers(dest="command", required=True))
    for argv, allowed in ((["serve"], False), (["serve", "--allow-reuse-overrides"], True)):
        with pytest.raises(SystemExit):
            serve_cli.run_serve(p.parse_args(argv))
        assert seen["settings"].allow_reuse_overrides is allowed
