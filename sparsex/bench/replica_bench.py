"""Replicas with and without the shared segment store: the rag workload over two engines.

    sparsex bench replicas --threads 1 --out runs/replicas
    sparsex bench replicas --queries 2 --join-queries 1 --k 2 --num-passages 4 --passage-tokens 150:250 \\
        --prewarm-passes 1 --out /tmp/replicas          # a smoke run

(also `python -m sparsex.bench.replica_bench ...`). The requests are the workload bench's rag
requests in their default, explicit form (`workload_prompts.build_workload` + `tokenized_workload`,
the same prompts as `sparsex bench workload --workload rag --queries N`), and the corpus is ingested
as that bench ingests it (`--prewarm`, `ingest_corpus`: every passage the requests use, k to a
prompt after a preamble passage, in `--prewarm-passes` passes), untimed, on replica A only: a
service that ingested its corpus on one replica and then scaled out. Every request runs alone, to
its first token (max_tokens=1: TTFT is all that is measured, no fidelity), on its replica; the stores'
write-behind queues are flushed between requests (untimed), so no request's TTFT shares the CPU with
another's writes. Settings:

  none     full prefill (cache="none"): the TTFT reference, every request;
  one      a single replica (A) serves every request;
  islands  two replicas, request i on replica i % 2, no store: each has its own segment index, so B
           starts cold and computes what A already holds;
  shared   the same two replicas on one Redis server (started here, stopped by its pid): A publishes
           what it ingests and computes, B fetches what it lacks (`segment_store_fetch`, auto: when
           the measured fetch is cheaper than the measured recompute).

Then a cold join: the next `--join-queries` requests of the same workload (built with the same
seed, so the first `--queries` are unchanged) go to a third replica started cold, alone: against the
warm store (shared) and without one (islands). Their passages may include some the ingestion never
saw (they were drawn after it): those are misses for both.

Segment hit = passage tokens served from cache (exact prefix or a reused span) / passage tokens,
over the setting's requests (the passages are the workload's reusable segments; the ingestion held
every passage of the first `--queries` requests). Remote hits and bytes fetched are the Redis tier's
(`EngineStats.store`). TTFT / none: the setting's mean TTFT over the full-prefill mean over the same
requests.

Outputs in --out: replicas.json (environment, configuration, per-setting summaries, every request)
and replicas.md (the printed tables).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from sparsex.arg_types import int_pair
from sparsex.bench import add_engine_flag, add_threads_arg, command_line, set_threads
from sparsex.bench.workload_config import MAX_AUTO_BLOCKS, WorkloadBenchConfig, WorkloadParams
from sparsex.config import STORE_FETCH_MODES, EngineConfig

if TYPE_CHECKING:
    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.inputs import TokenizedPrompt

SETTINGS = ("none", "one", "islands", "shared")


@dataclass
class ReplicaBenchConfig:
    model: str = EngineConfig.model
    dtype: str = EngineConfig.dtype
    queries: int = 32                    # the replayed requests (rag queries of the workload bench)
    join_queries: int = 8                # the cold join: the workload's next requests, on a third replica
    k: int = WorkloadParams.k
    num_passages: int = WorkloadParams.num_passages
    passage_tokens: tuple[int, int] = WorkloadParams.passage_tokens
    zipf_a: float = WorkloadParams.zipf_a
    seed: int = WorkloadParams.seed
    prewarm_passes: int = WorkloadBenchConfig.prewarm_passes
    num_blocks: int | None = None        # KV pool per replica; default: the corpus twice + 4 requests
    fetch: str = EngineConfig.segment_store_fetch    # of the shared replicas
    redis_server: str | None = None      # redis-server binary; default: on PATH or in /usr/bin, /usr/sbin
    out: str = "replica_bench_out"
    progress: bool = True
    command: str | None = None           # the command line, for the tables' caption

    def workload_config(self, queries: int | None = None) -> WorkloadBenchConfig:
        """The workload bench's rag configuration with these sizes (explicit form, corpus ingested)."""
        params = WorkloadParams(queries=queries or self.queries, k=self.k, num_passages=self.num_passages,
                                passage_tokens=self.passage_tokens, zipf_a=self.zipf_a, seed=self.seed)
        return WorkloadBenchConfig(workload="rag", prompt_form="explicit", model=self.model, dtype=self.dtype,
                                   params=params, prewarm=True, prewarm_passes=self.prewarm_passes, out=self.out,
                                   progress=self.progress)

    def verify(self) -> None:
        self.workload_config().verify()
        for name in ("queries", "join_queries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.queries < 2:
            raise ValueError(f"queries must be >= 2 (one request per replica at least), got {self.queries}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if self.fetch not in STORE_FETCH_MODES:
            raise ValueError(f"fetch must be one of {STORE_FETCH_MODES}, got {self.fetch!r}")
        if self.redis_server is not None and not (os.path.isfile(self.redis_server)
                                                  and os.access(self.redis_server, os.X_OK)):
            raise ValueError(f"--redis-server {self.redis_server!r} is not an executable file")
        if self.redis_server is None:
            from sparsex.bench import redis_server as rs
            if not rs.available():
                raise ValueError("redis-server not found on PATH or in /usr/bin, /usr/sbin: install it "
                                 "(make install) or pass --redis-server PATH")


@dataclass
class ReplicaRecord:
    setting: str                 # none | one | islands | shared
    phase: str                   # "replay" (the first --queries requests) | "join" (the cold join)
    replica: str                 # A, B (replay) or C (join); "-" for none
    index: int                   # the request's index in the workload
    request_id: str
    prompt_tokens: int
    passage_tokens: int          # tokens of the request's passages (its reusable segments)
    passage_served: int          # ... served from cache (exact prefix or a reused span)
    cached_tokens: int
    reused_tokens: int
    ttft_s: float
    remote_hits: int = 0         # records the request fetched from the shared store
    remote_bytes: int = 0        # bytes it read from the store
    installed_tokens: int = 0    # tokens brought into the replica's pool from the store
    fetch_ms: float = 0.0        # its store round trips (on the TTFT path)


@dataclass
class SettingSummary:
    setting: str
    phase: str
    replicas: str                        # e.g. "A, B"
    requests: int
    hit_rate: float                      # passage tokens served / passage tokens
    replica_hit_rates: dict[str, float]  # per replica
    remote_hits: int | None              # None: no store
    remote_mb: float | None
    installed_tokens: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_vs_none: float | None           # mean TTFT / full prefill's mean over the same requests
    fetch_decisions: int | None = None
    recompute_decisions: int | None = None
    segments_evicted: dict[str, int] = field(default_factory=dict)


# ---------------------------------------------------------------------------- engines

def _make_engine(cfg: ReplicaBenchConfig, cache: str, num_blocks: int, store_url: str | None = None) -> LLMEngine:
    """An engine as the workload bench builds one (`EngineCache.take`), optionally on the store, after
    one short warm-up request whose pieces are not segments (nothing indexed, nothing published)."""
    from sparsex.bench.fidelity import pieces_prompt, run_to_completion
    from sparsex.config import EngineConfig, ReuseConfig
    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=cfg.model, dtype=cfg.dtype, device="cpu", cache=cache, seed=0,
                                    num_blocks=num_blocks, segment_eviction="frequency", reuse=ReuseConfig(),
                                    segment_store=store_url, segment_store_fetch=cfg.fetch))
    text = "Warm-up: the quick brown fox jumps over the lazy dog. " * 4
    run_to_completion(engine, pieces_prompt(engine, [text, "Say hi."], [False, False]),
                      SamplingParams(temperature=0, max_tokens=2))
    engine.reset_cache()
    return engine


