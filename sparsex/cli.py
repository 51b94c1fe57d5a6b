"""The `sparsex` command line.

    sparsex generate PROMPT [--model M] [--max-tokens N] [--temperature T] [--chat] [every engine flag]
    sparsex demo [--model M] [--cache C] [--dtype D] [--seed N] [--quick] [--no-compare]
    sparsex bench throughput [--num-prompts N] [--input-len N] [--output-len N] [--repeats N] [--dtype D]
    sparsex bench prefill [--lengths 512,1024,...] [--repeats N] [--plot PATH]
    sparsex bench serve --base-url URL ...
    sparsex bench workload --workload rag|chat|agent [--policies ...] [--sweep | --stream] [--peer vllm] --out DIR
    sparsex bench edit [--kinds chat,agent] [--caches prefix,sparsex] [--cases N] --out DIR
    sparsex bench replicas [--queries N] [--join-queries N] --out DIR     (shared segment store, 2 replicas)
    sparsex bench store [--sizes 64,256,1024,4096] [--repeats N] --out DIR  (store tier costs)
    sparsex serve [MODEL] [every engine flag] [server flags]
    sparsex calibrate [MODEL] [--requests N] [--dataset PATH] [--out PATH] [--threads N] [--dtype D]  (reuse profile file)

Engine flags (`--cache`, `--dtype`, `--recompute-ratio`, ...) come from EngineConfig / ReuseConfig
(serve_cli.add_engine_args, knob_args.add_knob_arg), so `generate`, `serve`, `LLM(...)`, `demo`'s `--model`,
`--cache`, `--dtype`, `--seed` and `bench`'s `--model`, `--dtype` share their names, defaults and
checks: docs/configuration.md. Every subcommand takes --threads N (torch intra-op threads). Bad arguments
and engine ValueErrors exit with status 2 and a one-line message, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from sparsex.arg_types import length_list, non_negative_float, positive_int
from sparsex.bench.edit_replay import add_edit_replay_parser
from sparsex.bench.replica_bench import add_replica_bench_parser
from sparsex.bench.serve_bench import add_serve_bench_parser
from sparsex.bench.store_bench import add_store_bench_parser
from sparsex.bench.workload_bench import add_workload_bench_parser
from sparsex.calibration import add_calibrate_parser
from sparsex.config import EngineConfig, parse_dtype
from sparsex.entrypoints.serve_cli import add_engine_args, add_reuse_profile_file_arg, add_serve_parser, engine_knobs
from sparsex.knob_args import add_knob_arg

EXIT_USAGE = 2


# ---------------------------------------------------------------------------- parser

def _common() -> argparse.ArgumentParser:
    """Options every subcommand shares (argparse `parents=`)."""
    p = argparse.ArgumentParser(add_help=False)
    add_knob_arg(p, EngineConfig, "model")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: torch's choice, one per core). On a machine shared "
                        "with other busy processes, 1 is often much faster than oversubscribing the cores")
    return p


def _add_generate(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("generate", parents=[common], help="generate a completion for one prompt",
                       description="Generate text for PROMPT and print it with latency and cache statistics.")
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--chat", action="store_true", help="wrap PROMPT as a user message in the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system message")
    add_engine_args(p)          # --seed among them: the engine's and the sampling seed
    add_reuse_profile_file_arg(p)
    p.set_defaults(func=_run_generate)


def _add_demo(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("demo", parents=[common], help="RAG questions over ingested passages, with segment reuse vs full prefill",
                       description="Ingest a few Wikipedia passages, then ask questions over them in new orders: "
                                   "per question the tokens served from cache and recomputed, TTFT with reuse "
                                   "against full prefill (cache=none), and whether the answers match.")
    for name in ("cache", "dtype", "seed"):
        add_knob_arg(p, EngineConfig, name)
    p.add_argument("--max-tokens", type=positive_int, default=24)
    p.add_argument("--quick", action="store_true", help="2 questions over 4 passages (a smoke test)")
    p.add_argument("--no-compare", action="store_true", help="skip the cache=none rerun")
    p.set_defaults(func=_run_demo)


def _add_bench(sub, common: argparse.ArgumentParser) -> None:
    bench = sub.add_parser("bench", help="benchmarks (throughput, prefill, ...)")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)

    p = bsub.add_parser("throughput", parents=[common],
                        help="batch throughput on random prompts, vs transformers generate",
                        description="Offline throughput: seeded random prompts, ignore_eos, the engine "
                                    "vs transformers generate (batched, left padding) in the same process.")
    p.add_argument("--num-prompts", type=positive_int, default=8)
    p.add_argument("--input-len", type=positive_int, default=256)
    p.add_argument("--output-len", type=positive_int, default=128)
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="alternating runs per backend; the median is reported (default 1)")
    add_knob_arg(p, EngineConfig, "dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.set_defaults(func=_run_bench_throughput)

    p = bsub.add_parser("prefill", parents=[common], help="cold TTFT vs prompt length, vs a transformers forward",
                        description="Cold prefill (cache=none) TTFT per prompt length, median of repeats, "
                                    "the engine vs a transformers forward of the same ids.")
    p.add_argument("--lengths", type=length_list, default=(512, 1024, 2048, 4096),
                   help="comma-separated prompt lengths (default 512,1024,2048,4096)")
    p.add_argument("--repeats", type=positive_int, default=3)
    add_knob_arg(p, EngineConfig, "dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--no-hf-all-logits", action="store_true",
                   help="skip the transformers variant that computes every row's logits")
    p.add_argument("--plot", default="docs/img/prefill_cpu.png", help="PNG path ('' for none)")
    p.set_defaults(func=_run_bench_prefill)

    add_serve_bench_parser(bsub)
    add_workload_bench_parser(bsub)
    add_edit_replay_parser(bsub)
    add_replica_bench_parser(bsub)
    add_store_bench_parser(bsub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparsex", description="SparseX: LLM serving with segment-level KV reuse.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = _common()
    _add_generate(sub, common)
    _add_demo(sub, common)
    _add_bench(sub, common)
    add_serve_parser(sub)
    add_calibrate_parser(sub)
    return parser


# ---------------------------------------------------------------------------- handlers
# Heavy imports (torch, transformers) stay inside the handlers: `sparsex --help` and argument
# errors then answer at once.

def _run_generate(args: argparse.Namespace) -> int:
    from sparsex.entrypoints.llm import LLM
    from sparsex.models.loader import resolve_model_name
    from sparsex.sampling_params import SamplingParams

    resolve_model_name(args.model)         # an unknown model fails before any loading
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)
    llm = LLM(reuse_profile_file=args.reuse_profile_file, **engine_knobs(args))
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        out = llm.chat(messages, params, use_tqdm=False)[0]
    else:
        if args.system:
            raise ValueError("--system needs --chat")
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    _print_generation(out, llm)
    return 0


def _print_generation(out, llm) -> None:
    import torch

    comp = out.outputs[0]
    m = out.metrics
    n = len(comp.token_ids)
    decode_s = (m.e2e or 0.0) - (m.ttft or 0.0)
    # decode speed excludes the first token, which the prefill produced
    decode = f"{(n - 1) / decode_s:.1f} tokens/s" if n > 1 and decode_s > 0 else "n/a (one token)"
    print(comp.text)
    print()
    print("--- stats ---")
    rows = [
        ("model", f"{llm.llm_engine.model_name} ({str(llm.config.torch_dtype).removeprefix('torch.')}, "
                  f"cache={llm.config.cache}, "
                  f"threads={torch.get_num_threads()})"),
        ("prompt tokens", str(len(out.prompt_token_ids))),
        ("generated tokens", f"{n} (finish: {comp.finish_reason})"),
        ("TTFT", f"{m.ttft * 1e3:.0f} ms"),
        ("decode", decode),
        ("end-to-end", f"{m.e2e * 1e3:.0f} ms, {n / m.e2e:.1f} tokens/s"),
        ("prefix-cached tokens", str(out.num_cached_tokens)),
        ("segment-reused tokens", str(out.num_reused_tokens)),
        ("recomputed tokens", str(out.num_recomputed_tokens)),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k + ':':<{width + 2}}{v}")


def _run_demo(args: argparse.Namespace) -> int:
    from sparsex.demo import DemoConfig, run_demo
    from sparsex.models.loader import resolve_model_name

    resolve_model_name(args.model)
    return run_demo(DemoConfig(model=args.model, cache=args.cache, dtype=args.dtype, max_tokens=args.max_tokens,
                               quick=args.quick, compare=not args.no_compare, seed=args.seed))


def _dtype_name(dtype: str) -> str:
    """What a --dtype resolves to on this CPU ("auto" -> "bfloat16" or "float32")."""
    return str(parse_dtype(dtype)).removeprefix("torch.")


def _bench_header(args: argparse.Namespace) -> None:
    import os

    import torch
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"model={args.model} dtype={_dtype_name(args.dtype)} threads={torch.get_num_threads()} "
          f"cores={os.cpu_count()} load1={load:.2f}", flush=True)


def _run_bench_throughput(args: argparse.Namespace) -> int:
    from sparsex.bench.throughput import ThroughputConfig, format_table, run_throughput
    from sparsex.models.loader import resolve_model_name

    resolve_model_name(args.model)
    _bench_header(args)
    cfg = ThroughputConfig(model=args.model, num_prompts=args.num_prompts, input_len=args.input_len,
                           output_len=args.output_len, repeats=args.repeats, dtype=args.dtype, seed=args.seed,
                           hf=not args.no_hf)
    print(format_table(run_throughput(cfg)))
    return 0


def _run_bench_prefill(args: argparse.Namespace) -> int:
    import os

    import torch

    from sparsex.bench.prefill import PrefillConfig, format_table, run_prefill, save_plot
    from sparsex.models.loader import resolve_model_name

    resolve_model_name(args.model)
    _bench_header(args)
    cfg = PrefillConfig(model=args.model, lengths=tuple(args.lengths), repeats=args.repeats, dtype=args.dtype,
                        seed=args.seed, hf=not args.no_hf, hf_full_logits=not args.no_hf_all_logits)
    points = run_prefill(cfg)
    print(format_table(points))
    if args.plot:
        # the load average goes in the title: on a shared machine it explains the absolute numbers
        title = (f"cold prefill, {args.model} {_dtype_name(args.dtype)}, median of {args.repeats}\n"
                 f"{torch.get_num_threads()} threads, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
        save_plot(points, args.plot, title)
        print(f"plot: {args.plot}")
    return 0


# ---------------------------------------------------------------------------- entry point

def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)          # usage errors: argparse prints them and exits 2
    threads = getattr(args, "threads", None)       # `serve` has --torch-threads instead
    if threads is not None and threads < 1:        # a subcommand's own --threads may be a plain int
        parser.error(f"--threads must be >= 1, got {threads}")
    if threads is not None:
        import torch
        torch.set_num_threads(threads)
    try:
        status = args.func(args)
    except ValueError as e:
        # Invalid input discovered past argparse (unknown model, prompt too long, ...): one line.
        print(f"sparsex {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
