"""Replicas as `sparsex serve` processes behind nginx (least_conn) on one-message rag, sharing spans by content.

The workload of benchmarks/cluster_spans.py (imported from it): each prompt one user message holding k = 4 of 12
Wikipedia passages (700 characters, Zipf 1.1) and a question; max_tokens=1, streamed. Each replica is its own
`sparsex serve MODEL --dtype float32 --num-blocks 2000` process (deploy/replicas.py's `Replica`), behind one nginx
(`Nginx`, deploy/nginx.conf, least_conn). Requests go one at a time by default (uncontended TTFTs): with no request
open on any replica least_conn falls back to round robin, so they alternate; `--concurrency C` keeps C open at a
time (least_conn then sends each to the replica with fewer open). Each replica's request count is read from its
own /metrics, and which replica answered a request from nginx's access log. Settings:

  spans              two replicas on one local redis-server (--segment-store redis://... --segment-store-spans)
  islands            two replicas, no store
  one                one replica
  cold-join          as spans, but the first half of the requests goes to replica A alone; then replica B starts
                     (a new process: empty KV, empty index), and once it answers /health nginx reloads (SIGHUP)
                     with both in its upstream for the second half (no request is in flight meanwhile)
  cold-join-islands  the same with no store

Per setting: the passage tokens that came back (a passage an earlier request carried, on any replica, counted
in the prompt as the engine tokenized it), those of them served from cache (the exact prefix hit or a reused
span: the response's usage.sparsex), TTFT (time to the stream's first token event, through nginx), and per
replica its requests, its own share, its span records published / installed / rejected, the MB it fetched from
Redis and the store's round-trip seconds on its TTFT path (/metrics).
A replica publishes to Redis behind its responses (write-behind): a record another replica needs may still
be on its way when the next request arrives, as it would be under back-to-back traffic (`--gap-ms` waits).

    .venv/bin/python benchmarks/cluster_nginx.py --requests 32
    .venv/bin/python benchmarks/cluster_nginx.py --requests 32 --concurrency 4 --settings spans,islands,one
    .venv/bin/python benchmarks/cluster_nginx.py --settings spans,one -- --min-blend-tokens 0   # args for every replica
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import socket
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))                                   # this checkout's sparsex
from benchmarks.cluster_spans import recurring_served, workload  # noqa: E402  the same workload and measure
from sparsex.bench import redis_server as rs                    # noqa: E402
from sparsex.models.hf_dir import load_tokenizer                 # noqa: E402
from sparsex.models.loader import prepare_model_dir             # noqa: E402

_spec = importlib.util.spec_from_file_location("sparsex_deploy_replicas", ROOT / "deploy" / "replicas.py")
replicas_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replicas_mod)

SETTINGS = ("spans", "islands", "one", "cold-join", "cold-join-islands")
TIMEOUT_S = 600.0        # a hang guard for one request


@dataclass
class Sent:
    """One request as the client saw it."""
    index: int
    replica: str                 # the upstream nginx logged for it
    ttft_s: float
    prompt_tokens: int
    came_back: int               # tokens of passages an earlier request carried
    served: int                  # of them, served from cache
    reuse_skipped: str | None


@dataclass
class ReplicaCounters:
    address: str
    requests: int                # sparsex:request_success_total (all finish reasons)
    published: int               # sparsex:segment_store_span_records_total by outcome
    installed: int
    rejected: int
    fetch_s: float               # sparsex:segment_store_fetch_seconds_total: shared-store round trips on the TTFT path
    read_mb: float               # sparsex:segment_store_read_bytes_total{tier="redis"}: records fetched


@dataclass
class SettingResult:
    setting: str
    requests: list[Sent]
    replicas: list[ReplicaCounters] = field(default_factory=list)
    join_at: int | None = None   # cold join: the first request the second replica could take
    index: str | None = None     # the shared store's anchor index after the run (shared settings)
    wall_s: float = 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_chat(base_url: str, message: str, tag: str) -> tuple[float, dict]:
    """POST one streamed chat request (max_tokens=1); (seconds to the first token event, the usage chunk).
    `tag` goes in X-Conversation-Id, which least_conn ignores and nginx's access log records."""
    body = {"messages": [{"role": "user", "content": message}], "max_tokens": 1, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base_url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json", "X-Conversation-Id": tag})
    t0 = time.perf_counter()
    ttft, usage = None, None
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise RuntimeError(f"{tag}: {event['error']}")
            # the first event (role only) leaves before the prefill; the token's event after it
            if ttft is None and any(c.get("finish_reason") or c["delta"].get("content") for c in event["choices"]):
                ttft = time.perf_counter() - t0
            usage = event.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError(f"{tag}: the stream ended without a token or usage")
    return ttft, usage


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def counters(replica) -> ReplicaCounters:
    with urllib.request.urlopen(replica.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    spans = "sparsex:segment_store_span_records_total"
    return ReplicaCounters(replica.address, int(metric_sum(text, "sparsex:request_success_total")),
                           *(int(metric_sum(text, spans, outcome=o)) for o in ("published", "installed", "rejected")),
                           metric_sum(text, "sparsex:segment_store_fetch_seconds_total"),
                           metric_sum(text, "sparsex:segment_store_read_bytes_total", tier="redis") / 1e6)


def index_size(redis) -> str:
    """The anchor index in Redis: its keys and their MEMORY USAGE, against the records they point at."""
    c = redis.client()
    anchors = c.keys("*:a:*")
    return (f"{len(anchors)} anchor keys, {sum(c.memory_usage(k) for k in anchors):,} bytes (MEMORY USAGE); "
            f"{len(c.keys('*')) - len(anchors)} other keys (records)")


def upstreams(nginx, tags: list[str], timeout_s: float = 10.0) -> dict[str, str]:
    """tag -> the replica that answered it (the last upstream tried), from nginx's access log; nginx writes
    a line just after its response, so the last one may take a moment."""
    pattern = re.compile(r'upstream="([^"]*)" .* conversation="([^"]*)"')
    deadline = time.monotonic() + timeout_s
    while True:
        found = {m.group(2): m.group(1).split(",")[-1].strip()
                 for m in map(pattern.search, nginx.access_log.read_text().splitlines()) if m}
        if all(t in found for t in tags) or time.monotonic() > deadline:
            return {t: found.get(t, "?") for t in tags}
        time.sleep(0.05)


def run_setting(setting: str, args: argparse.Namespace, tokenizer, texts: list[str],
                reqs: list[tuple[list[int], str]], workdir: Path) -> SettingResult:
    shared = setting in ("spans", "cold-join")
    cold = setting.startswith("cold-join")
    t_start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        serve = [args.model, "--dtype", "float32", "--num-blocks", "2000", "--torch-threads", str(args.threads),
                 "--log-level", "warning", *args.serve_args]
        if shared:
            redis = stack.enter_context(rs.RedisServer())
            serve += ["--segment-store", redis.url(), "--segment-store-spans"]
        reps = [replicas_mod.Replica(free_port(), serve, workdir) for _ in range(1 if setting == "one" else 2)]
        for r in reps:
            stack.callback(r.stop)
        first = reps[:1] if cold else reps
        for r in first:
            r.start()                          # both load the model at once
        for r in first:
            r.wait_healthy()
        nginx = replicas_mod.Nginx([r.address for r in first], free_port(), workdir / f"nginx-{setting}")
        nginx.start()
        stack.callback(nginx.stop)
        nginx.wait_ready()

        join_at = len(reqs) // 2 if cold else None
        answers: dict[int, tuple[float, dict]] = {}

        def one(i: int) -> None:
            answers[i] = stream_chat(nginx.url, reqs[i][1], f"req-{i}")
            if args.gap_ms:
                time.sleep(args.gap_ms / 1e3)

        # `concurrency` requests open at a time, sent in order (the cold join waits for the first half to end)
        phases = [range(join_at), range(join_at, len(reqs))] if cold else [range(len(reqs))]
        for n, phase in enumerate(phases):
            if n == 1:
                reps[1].start()
                reps[1].wait_healthy()
                nginx.reload([r.address for r in reps])
            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(one, phase))
        # a passage "came back" when a request sent before this one carried it (with several requests
        # open at once, that request may still be computing it: concurrency lowers what can be served)
        seen: set[int] = set()
        sent: list[tuple[int, float, dict, int, int]] = []
        for i, (idx, msg) in enumerate(reqs):
            ttft, usage = answers[i]
            sx = usage["sparsex"]
            came_back, served = recurring_served(
                tokenizer, msg, [texts[j] for j in idx if j in seen], sx["prefix_cached_tokens"],
                [(s["start"], s["end"]) for s in sx["reused_spans"]], usage["prompt_tokens"])
            seen.update(idx)
            sent.append((i, ttft, usage, came_back, served))
        where = upstreams(nginx, [f"req-{i}" for i in range(len(reqs))])
        result = SettingResult(setting, [Sent(i, where[f"req-{i}"], ttft, u["prompt_tokens"], c, s,
                                              u["sparsex"]["reuse_skipped"]) for i, ttft, u, c, s in sent],
                               [counters(r) for r in reps], join_at)
        if shared:
            result.index = index_size(redis)
    result.wall_s = time.perf_counter() - t_start
    return result


def share(sent: list[Sent]) -> tuple[int, int, float]:
    came_back, served = sum(s.came_back for s in sent), sum(s.served for s in sent)
    return came_back, served, served / max(came_back, 1)


def ttft_ms(sent: list[Sent]) -> str:
    t = np.array([s.ttft_s for s in sent]) * 1e3
    return f"{t.mean():,.0f} / {np.median(t):,.0f}" if len(t) else "-"


def report(res: SettingResult) -> str:
    """The setting's row, a row for the requests after a cold join, and one row per replica (markdown)."""
    def row(name: str, sent: list[Sent], requests: str, records: str) -> str:
        c, s, sh = share(sent)
        return f"| {name} | {requests} | {s:,} / {c:,} = {sh:.1%} | {ttft_ms(sent)} | {records} |"

    reps = res.replicas

    def records(rs: list[ReplicaCounters]) -> str:
        return (f"{sum(r.published for r in rs)} / {sum(r.installed for r in rs)} / {sum(r.rejected for r in rs)}; "
                f"{sum(r.read_mb for r in rs):,.0f} MB in {sum(r.fetch_s for r in rs) * 1e3:,.0f} ms")

    total = records(reps) if any(r.published for r in reps) else "—"
    lines = [row(f"**{res.setting}** ({len(reps)} replica{'s' * (len(reps) > 1)})", res.requests,
                 str(len(res.requests)), total)]
    if res.join_at is not None:
        lines.append(row("after the join", res.requests[res.join_at:], str(len(res.requests) - res.join_at), ""))
    for n, rc in enumerate(reps):
        mine = [x for x in res.requests if x.replica == rc.address]
        lines.append(row(f"replica {'AB'[n]}", mine, f"{rc.requests} (metrics), {len(mine)} (access log)",
                         records([rc]) if total != "—" else "—"))
    return "\n".join(lines)


HEADER = ("| setting / replica | requests | served from cache / passage tokens that came back | TTFT mean / p50 (ms) "
          "| span records published / installed / rejected; MB fetched from Redis in (store round trips on the TTFT path) |"
          "\n|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    own, serve_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Arguments after `--` go to every "
                                                                             "`sparsex serve`.")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per replica (default 2)")
    ap.add_argument("--gap-ms", type=float, default=0.0, help="pause after each response (default 0: back to back)")
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests open at a time (default 1: one at a time, so least_conn alternates)")
    ap.add_argument("--out", default=None, help="write every request's record here (JSON)")
    args = ap.parse_args(own)
    args.serve_args = serve_args
    if args.concurrency < 1:
        ap.error(f"--concurrency must be >= 1, got {args.concurrency}")
    settings = args.settings.split(",")
    if unknown := set(settings) - set(SETTINGS):
        ap.error(f"unknown settings {sorted(unknown)}; choose from {SETTINGS}")
    if replicas_mod.find_nginx() is None or not rs.available():
        sys.exit("needs nginx and redis-server (make install installs redis-server; apt-get install nginx)")
    tokenizer = load_tokenizer(prepare_model_dir(args.model))
    texts, reqs = workload(args.requests)
    # not a private dir: nginx started as root runs its workers as nobody, who must enter it
    workdir = Path(tempfile.mkdtemp(prefix="sparsex-cluster-"))
    workdir.chmod(0o755)
    results = []
    for setting in settings:
        res = run_setting(setting, args, tokenizer, texts, reqs, workdir)
        results.append(res)
        index = f"; Redis: {res.index}" if res.index else ""
        print(f"{setting}: {res.wall_s:.0f} s wall{index}\n{HEADER}\n{report(res)}\n", flush=True)
    print(HEADER)
    print("\n".join(report(r) for r in results))
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"logs: {workdir}")


if __name__ == "__main__":
    main()