def _close(*engines: LLMEngine) -> None:
    for engine in engines:
        engine.close()


def _release() -> None:
    """After the caller dropped its engines: collect them and hand what they freed back to the OS
    (glibc keeps freed heap pages in its arenas: GBs over a run that builds nine engines)."""
    import ctypes
    import ctypes.util
    gc.collect()
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None     # glibc only
    if trim is not None:
        trim(0)


def _flush(engines: list[LLMEngine]) -> None:
    for engine in engines:
        if engine.store is not None and not engine.store.flush(60.0):
            raise RuntimeError("the segment store's writer did not drain in 60 s")


# ---------------------------------------------------------------------------- serving

def _serve(engine: LLMEngine, prompt: TokenizedPrompt, mask: np.ndarray, setting: str, phase: str, replica: str,
           index: int, request_id: str) -> ReplicaRecord:
    from sparsex.bench.fidelity import run_to_completion
    from sparsex.bench.prompt_forms import served_mask
    from sparsex.sampling_params import SamplingParams

    st0 = engine.stats().store
    out, _ = run_to_completion(engine, prompt, SamplingParams(temperature=0, max_tokens=1))
    st1 = engine.stats().store
    n = len(prompt.token_ids)
    served = served_mask(n, out.num_cached_tokens, out.reused_spans)
    rec = ReplicaRecord(setting, phase, replica, index, request_id, n, int(mask.sum()), int((mask & served).sum()),
                        out.num_cached_tokens, out.num_reused_tokens, out.metrics.ttft or 0.0)
    if st0 is not None:
        rec.remote_hits = st1.remote_hits - st0.remote_hits
        rec.remote_bytes = st1.remote_bytes_read - st0.remote_bytes_read
        rec.installed_tokens = st1.installed_tokens - st0.installed_tokens
        rec.fetch_ms = 1000 * (st1.fetch_seconds - st0.fetch_seconds)
    return rec


