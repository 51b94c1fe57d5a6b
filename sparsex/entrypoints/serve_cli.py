"""`sparsex serve`: the OpenAI-compatible server from the command line.

The CLI owner wires it with `add_serve_parser(subparsers)`; the parser's default `func` is
`run_serve`. `python -m sparsex.entrypoints.serve_cli ...` works on its own too.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys

from sparsex.config import CACHE_MODES, SELECTORS, EngineConfig, ReuseConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1.5GiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 1073741824, 512M, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Every knob of `LLM(...)`; defaults come from EngineConfig / ReuseConfig, so they cannot drift."""
    e, r = _defaults(EngineConfig), _defaults(ReuseConfig)
    g = p.add_argument_group("engine")
    g.add_argument("--cache", choices=CACHE_MODES, default=e["cache"],
                   help="KV reuse: none, prefix (exact prefix caching), "
                        "sparsex (prefix + segment reuse: approximate KV for reused segments)")
    g.add_argument("--dtype", default=e["dtype"], help="float32 | bfloat16 | float16 | auto (bfloat16 where the CPU runs it natively)")
    g.add_argument("--device", default=e["device"], help="cpu | cuda | cuda:N")
    g.add_argument("--seed", type=int, default=e["seed"])
    g.add_argument("--block-size", type=int, default=e["block_size"])
    g.add_argument("--num-blocks", type=_positive_int, default=e["num_blocks"],
                   help="KV pool size in blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=e["kv_cache_memory"], help="bytes for the KV pool, e.g. 1G")
    g.add_argument("--max-model-len", type=_positive_int, default=e["max_model_len"], help="default: the model's context length")
    g.add_argument("--max-num-seqs", type=_positive_int, default=e["max_num_seqs"])
    g.add_argument("--max-num-batched-tokens", type=_positive_int, default=e["max_num_batched_tokens"])
    g.add_argument("--full-layers", type=int, default=r["full_layers"], help="segment reuse: layers that recompute every token")
    g.add_argument("--recompute-ratio", type=float, default=r["recompute_ratio"],
                   help="segment reuse: share of reused tokens recomputed")
    g.add_argument("--selector", choices=SELECTORS, default=r["selector"], help="segment reuse: how tokens to recompute are chosen")
    g.add_argument("--boundary-tokens", type=int, default=r["boundary_tokens"],
                   help="segment reuse: also recompute each segment's first k tokens")
    g.add_argument("--boundary-share", type=float, default=r["boundary_share"],
                   help="segment reuse: share of sparse_q's budget spent on the first tokens of each reused segment")
    g.add_argument("--min-segment-tokens", type=int, default=r["min_segment_tokens"],
                   help="segment reuse: shorter pieces are not indexed")
    g.add_argument("--min-context-tokens", type=int, default=r["min_context_tokens"],
                   help="segment reuse: a segment computed before this position is reused only before it "
                        "(elsewhere recomputed and re-indexed); 0 = reuse anywhere")
    g.add_argument("--min-blend-tokens", type=int, default=r["min_blend_tokens"],
                   help="segment reuse: a request blends only when its segment hits total at least this many "
                        "tokens (below it they are recomputed and the request stays exact); 0 = always")
    g.add_argument("--rescore-layers", type=int, default=r["rescore_layers"],
                   help="segment reuse, two-stage selection: the first selection keeps --candidate-ratio of the "
                        "reused tokens, which run this many more layers and are scored again there; 0 = one stage "
                        "(default: 2 for sparse_q, one stage for the other selectors)")
    g.add_argument("--candidate-ratio", type=float, default=r["candidate_ratio"],
                   help="segment reuse, two-stage selection: share of reused tokens the first selection keeps")
    g.add_argument("--no-approx-prefix", dest="approx_prefix", action="store_false", default=r["approx_prefix"],
                   help="segment reuse: blend every reused segment afresh instead of continuing an earlier "
                        "request's blended blocks (slower, closer to full prefill)")
    g.add_argument("--merge-encodings", type=int, default=r["merge_encodings"],
                   help="segment reuse: a segment computed exactly again in another context is merged into its "
                        "index entry, the mean of up to this many encodings; 1 = keep the first")
    g.add_argument("--segment-eviction", choices=("lru", "frequency"), default=e["segment_eviction"])
    g.add_argument("--cache-dir", default=e["cache_dir"], help="where converted models are cached (default $SPARSEX_CACHE_DIR)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=e["warmup"],
                   help="run a few small requests at start-up so the first real one compiles no kernels "
                        "(default: on for CUDA, off for the CPU)")


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=os.environ.get("SPARSEX_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize (default: $SPARSEX_API_KEY)")
    g.add_argument("--max-queued-requests", type=_positive_int, default=None,
                   help="answer 503 + Retry-After when this many requests are already waiting")
    g.add_argument("--tenant-header", default=None,
                   help="request header naming the tenant (e.g. X-Tenant-ID): tenants never share cached KV")
    g.add_argument("--allow-shared-segments", action="store_true",
                   help="accept content parts marked cache_segment.scope='shared' (cross-tenant reuse)")
    g.add_argument("--served-model-name", default=None, help="the model name clients use (default: the model's)")
    g.add_argument("--shutdown-timeout", type=float, default=None,
                   help="on SIGTERM, seconds to wait for in-flight requests before closing them (default: wait)")
    g.add_argument("--torch-threads", type=_positive_int, default=None,
                   help="torch intra-op threads (default: torch's choice); lower it on shared machines")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve a model over an OpenAI-compatible HTTP API (see docs/server.md).")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=f"model name or path (default {DEFAULT_MODEL})")
    add_engine_args(p)
    add_server_args(p)
    p.set_defaults(func=run_serve)
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    reuse = ReuseConfig(full_layers=args.full_layers, recompute_ratio=args.recompute_ratio, selector=args.selector,
                        boundary_tokens=args.boundary_tokens, boundary_share=args.boundary_share,
                        min_segment_tokens=args.min_segment_tokens,
                        min_context_tokens=args.min_context_tokens, min_blend_tokens=args.min_blend_tokens,
                        rescore_layers=args.rescore_layers, candidate_ratio=args.candidate_ratio,
                        approx_prefix=args.approx_prefix, merge_encodings=args.merge_encodings)
    return EngineConfig(model=args.model, dtype=args.dtype, device=args.device, cache=args.cache, seed=args.seed,
                        block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
                        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs, segment_eviction=args.segment_eviction, reuse=reuse,
                        cache_dir=args.cache_dir, warmup=args.warmup)


def run_serve(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from sparsex.entrypoints.async_engine import AsyncLLM
    from sparsex.entrypoints.openai_server import build_app
    from sparsex.entrypoints.settings import ServerSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    try:
        config = engine_config(args)
        settings = ServerSettings(api_key=args.api_key, tenant_header=args.tenant_header,
                                  allow_shared_segments=args.allow_shared_segments,
                                  served_model_name=args.served_model_name)
    except ValueError as e:
        print(f"sparsex serve: {e}", file=sys.stderr)
        return 2
    engine = AsyncLLM.from_config(config, max_queued_requests=args.max_queued_requests)
    app = build_app(engine, settings)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout))
    server.run()            # SIGINT / SIGTERM: stop accepting, finish in-flight requests, drain, exit
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparsex")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
