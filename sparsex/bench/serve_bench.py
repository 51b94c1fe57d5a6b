"""Online serving benchmark: the RAG workload against a running `sparsex serve`, at fixed request
rates with Poisson arrivals, streaming, measured on the client.

    sparsex bench serve --base-url http://127.0.0.1:8000 --num-requests 24 --k 4 --request-rate 0.3

Per rate: completed requests, errors, req/s and output tok/s over the run's wall time, client-side
TTFT (send -> first non-empty content chunk) p50/p99, end-to-end latency p50, and the share of
prompt tokens the server reported as cached (`usage.prompt_tokens_details.cached_tokens`).

`--api segments` (default) sends each request's pieces (system head, each passage, question) as
the `/v1/completions` `segments` extension, so every passage is a reusable segment;
`--api chat` sends the same prompt as chat messages (one segment per message).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None
    latency: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class RateResult:
    rate: float
    num_requests: int
    errors: int
    duration_s: float
    req_per_s: float
    output_tok_per_s: float
    ttft_p50: float
    ttft_p99: float
    latency_p50: float
    cached_share: float
    results: list[RequestResult] = field(default_factory=list, repr=False)


def load_tokenizer(path: str | None):
    """An HF tokenizer directory or .gguf file; default: the packaged SmolLM2 (the default model)."""
    from transformers import AutoTokenizer
    if path is None:
        from sparsex.models.packaged_gguf import smollm2_gguf_path
        path = smollm2_gguf_path()
    if path.lower().endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def _payload(req: Any, args: argparse.Namespace, model: str) -> tuple[str, dict[str, Any]]:
    common = {"model": model, "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": args.ignore_eos}
    if args.api == "chat":
        return "/v1/chat/completions", {**common, "messages": req.messages}
    return "/v1/completions", {**common, "segments": list(req.segments)}


async def _one(client: httpx.AsyncClient, path: str, body: dict[str, Any], headers: dict[str, str]) -> RequestResult:
    start = time.perf_counter()
    res = RequestResult(ok=False)
    try:
        async with client.stream("POST", path, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    res.ok = res.error is None
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = event["error"].get("message", "error event")
                    continue
                for choice in event.get("choices") or []:
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text and res.ttft is None:
                        res.ttft = time.perf_counter() - start
                usage = event.get("usage")
                if usage:
                    res.prompt_tokens = usage["prompt_tokens"]
                    res.output_tokens = usage["completion_tokens"]
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - start
    return res


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


async def run_rate(args: argparse.Namespace, rate: float, requests: list[Any], model: str) -> RateResult:
    rng = np.random.default_rng(args.seed)
    gaps = np.zeros(len(requests)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(requests))
    gaps[0] = 0.0
    offsets = np.cumsum(gaps)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.tenant_header and args.tenant:
        headers[args.tenant_header] = args.tenant
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def launch(i: int, req: Any) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            path, body = _payload(req, args, model)
            return await _one(client, path, body, headers)

        results = await asyncio.gather(*(launch(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    return RateResult(
        rate=rate, num_requests=len(results), errors=len(results) - len(ok), duration_s=duration,
        req_per_s=len(ok) / duration, output_tok_per_s=sum(r.output_tokens for r in ok) / duration,
        ttft_p50=_pct([r.ttft for r in ok if r.ttft is not None], 50),
        ttft_p99=_pct([r.ttft for r in ok if r.ttft is not None], 99),
        latency_p50=_pct([r.latency for r in ok if r.latency is not None], 50),
        cached_share=(sum(r.cached_tokens for r in ok) / prompt) if prompt else 0.0, results=list(results))


def format_table(rows: list[RateResult], label: str = "") -> str:
    head = (f"{'label':<10} {'rate':>6} {'reqs':>5} {'err':>4} {'dur s':>7} {'req/s':>6} {'out tok/s':>9} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'e2e p50':>8} {'cached':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rate = "inf" if math.isinf(r.rate) else f"{r.rate:g}"
        lines.append(f"{label:<10} {rate:>6} {r.num_requests:>5} {r.errors:>4} {r.duration_s:>7.1f} {r.req_per_s:>6.3f} "
                     f"{r.output_tok_per_s:>9.2f} {r.ttft_p50:>8.2f}s {r.ttft_p99:>8.2f}s {r.latency_p50:>7.2f}s "
                     f"{r.cached_share:>6.1%}")
    return "\n".join(lines)


def _served_model(args: argparse.Namespace) -> str:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    r = httpx.get(args.base_url + "/v1/models", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run_serve_bench(args: argparse.Namespace) -> int:
    from sparsex.bench.workloads import rag_workload

    model = args.model or _served_model(args)
    tokenizer = load_tokenizer(args.tokenizer)
    requests = rag_workload(tokenizer, num_queries=args.num_requests, k=args.k, num_passages=args.num_passages,
                            seed=args.seed)
    rows = [asyncio.run(run_rate(args, rate, requests, model)) for rate in args.request_rate]
    print(format_table(rows, args.label or ""))
    for r in rows:
        for res in r.results:
            if res.error:
                print(f"  error at rate {r.rate:g}: {res.error}", file=sys.stderr)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump([{**{k: v for k, v in asdict(r).items() if k != "results"}, "label": args.label}
                       for r in rows], f, indent=2)
    return 1 if any(r.errors for r in rows) else 0


def _rate(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {text}")
    return v


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("SPARSEX_API_KEY"))
    p.add_argument("--model", default=None, help="default: the first model the server lists")
    p.add_argument("--api", choices=("segments", "chat"), default="segments")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--k", type=int, default=4, help="passages per request")
    p.add_argument("--num-passages", type=int, default=100, help="corpus size (Zipf popularity over it)")
    p.add_argument("--request-rate", type=_rate, nargs="+", default=[0.3], help="req/s, Poisson arrivals; inf = all at once")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly max-tokens (comparable output tok/s across configs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir or .gguf (default: packaged SmolLM2)")
    p.add_argument("--tenant-header", default=None)
    p.add_argument("--tenant", default=None)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--label", default=None, help="first column of the table (e.g. the server's cache mode)")
    p.add_argument("--output-json", default=None)


def add_serve_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """For the CLI owner: `sparsex bench serve ...`."""
    p = subparsers.add_parser("serve", help="online benchmark against a running server (RAG workload)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    p.set_defaults(func=run_serve_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsex bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(parser)
    return run_serve_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