def _replay(replicas: dict[str, LLMEngine], setting: str, phase: str, indices: list[int], prompts, masks, ids,
            progress: bool) -> list[ReplicaRecord]:
    """Request j of `indices` on replica j % len(replicas), one at a time; every store drained between."""
    from sparsex.bench.replay import progress_bar
    names = list(replicas)
    engines = list(replicas.values())
    records = []
    for j in progress_bar(range(len(indices)), f"replicas/{setting}/{phase}", progress):
        i = indices[j]
        name = names[j % len(names)]
        records.append(_serve(replicas[name], prompts[i], masks[i], setting, phase, name, i, ids[i]))
        _flush(engines)
    for engine in engines:
        engine.check_integrity()
    return records


def _ingest(engine: LLMEngine, w) -> float:
    from sparsex.bench.workload_prompts import ingest_corpus
    t0 = time.perf_counter()
    ingest_corpus(engine, w)
    _flush([engine])
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- the run

@dataclass
class _Workload:
    w: Any                                   # TokenizedWorkload of the first `queries` requests
    prompts: list[TokenizedPrompt]           # replay + join prompts, by workload index
    masks: list[np.ndarray]                  # their passage tokens
    ids: list[str]
    num_blocks: int
    corpus_tokens: int                       # tokens of the distinct passages the ingestion held


