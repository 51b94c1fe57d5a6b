"""What each tier of the segment store costs on this machine, against recomputing the segment.

    sparsex bench store --threads 1 --out runs/store
    sparsex bench store --sizes 64 --repeats 2 --out /tmp/store        # a smoke run
    sparsex bench store --device cuda --model dummy:llama3-8b --dtype bfloat16 --sizes 512,2048,8192


(also `python -m sparsex.bench.store_bench ...`). Segments of `--sizes` tokens of real text (Wikipedia
passages, `workloads.build_passages`, joined; each size a prefix of the same token stream), on the
model in `--dtype` (SmolLM2-135M fp32: 30 layers x 3 KV heads x 64 x K,V x 4 B = 46,080 B of KV per
token; the Llama-3-8B shape in bf16: 32 x 8 x 128 x 2 x 2 B = 131,072 B). Each timing is the median of
`--repeats` runs after one unmeasured run; one process, one engine at a time. On `--device cuda` every
timed step ends with a device synchronisation, and the host tier is pinned as the engine pins it.

  recompute     the segment's prefill: a request of its n tokens alone on a cache="none" engine, to
                the first token (TTFT);
  host spill    device -> record (`SegmentStore.spill`: every layer's K/V gathered from the blocks
                and put in the host tier, what happens to an evicted entry);
  host install  record -> blocks (`SegmentStore.install`: blocks from the pool, K/V written, indexed);
  Redis SET     `record.encode` + `RedisTier.put` (a SET, sent by the tier's writer thread) until
                the write is done (`RedisTier.flush`);
  Redis fetch   `RedisTier.get_many` (one MGET) + `record.decode` (checksum verified) + install: what
                a replica that misses locally pays on the TTFT path;
  Mooncake put  `MooncakeTier.put_record`: the record encoded straight into the tier's registered
                write buffer, `put_from` into the store, the Redis index entry written, until done;
  Mooncake fetch `MooncakeTier.get_many` (one index MGET + one `batch_get_into` into the registered read
                buffer) + `record.decode(copy=False)` (checksum verified, the K/V a view of the buffer)
                + install (one copy into the blocks).

The Redis server is local (loopback), started here and stopped by its pid, with its request and
bulk-string limits raised to 4 GB so that a segment of the 8B shape (1 GB at 8k tokens) fits in one
value. The Mooncake rows (`--mooncake`, on by default where the wheel is installed) use a local
mooncake_master (`bench/mooncake_server.py`, its HTTP metadata server) and a second process that lends
the store its memory (`SegmentHolder`: `--repeats` + 3 records of the largest size, since Mooncake's
default 10 s lease keeps superseded payloads that long), as a replica on another host would; the bench's
own client lends none, so every payload crosses the TCP transport (loopback). Its index is the same
Redis. Then the fetch policy (`FetchPolicy`, mode auto) is given what an engine would have measured
by then (every recompute above as a plain prefill; the tier's round-trip latency from 5 small reads
and its bandwidth from the fetches above; decode + install of those fetches) and asked, per size,
whether it would fetch the segment or recompute it.

Outputs in --out: store.json (environment, configuration, every sample) and store.md (the tables).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from sparsex.bench import add_engine_flag, add_threads_arg, command_line, set_threads
from sparsex.bench.replica_bench import _release
from sparsex.config import DTYPES, EngineConfig

if TYPE_CHECKING:
    from sparsex.engine.llm_engine import LLMEngine

DEFAULT_SIZES = (64, 256, 1024, 4096)
PREAMBLE_TOKENS = 128        # context before the segment (ReuseConfig.min_context_tokens): not an early encoding
_SMALL_READS = 5             # latency samples for the tier: reads of a missing key


@dataclass
class StoreBenchConfig:
    model: str = EngineConfig.model
    dtype: str = EngineConfig.dtype
    device: str = EngineConfig.device
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 5
    redis_server: str | None = None      # redis-server binary; default: on PATH or in /usr/bin, /usr/sbin
    mooncake: bool | None = None         # the Mooncake rows; None: where the wheel is installed
    mooncake_part: str | None = None     # the Mooncake url's part= (largest object of a record); None: its default
    out: str = "store_bench_out"
    command: str | None = None

    def verify(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not self.sizes or any(not isinstance(n, int) or n < 2 for n in self.sizes):
            raise ValueError(f"sizes must be token counts >= 2, got {self.sizes!r}")
        if len(set(self.sizes)) != len(self.sizes):
            raise ValueError(f"sizes lists a size twice: {self.sizes!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {self.repeats!r}")
        if self.mooncake_part is not None:
            from sparsex.store_urls import parse_mooncake_url
            parse_mooncake_url(f"mooncake://h?metadata=http://h:1/metadata&part={self.mooncake_part}")
        if self.redis_server is not None and not (os.path.isfile(self.redis_server)
                                                  and os.access(self.redis_server, os.X_OK)):
            raise ValueError(f"--redis-server {self.redis_server!r} is not an executable file")
        if self.redis_server is None:
            from sparsex.bench import redis_server as rs
            if not rs.available():
                raise ValueError("redis-server not found on PATH or in /usr/bin, /usr/sbin: install it "
                                 "(make install) or pass --redis-server PATH")
        if self.mooncake:
            reason = mooncake_unavailable()
            if reason is not None:
                raise ValueError(f"--mooncake: {reason}")


def mooncake_unavailable() -> str | None:
    """Why the Mooncake rows cannot run here (None: they can)."""
    from sparsex.bench import mooncake_server
    if not mooncake_server.available():
        return "mooncake_master not installed (the mooncake-transfer-engine-non-cuda wheel; make install)"
    from sparsex.kvstore.mooncake_tier import import_error
    return import_error()


@dataclass
class SizeResult:
    tokens: int
    kv_mb: float                         # the record's K/V + token ids
    value_mb: float                      # the serialized record (header + ids + K/V)
    samples: dict[str, list[float]] = field(default_factory=dict)    # op -> seconds, every measured run
    ms: dict[str, float] = field(default_factory=dict)               # op -> median ms
    est_fetch_ms: float | None = None
    est_recompute_ms: float | None = None
    decision: str = ""                   # fetch | recompute
    reason: str = ""
    mooncake_est_fetch_ms: float | None = None
    mooncake_decision: str = ""          # what the policy decides with the Mooncake tier's estimates


# ops, in table order: (key, label, bytes moved: "kv" record or "value" serialized)
OPS = (("recompute", "recompute (prefill, cache none)", None),
       ("host_spill", "host spill (device → record)", "kv"),
       ("host_install", "host install (record → blocks)", "kv"),
       ("redis_set", "Redis encode + SET", "value"),
       ("redis_fetch", "Redis GET + decode + install", "value"))
MOONCAKE_OPS = (("mooncake_put", "Mooncake encode_into + put_from + index", "value"),
                ("mooncake_fetch", "Mooncake lookup + batch_get_into + decode + install", "value"))
PARTS = ("encode", "set", "get", "decode", "install")     # the Redis ops' pieces (store.json, third table)
MOONCAKE_PARTS = ("mc_get", "mc_decode", "mc_install")    # the Mooncake fetch's pieces


def _engine(cfg: StoreBenchConfig, cache: str, num_blocks: int, host_bytes: int = 0) -> LLMEngine:
    from sparsex.bench.fidelity import pieces_prompt, run_to_completion
    from sparsex.config import EngineConfig, ReuseConfig
    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.sampling_params import SamplingParams
    engine = LLMEngine(EngineConfig(model=cfg.model, dtype=cfg.dtype, device=cfg.device, cache=cache, seed=0,
                                    num_blocks=num_blocks, reuse=ReuseConfig(), host_kv_cache_memory=host_bytes))
    text = "Warm-up: the quick brown fox jumps over the lazy dog. " * 4
    run_to_completion(engine, pieces_prompt(engine, [text, "Say hi."], [False, False]),
                      SamplingParams(temperature=0, max_tokens=2))
    engine.reset_cache()
    return engine


def _token_stream(tokenizer, need: int) -> list[int]:
    """At least `need` token ids of real text: Wikipedia passages joined (tokenized as one text)."""
    from sparsex.bench import workloads
    count = 8
    while True:
        passages = workloads.build_passages(tokenizer, count, 300, 500)
        ids = tokenizer.encode("".join(p.text + "\n\n" for p in passages), add_special_tokens=False)
        if len(ids) >= need:
            return ids
        count *= 2


def _sync(cfg: StoreBenchConfig) -> None:
    """Wait for the device: a timed step includes its copies (install's are asynchronous on CUDA)."""
    if cfg.device == "cuda":
        import torch
        torch.cuda.synchronize()


def _mooncake_runs(cfg: StoreBenchConfig, tier, store, sx, record, entry, key: str, runs: int,
                   s: dict[str, list[float]]):
    """put_record until indexed, then get_many + decode(copy=False) + install, `runs` times each (the first
    not measured); returns the installed entry."""
    from sparsex.kvstore.record import decode
    for op in ("mooncake_put", "mooncake_fetch", *MOONCAKE_PARTS):
        s[op] = []
    before = tier.stats()
    for r in range(runs):
        t0 = time.perf_counter()
        tier.put_record(key, record, only_if_absent=False)
        if not tier.flush(120.0):
            raise RuntimeError(f"the {record.num_tokens}-token Mooncake put did not complete in 120 s")
        if r:
            s["mooncake_put"].append(time.perf_counter() - t0)
    for r in range(runs):
        sx.segment_index.remove(entry)
        _sync(cfg)
        t0 = time.perf_counter()
        got = tier.get_many([key])[0]
        t1 = time.perf_counter()
        if got is None:
            raise RuntimeError(f"the {record.num_tokens}-token record is not in the Mooncake store: {tier.stats()}")
        fetched = decode(got, None, copy=False)
        t2 = time.perf_counter()
        entry = store.install(fetched, sx.segment_index)
        _sync(cfg)
        t3 = time.perf_counter()
        if entry is None:
            raise RuntimeError(f"no room in the pool to install the {record.num_tokens}-token record")
        if r:
            s["mc_get"].append(t1 - t0)
            s["mc_decode"].append(t2 - t1)
            s["mc_install"].append(t3 - t2)
            s["mooncake_fetch"].append(t3 - t0)
        del got, fetched
    after = tier.stats()
    if after.errors > before.errors or after.writes_dropped > before.writes_dropped:
        raise RuntimeError(f"the Mooncake tier failed at {record.num_tokens} tokens: {after}")
    return entry


def _median_ms(xs: list[float]) -> float:
    return 1000 * statistics.median(xs)


def run_store_bench(cfg: StoreBenchConfig) -> dict:
    import torch

    from sparsex.bench import redis_server as rs
    from sparsex.bench.fidelity import pieces_prompt, run_to_completion
    from sparsex.bench.report import environment, loadavg
    from sparsex.kvstore.fetch_policy import FetchPolicy
    from sparsex.kvstore.record import decode, encode
    from sparsex.kvstore.redis_tier import RedisTier
    from sparsex.sampling_params import SamplingParams

    cfg.verify()
    t_start = time.time()
    sizes = sorted(cfg.sizes)
    top = max(sizes)
    one = SamplingParams(temperature=0, max_tokens=1)
    runs = cfg.repeats + 1                              # the first of each is not measured

    # recompute: a cache="none" engine prefills each segment alone
    engine = _engine(cfg, "none", -(-(top + 2) // 16) + 4)
    env = environment(cfg.model, cfg.dtype, cfg.device)
    env["affinity"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    stream = _token_stream(engine.tokenizer, PREAMBLE_TOKENS + top)
    preamble, body = stream[:PREAMBLE_TOKENS], stream[PREAMBLE_TOKENS:]
    mc = engine.model_config
    # bytes of one token's KV over every layer (SegmentStore.bytes_per_token)
    bpt = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * \
        torch.empty((), dtype=engine.runner.dtype).element_size()
    results = {n: SizeResult(n, 0.0, 0.0) for n in sizes}
    for n in sizes:
        xs = []
        for r in range(runs):
            out, _ = run_to_completion(engine, pieces_prompt(engine, [body[:n]], [False]), one)
            if r:
                xs.append(out.metrics.ttft)
        results[n].samples["recompute"] = xs
    del engine
    _release()

    # host tier and Redis: a sparsex engine holds the segment as an entry; the tiers move its record.
    # Its pool: the request (preamble + segment) and two more copies; its host tier: one record at a time
    sx = _engine(cfg, "sparsex", 3 * (-(-(PREAMBLE_TOKENS + top + 2) // 16)) + 8, host_bytes=2 * bpt * top + (1 << 20))
    if sx.store.bytes_per_token != bpt:
        raise RuntimeError(f"KV bytes per token: {sx.store.bytes_per_token} in the store, {bpt} computed here")
    server = rs.RedisServer(exe=cfg.redis_server, extra_args=("--proto-max-bulk-len", "4gb",
                                                              "--client-query-buffer-limit", "4gb"))
    server.start()
    use_mooncake = cfg.mooncake if cfg.mooncake is not None else mooncake_unavailable() is None
    master = holder = mc_tier = None
    try:
        # the writer queue must hold the largest value (an 8k-token Llama-3-8B-shaped record is ~1 GB, past
        # the engine's 256 MiB default) and a socket read must outlast its transfer
        tier = RedisTier(server.url(), timeout_s=60.0, max_pending_bytes=2 * bpt * top + (64 << 20))
        for _ in range(_SMALL_READS):                   # round-trip latency samples (misses)
            tier.get_many(["sparsex:bench:absent"])
        admin = server.client()
        if use_mooncake:
            from sparsex.bench.mooncake_server import MooncakeMaster, SegmentHolder
            from sparsex.kvstore.mooncake_tier import MooncakeTier
            # Mooncake's default 10 s lease: a read must finish within the lease the master grants it (a 189 MB
            # record took over 0.5 s here), and superseded payloads wait for it, so the segment holds every run's
            master = MooncakeMaster(lease_ms=10_000).start()
            top_value = bpt * top + (1 << 20)
            holder = SegmentHolder(master, (runs + 2) * top_value + (64 << 20)).start()
            part = {} if cfg.mooncake_part is None else {"part": cfg.mooncake_part}
            mc_tier = MooncakeTier(master.url(segment=0, timeout=60, **part), index_url=server.url(),
                                   pin=cfg.device == "cuda", max_pending_bytes=2 * top_value)
            for _ in range(_SMALL_READS):
                mc_tier.get_many(["sparsex:bench:absent"])
        for n in sizes:
            seg = body[:n]
            sx.reset_cache()
            store = sx.store
            run_to_completion(sx, pieces_prompt(sx, [preamble, seg, "\n"], [False, True, False]), one)
            entry = sx.segment_index.lookup(seg, None, count=False)
            if entry is None:
                raise RuntimeError(f"the {n}-token segment was not indexed")
            key = store.key(seg, None)
            res = results[n]
            s = res.samples
            s["host_spill"], s["host_install"] = [], []
            for part in PARTS:
                s[part] = []
            s["redis_set"], s["redis_fetch"] = [], []
            # host tier: spill (device -> record), install (record -> blocks)
            for r in range(runs):
                _sync(cfg)
                t0 = time.perf_counter()
                store.spill(entry)
                _sync(cfg)
                dt = time.perf_counter() - t0
                if r:
                    s["host_spill"].append(dt)
            record = store.host.pop(key)
            if record is None:
                raise RuntimeError(f"the host tier did not keep the {n}-token record")
            res.kv_mb = record.nbytes / 1e6
            for r in range(runs):
                sx.segment_index.remove(entry)
                _sync(cfg)
                t0 = time.perf_counter()
                entry = store.install(record, sx.segment_index)
                _sync(cfg)
                dt = time.perf_counter() - t0
                if entry is None:
                    raise RuntimeError(f"no room in the pool to install the {n}-token record")
                if r:
                    s["host_install"].append(dt)
            # Redis: encode + SET (until written), GET + decode + install
            before = tier.stats()
            for r in range(runs):
                t0 = time.perf_counter()
                value = encode(record)
                t1 = time.perf_counter()
                tier.put(key, value, only_if_absent=False)
                if not tier.flush(120.0):
                    raise RuntimeError(f"the {n}-token SET did not complete in 120 s")
                t2 = time.perf_counter()
                if r:
                    s["encode"].append(t1 - t0)
                    s["set"].append(t2 - t1)
                    s["redis_set"].append(t2 - t0)
            res.value_mb = len(value) / 1e6
            del value
            for r in range(runs):
                sx.segment_index.remove(entry)
                _sync(cfg)
                t0 = time.perf_counter()
                got = tier.get_many([key])[0]
                t1 = time.perf_counter()
                if got is None:
                    raise RuntimeError(f"the {n}-token record is not in the store")
                fetched = decode(got, None)
                t2 = time.perf_counter()
                entry = store.install(fetched, sx.segment_index)
                _sync(cfg)
                t3 = time.perf_counter()
                if entry is None:
                    raise RuntimeError(f"no room in the pool to install the {n}-token record")
                if r:
                    s["get"].append(t1 - t0)
                    s["decode"].append(t2 - t1)
                    s["install"].append(t3 - t2)
                    s["redis_fetch"].append(t3 - t0)
                del got, fetched
            after = tier.stats()
            if after.errors > before.errors or after.writes_dropped > before.writes_dropped:
                raise RuntimeError(f"the Redis tier failed at {n} tokens: {after}")
            admin.delete(key)
            if mc_tier is not None:
                entry = _mooncake_runs(cfg, mc_tier, store, sx, record, entry, key, runs, s)
                admin.delete(key)
            del record
            _release()
        policy_state = {"bandwidth_mb_s": (tier.bandwidth() or 0) / 1e6, "latency_ms": 1000 * (tier.latency() or 0)}
        if mc_tier is not None:
            policy_state["mooncake_bandwidth_mb_s"] = (mc_tier.bandwidth() or 0) / 1e6
            policy_state["mooncake_latency_ms"] = 1000 * (mc_tier.latency() or 0)
        tier.close()
        admin.close()
    finally:
        if mc_tier is not None:
            mc_tier.close()
        if holder is not None:
            holder.stop()
        if master is not None:
            master.close()                              # by its pid, then its temp dir
        server.close()                                  # SIGTERM to its pid, then its temp dir

    for res in results.values():
        res.ms = {op: _median_ms(xs) for op, xs in res.samples.items() if xs}

    # the fetch policy (auto), given what an engine would have measured by now
    policy = FetchPolicy("auto")
    for n in sizes:
        for x in results[n].samples["recompute"]:
            policy.observe_prefill(n, x)
        for dec, inst in zip(results[n].samples["decode"], results[n].samples["install"]):
            policy.observe_load(int(results[n].kv_mb * 1e6), dec + inst)
    bandwidth, latency = policy_state["bandwidth_mb_s"] * 1e6, policy_state["latency_ms"] / 1000
    policy_state["prefill_tokens_per_s"] = policy.prefill_tokens_per_s()
    policy_state["load_mb_s"] = (policy.load_bytes_per_s() or 0) / 1e6
    for n in sizes:
        d = policy.decide(n, n * bpt, bandwidth, latency)
        res = results[n]
        res.est_fetch_ms = None if d.est_fetch_s is None else 1000 * d.est_fetch_s
        res.est_recompute_ms = None if d.est_recompute_s is None else 1000 * d.est_recompute_s
        res.decision, res.reason = ("fetch" if d.fetch else "recompute"), d.reason
    if "mooncake_bandwidth_mb_s" in policy_state:
        # the same policy with the Mooncake tier's estimates and its own decode (a view) + install rate
        mc_policy = FetchPolicy("auto")
        for n in sizes:
            for x in results[n].samples["recompute"]:
                mc_policy.observe_prefill(n, x)
            for dec, inst in zip(results[n].samples["mc_decode"], results[n].samples["mc_install"]):
                mc_policy.observe_load(int(results[n].kv_mb * 1e6), dec + inst)
        policy_state["mooncake_load_mb_s"] = (mc_policy.load_bytes_per_s() or 0) / 1e6
        for n in sizes:
            d = mc_policy.decide(n, n * bpt, policy_state["mooncake_bandwidth_mb_s"] * 1e6,
                                 policy_state["mooncake_latency_ms"] / 1000)
            res = results[n]
            res.mooncake_est_fetch_ms = None if d.est_fetch_s is None else 1000 * d.est_fetch_s
            res.mooncake_decision = "fetch" if d.fetch else "recompute"

    env.update(wall_seconds=round(time.time() - t_start, 1), load_avg_end=loadavg(), bytes_per_token=bpt,
               torch_threads=torch.get_num_threads(), policy=policy_state)
    text = markdown(results, cfg, env)
    out = {"environment": env, "config": asdict(cfg), "sizes": [asdict(results[n]) for n in sizes]}
    os.makedirs(cfg.out, exist_ok=True)
    with open(os.path.join(cfg.out, "store.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(cfg.out, "store.md"), "w") as f:
        f.write(text)
    out["markdown"] = text
    return out


# ---------------------------------------------------------------------------- tables

def markdown(results: dict[int, SizeResult], cfg: StoreBenchConfig, env: dict) -> str:
    threads = env.get("torch_threads")
    pinned = env.get("affinity")
    pin = f", pinned to core{'s' if pinned and len(pinned) > 1 else ''} {','.join(map(str, pinned))}" \
        if pinned and len(pinned) < (env.get("cores") or 0) else ""
    pol = env.get("policy", {})
    mooncake = "mooncake_bandwidth_mb_s" in pol
    ops = OPS + (MOONCAKE_OPS if mooncake else ())
    gpu = f"{env['gpu']} (torch {env.get('torch')}), host: " if env.get("gpu") else ""
    lines = [f"{gpu}{env.get('cpu')} ({env.get('cores')} cores), {threads} torch thread{'s' if threads != 1 else ''}{pin}, "
             f"torch {env.get('torch')}; {cfg.model}, {env.get('dtype')} "
             f"({env.get('bytes_per_token'):,} B of KV per token); "
             f"{env.get('started', '')[:10]}, `{env.get('commit')}`; {env.get('wall_seconds')} s wall. Median of "
             f"{cfg.repeats} runs after one unmeasured; a local redis-server (loopback) started by the bench"
             + ("; a local mooncake_master, the payloads in another process's segment (TCP on loopback), "
                "their index in that Redis." if mooncake else "."),
             "", f"    {cfg.command or 'sparsex bench store'}", ""]
    head = ["tokens", "MB", "operation", "ms", "MB/s", "µs/token", "/ recompute"]
    rows = []
    for n, res in sorted(results.items()):
        rec = res.ms["recompute"]
        for op, label, moved in ops:
            ms = res.ms[op]
            mb = res.kv_mb if moved in (None, "kv") else res.value_mb
            rows.append([f"{n:,}", f"{mb:,.1f}", label, f"{ms:,.2f}",
                         "—" if moved is None else f"{mb / (ms / 1000):,.0f}", f"{1000 * ms / n:,.1f}",
                         "1" if op == "recompute" else f"{ms / rec:.3f}"])
    lines += _table(head, rows)
    lines += ["", "Redis round trips in pieces (median ms): encode / SET (until written) / GET (one MGET) / "
                  "decode (checksum) / install.", ""]
    lines += _table(["tokens"] + list(PARTS),
                    [[f"{n:,}"] + [f"{res.ms[p]:,.2f}" for p in PARTS] for n, res in sorted(results.items())])
    if mooncake:
        lines += ["", "Mooncake fetch in pieces (median ms): lookup + batch_get_into (index MGET, then the payload "
                      "into the registered read buffer) / decode (checksum; the K/V stays a view) / install.", ""]
        lines += _table(["tokens", "lookup + batch_get_into", "decode", "install"],
                        [[f"{n:,}"] + [f"{res.ms[p]:,.2f}" for p in MOONCAKE_PARTS]
                         for n, res in sorted(results.items())])
    tps = pol.get("prefill_tokens_per_s")
    lines += ["", f"Fetch policy (auto) after these measurements: prefill {tps:,.0f} tokens/s (EWMA over the "
                  f"recomputes, size-weighted), Redis {pol.get('bandwidth_mb_s', 0):,.0f} MB/s past a "
                  f"{pol.get('latency_ms', 0):.2f} ms round trip (EWMAs of the tier's reads), decode + install "
                  f"{pol.get('load_mb_s', 0):,.0f} MB/s (EWMA over the fetches above). est. fetch = latency + "
                  f"bytes / bandwidth + bytes / (decode + install rate).", ""]
    head = ["tokens", "est. fetch (ms)", "est. recompute (ms)", "auto decides", "measured fetch (GET+decode+install, ms)",
            "measured recompute (ms)", "cheaper, measured"]
    rows = []
    for n, res in sorted(results.items()):
        cheaper = "fetch" if res.ms["redis_fetch"] < res.ms["recompute"] else "recompute"
        rows.append([f"{n:,}", _num(res.est_fetch_ms), _num(res.est_recompute_ms), res.decision,
                     f"{res.ms['redis_fetch']:,.2f}", f"{res.ms['recompute']:,.2f}", cheaper])
    lines += _table(head, rows)
    if mooncake:
        lines += ["", f"With the Mooncake tier's estimates: {pol['mooncake_bandwidth_mb_s']:,.0f} MB/s past a "
                      f"{pol['mooncake_latency_ms']:.2f} ms lookup + round trip, decode + install "
                      f"{pol['mooncake_load_mb_s']:,.0f} MB/s.", ""]
        rows = []
        for n, res in sorted(results.items()):
            cheaper = "fetch" if res.ms["mooncake_fetch"] < res.ms["recompute"] else "recompute"
            rows.append([f"{n:,}", _num(res.mooncake_est_fetch_ms), _num(res.est_recompute_ms), res.mooncake_decision,
                         f"{res.ms['mooncake_fetch']:,.2f}", f"{res.ms['recompute']:,.2f}", cheaper])
        lines += _table(["tokens", "est. fetch (ms)", "est. recompute (ms)", "auto decides",
                         "measured fetch (Mooncake, ms)", "measured recompute (ms)", "cheaper, measured"], rows)
    return "\n".join(lines) + "\n"


def _num(v: float | None) -> str:
    return "—" if v is None else f"{v:,.2f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


# ---------------------------------------------------------------------------- CLI

def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}") from None
    if not sizes or any(n < 2 for n in sizes):
        raise argparse.ArgumentTypeError(f"expected token counts >= 2, got {text!r}")
    return sizes


def add_store_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `store` under `sparsex bench`; the handler is `run_store_bench_cli`."""
    d = StoreBenchConfig()
    p = subparsers.add_parser(
        "store", help="segment store tiers on this machine: host spill/install, Redis SET/fetch, Mooncake "
                      "put/fetch vs recompute",
        description="Per segment size (real passages): recompute (prefill), host-tier spill and install, "
                    "Redis encode+SET and GET+decode+install against a local redis-server started here; ms, MB, "
                    "MB/s, µs/token, the ratio to recompute, and what the fetch policy (auto) decides.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", type=_sizes, default=d.sizes, help="segment sizes in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=d.repeats, help="measured runs per timing (median)")
    add_engine_flag(p, "model")
    add_engine_flag(p, "dtype")
    add_engine_flag(p, "device", help="cpu | cuda: where the engine runs; cuda pins the host tier (random-weight "
                                      "shapes: dummy:llama3-8b)")
    add_threads_arg(p)
    p.add_argument("--out", default=d.out, help="directory for store.json and store.md")
    p.add_argument("--redis-server", default=None,
                   help="redis-server binary (default: on PATH, else /usr/bin or /usr/sbin)")
    p.add_argument("--mooncake", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure the Mooncake tier against a local mooncake_master (default: where the "
                        "Mooncake wheel is installed)")
    p.add_argument("--mooncake-part", default=None,
                   help="the Mooncake url's part= (the largest object a record is stored as, e.g. 64M; default 16M)")
    p.set_defaults(func=run_store_bench_cli)
    return p


def run_store_bench_cli(args: argparse.Namespace) -> int:
    cfg = StoreBenchConfig(model=args.model, dtype=args.dtype, device=args.device, sizes=tuple(args.sizes), repeats=args.repeats,
                           redis_server=args.redis_server, mooncake=args.mooncake,
                           mooncake_part=args.mooncake_part, out=args.out,
                           command=command_line("store"))
    cfg.verify()
    set_threads(args.threads)
    result = run_store_bench(cfg)
    print(result["markdown"], end="")
    print(f"outputs: {cfg.out}/ (store.json, store.md)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sparsex.bench.store_bench ...` (same options as `sparsex bench store`)."""
    from sparsex.bench import module_main
    return module_main("store_bench", "store", add_store_bench_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