def _build(cfg: ReplicaBenchConfig) -> _Workload:
    from sparsex.bench.engine_cache import EngineCache
    from sparsex.bench.prompt_forms import form_prompt, unit_mask
    from sparsex.bench.workload_prompts import build_workload, ingestion_preamble, pool_blocks, tokenized_workload

    wcfg = cfg.workload_config()
    engines = EngineCache(cfg.model, cfg.dtype)
    probe = None
    try:
        w = tokenized_workload(engines, lambda tok: build_workload(wcfg, tok), prewarm=True,
                               make_preamble=lambda tok, used: ingestion_preamble(wcfg, tok, used),
                               prewarm_passes=cfg.prewarm_passes, seed=wcfg.params.seed)
        probe = engines.take("none", "timed", 1, warm=False)
        tok, vocab = probe.tokenizer, probe.model_config.vocab_size
        # the next requests of the same workload: the generator draws query by query, so the first
        # `queries` of a longer build are the replayed ones
        full = build_workload(cfg.workload_config(cfg.queries + cfg.join_queries), tok)
        if [r.segments for r in full[:cfg.queries]] != [r.segments for r in w.requests]:
            raise RuntimeError("the longer workload does not start with the replayed requests")
        requests = w.requests + full[cfg.queries:]
        prompts, masks = [], []
        for r in requests:
            prompt, offsets, text = form_prompt(tok, vocab, r)
            prompts.append(prompt)
            masks.append(unit_mask(text, offsets, list(r.passages)))
        if [p.token_ids for p in prompts[:cfg.queries]] != [p.token_ids for p in w.prompts]:
            raise RuntimeError("the replayed prompts differ from the workload bench's")
        passages = list(dict.fromkeys(p for r in requests for p in r.passages))
        ingested = set(p for r in w.requests for p in r.passages)
        counts = {p: len(tok.encode(p, add_special_tokens=False)) for p in passages}
        bs = w.block_size
        if cfg.num_blocks is not None:
            num_blocks = cfg.num_blocks
        else:
            # every passage's entry twice (a merge writes a private copy first), four requests in
            # flight: no segment entry need be evicted; at most what the whole run would occupy
            corpus = sum(-(-counts[p] // bs) + 1 for p in passages)
            largest = max(-(-(len(p.token_ids) + 2) // bs) for p in prompts + w.warm_prompts + w.rewarm_prompts)
            whole = pool_blocks(prompts + w.warm_prompts + w.rewarm_prompts, 2, bs, whole=True)
            num_blocks = min(2 * corpus + 4 * largest, whole, MAX_AUTO_BLOCKS)
        return _Workload(w, prompts, masks, [r.request_id for r in requests], num_blocks,
                         sum(counts[p] for p in ingested))
    finally:
        probe = None             # the engine goes with the cache's reference
        engines.release()


def run_replica_bench(cfg: ReplicaBenchConfig) -> dict:
    """Every setting, the cold join, the tables; writes replicas.json and replicas.md to cfg.out."""
    from sparsex.bench import redis_server as rs
    from sparsex.bench.report import environment, loadavg

    cfg.verify()
    t_start = time.time()
    wl = _build(cfg)
    env = environment(cfg.model, cfg.dtype)
    env["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    q, n_join = cfg.queries, cfg.join_queries
    replay_idx, join_idx = list(range(q)), list(range(q, q + n_join))
    P, M, I = wl.prompts, wl.masks, wl.ids
    records: list[ReplicaRecord] = []
    ingest_s: dict[str, float] = {}
    evicted: dict[str, dict[str, int]] = {}
    decisions: dict[str, tuple[int, int]] = {}

    # none: full prefill of every request (replay and join), the TTFT reference
    ref_blocks = max(-(-(len(p.token_ids) + 2) // wl.w.block_size) for p in P) + 2
    engine = _make_engine(cfg, "none", ref_blocks)
    records += _replay({"-": engine}, "none", "replay", replay_idx, P, M, I, cfg.progress)
    records += _replay({"-": engine}, "none", "join", join_idx, P, M, I, cfg.progress)
    _close(engine)
    del engine
    _release()

    # one: replica A alone
    a = _make_engine(cfg, "sparsex", wl.num_blocks)
    ingest_s["one"] = _ingest(a, wl.w)
    records += _replay({"A": a}, "one", "replay", replay_idx, P, M, I, cfg.progress)
    evicted["one"] = {"A": a.segment_index.num_evicted}
    _close(a)
    del a
    _release()

    # islands: A (ingested) and B (cold), no store; then C joins cold
    a = _make_engine(cfg, "sparsex", wl.num_blocks)
    ingest_s["islands"] = _ingest(a, wl.w)
    b = _make_engine(cfg, "sparsex", wl.num_blocks)
    records += _replay({"A": a, "B": b}, "islands", "replay", replay_idx, P, M, I, cfg.progress)
    evicted["islands"] = {"A": a.segment_index.num_evicted, "B": b.segment_index.num_evicted}
    _close(a, b)
    del a, b
    _release()
    c = _make_engine(cfg, "sparsex", wl.num_blocks)
    records += _replay({"C": c}, "islands", "join", join_idx, P, M, I, cfg.progress)
    evicted["islands"]["C"] = c.segment_index.num_evicted
    _close(c)
    del c
    _release()

    # shared: A and B on one Redis server; then C joins cold against the warm store
    server = rs.RedisServer(exe=cfg.redis_server)
    server.start()
    try:
        url = server.url()
        a = _make_engine(cfg, "sparsex", wl.num_blocks, url)
        ingest_s["shared"] = _ingest(a, wl.w)
        b = _make_engine(cfg, "sparsex", wl.num_blocks, url)
        records += _replay({"A": a, "B": b}, "shared", "replay", replay_idx, P, M, I, cfg.progress)
        evicted["shared"] = {"A": a.segment_index.num_evicted, "B": b.segment_index.num_evicted}
        decisions["shared/replay"] = tuple(sum(x) for x in zip(*[
            (e.store.policy.fetched, e.store.policy.recomputed) for e in (a, b)]))
        admin = server.client()
        store_mb, store_keys = admin.info("memory").get("used_memory", 0) / 1e6, admin.dbsize()
        admin.close()
        _close(a, b)
        del a, b
        _release()
        c = _make_engine(cfg, "sparsex", wl.num_blocks, url)
        records += _replay({"C": c}, "shared", "join", join_idx, P, M, I, cfg.progress)
        evicted["shared"]["C"] = c.segment_index.num_evicted
        decisions["shared/join"] = (c.store.policy.fetched, c.store.policy.recomputed)
        _close(c)
        del c
        _release()
    finally:
        server.close()                              # SIGTERM to its pid, then its temp dir

    summaries = _summaries(records, evicted, decisions)
    env.update(wall_seconds=round(time.time() - t_start, 1), load_avg_end=loadavg(), num_blocks=wl.num_blocks,
               ingest_seconds={k: round(v, 1) for k, v in ingest_s.items()},
               ingest_prompts=len(wl.w.warm_prompts) + len(wl.w.rewarm_prompts),
               corpus_passages=len({p for r in wl.w.requests for p in r.passages}), corpus_tokens=wl.corpus_tokens,
               store_used_mb=round(store_mb, 1), store_keys=store_keys)
    result = {"environment": env, "config": asdict(cfg), "summaries": [asdict(s) for s in summaries],
              "requests": [asdict(r) for r in records]}
    text = markdown(summaries, cfg, env)
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "replicas.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(cfg.out, "replicas.md"), "w") as f:
        f.write(text)
    result["markdown"] = text
    return result


def _summaries(records: list[ReplicaRecord], evicted: dict[str, dict[str, int]],
               decisions: dict[str, tuple[int, int]]) -> list[SettingSummary]:
    none = {r.index: r.ttft_s for r in records if r.setting == "none"}
    out = []
    for phase in ("replay", "join"):
        for setting in SETTINGS:
            rs = [r for r in records if r.setting == setting and r.phase == phase]
            if not rs:
                continue
            names = list(dict.fromkeys(r.replica for r in rs))
            ttft = np.array([r.ttft_s for r in rs]) * 1000
            ref = np.mean([none[r.index] for r in rs]) * 1000
            shared = setting == "shared"
            dec = decisions.get(f"{setting}/{phase}")
            out.append(SettingSummary(
                setting, phase, ", ".join(names), len(rs), _rate(rs),
                {n: _rate([r for r in rs if r.replica == n]) for n in names},
                sum(r.remote_hits for r in rs) if shared else None,
                sum(r.remote_bytes for r in rs) / 1e6 if shared else None,
                sum(r.installed_tokens for r in rs), float(ttft.mean()), float(np.percentile(ttft, 50)),
                float(np.percentile(ttft, 99)), float(ttft.mean() / ref) if setting != "none" else 1.0,
                dec[0] if dec else None, dec[1] if dec else None,
                {n: v for n, v in evicted.get(setting, {}).items() if n in names}))
    return out


def _rate(rs: list[ReplicaRecord]) -> float:
    total = sum(r.passage_tokens for r in rs)
    return sum(r.passage_served for r in rs) / total if total else 0.0


# ---------------------------------------------------------------------------- tables

def _num(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def markdown(summaries: list[SettingSummary], cfg: ReplicaBenchConfig, env: dict) -> str:
    threads = env.get("torch_threads")
    pinned = env.get("affinity")
    pin = f", pinned to core{'s' if pinned and len(pinned) > 1 else ''} {','.join(map(str, pinned))}" \
        if pinned and len(pinned) < (env.get("cores") or 0) else ""
    caption = (f"{env.get('cpu')} ({env.get('cores')} cores), {threads} torch thread{'s' if threads != 1 else ''}"
               f"{pin}, torch {env.get('torch')}; {cfg.model}, {env.get('dtype')}; {env.get('started', '')[:10]}, "
               f"`{env.get('commit')}`; {env.get('wall_seconds')} s wall. rag, explicit segments: {cfg.queries} "
               f"requests of k = {cfg.k} passages ({cfg.passage_tokens[0]}-{cfg.passage_tokens[1]} tokens, Zipf "
               f"{cfg.zipf_a} over {cfg.num_passages}), the corpus ({env.get('corpus_passages')} passages, "
               f"{env.get('corpus_tokens')} tokens) ingested on replica A only in {cfg.prewarm_passes} pass"
               f"{'es' if cfg.prewarm_passes != 1 else ''} ({env.get('ingest_prompts')} prompts, untimed); "
               f"requests round-robin over the replicas, one at a time, to the first token; a pool of "
               f"{env.get('num_blocks')} blocks per replica; fetch policy {cfg.fetch}. Store after the replay: "
               f"{env.get('store_keys')} records, {env.get('store_used_mb')} MB.")
    command = cfg.command or "sparsex bench replicas"
    lines = [caption, "", f"    {command}", ""]
    head = ["setting", "replicas", "requests", "segment hit (cluster)", "per replica", "remote hits", "fetched (MB)",
            "TTFT mean / p50 / p99 (ms)", "TTFT / none"]
    lines += _table(head, [_row(s) for s in summaries if s.phase == "replay"])
    join = [s for s in summaries if s.phase == "join"]
    if join:
        lines += ["", f"Cold join: a third replica (C) starts cold and serves the next {cfg.join_queries} requests "
                      f"of the workload alone; the none row is full prefill of the same requests.", ""]
        rows = []
        for s in join:
            if s.setting != "none":
                label = "shared (C, warm store)" if s.setting == "shared" else "islands (C, own index)"
                rows.append([label] + _row(s)[1:])
        none = next((s for s in summaries if s.setting == "none" and s.phase == "join"), None)
        if none is not None:
            rows.append(_row(none))
        lines += _table(head, rows)
    notes = [f"{s.setting}/{s.phase}: {sum(s.segments_evicted.values())} segment entries evicted"
             for s in summaries if sum(s.segments_evicted.values())]
    if notes:
        lines += ["", "Note: " + "; ".join(notes) + " (a larger --num-blocks keeps them)."]
    return "\n".join(lines) + "\n"


def _row(s: SettingSummary) -> list[str]:
    per = " / ".join(f"{n} {v:.1%}" for n, v in s.replica_hit_rates.items()) if len(s.replica_hit_rates) > 1 else "—"
    return [s.setting, s.replicas, str(s.requests), "—" if s.setting == "none" else f"{s.hit_rate:.1%}", per,
            _num(s.remote_hits, "d"), _num(s.remote_mb, ",.1f"),
            f"{s.ttft_mean_ms:,.0f} / {s.ttft_p50_ms:,.0f} / {s.ttft_p99_ms:,.0f}",
            _num(s.ttft_vs_none, ".3f") + "x"]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


# ---------------------------------------------------------------------------- CLI

def add_replica_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `replicas` under `sparsex bench`; the handler is `run_replica_bench_cli`."""
    d = ReplicaBenchConfig()
    p = subparsers.add_parser(
        "replicas", help="rag over 2 replicas: one, islands (no store), shared Redis store; cold join",
        description="The rag workload (explicit segments, corpus ingested on replica A) over two replicas "
                    "round-robin: one replica, two islands without a store, two replicas sharing a Redis "
                    "store (started here), against full prefill; then a third replica joining cold. Segment "
                    "hit rate, remote hits, bytes fetched, TTFT.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--queries", type=int, default=d.queries, help="requests replayed over the replicas")
    p.add_argument("--join-queries", type=int, default=d.join_queries,
                   help="the next requests, served by a third replica that joins cold")
    add_engine_flag(p, "model")
    add_engine_flag(p, "dtype")
    add_threads_arg(p)
    p.add_argument("--out", default=d.out, help="directory for replicas.json and replicas.md")
    p.add_argument("--redis-server", default=None,
                   help="redis-server binary (default: on PATH, else /usr/bin or /usr/sbin)")
    p.add_argument("--fetch", default=d.fetch, choices=STORE_FETCH_MODES,
                   help="the shared replicas' segment_store_fetch")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool per replica (default: every passage twice + 4 requests, at most the whole run)")
    p.add_argument("--k", type=int, default=d.k, help="passages per query")
    p.add_argument("--num-passages", type=int, default=d.num_passages, help="corpus (Zipf popularity over it)")
    p.add_argument("--passage-tokens", type=int_pair, default=d.passage_tokens, help="passage length MIN:MAX")
    p.add_argument("--zipf-a", type=float, default=d.zipf_a)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--prewarm-passes", type=int, default=d.prewarm_passes,
                   help="ingestion passes on replica A (as `sparsex bench workload --prewarm-passes`)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_replica_bench_cli)
    return p


def run_replica_bench_cli(args: argparse.Namespace) -> int:
    cfg = ReplicaBenchConfig(model=args.model, dtype=args.dtype, queries=args.queries,
                             join_queries=args.join_queries, k=args.k, num_passages=args.num_passages,
                             passage_tokens=args.passage_tokens, zipf_a=args.zipf_a, seed=args.seed,
                             prewarm_passes=args.prewarm_passes, num_blocks=args.num_blocks, fetch=args.fetch,
                             redis_server=args.redis_server, out=args.out, progress=not args.no_progress,
                             command=command_line("replicas"))
    cfg.verify()                     # before anything loads
    set_threads(args.threads)
    result = run_replica_bench(cfg)
    print(result["markdown"], end="")
    print(f"outputs: {cfg.out}/ (replicas.json, replicas.md)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sparsex.bench.replica_bench ...` (same options as `sparsex bench replicas`)."""
    from sparsex.bench import module_main
    return module_main("replica_bench", "replicas", add_replica_bench_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
