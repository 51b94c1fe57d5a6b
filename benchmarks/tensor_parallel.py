"""Tensor parallelism: full prefill, blended prefill and decode at tensor_parallel_size 1, 2, ...

    # one H100/H200 per rank (random weights of a named real shape, bf16)
    python benchmarks/tensor_parallel.py --model dummy:llama3-8b --tp 1 2 --device cuda --out DIR
    python benchmarks/tensor_parallel.py --model dummy:llama3-70b --tp 2 --device cuda --out DIR     # 2 x H200
    python benchmarks/tensor_parallel.py --model dummy:llama3-70b --tp 4 --device cuda --out DIR     # 4 x H100
    # the CPU (gloo): the same tables on a model small enough
    python benchmarks/tensor_parallel.py --model qwen2.5-coder-0.5b-instruct --tp 1 2 --device cpu \
        --dtype float32 --prefill 1024 --decode-batch 1 4 --decode-steps 8

Each tensor_parallel_size runs in a process of its own (a process belongs to one torch.distributed
group), one engine with cache="sparsex":
  prefill   TTFT of a prompt of random token ids nothing cached (full prefill), and of a RAG-like
            prompt (a head, passages of 512 tokens, a question) whose passages an earlier prompt
            cached in another order (blended, the engine's default reuse knobs); medians of 3
  decode    tokens/s at each batch (prompts of 128 tokens; (max_tokens=S+1 run - max_tokens=1 run)
            / S steps), against the HBM floor of a step: (the rank's weights + its KV read) / the
            measured device copy bandwidth (CUDA only)
  comm      the share of a decode step's and of a full prefill's device time spent in the
            all-reduces and all-gathers (torch.profiler on rank 0)
Token ids are random: speed only. Prints one table per section; --out writes tensor_parallel.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from sparsex.arg_types import parse_bytes  # noqa: E402

PASSAGE = 512
HEAD, QUESTION = 64, 48


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(3, 30000, n).tolist()


def _ttft(llm, prompt) -> tuple[float, object]:
    from sparsex import SamplingParams
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    return time.perf_counter() - t0, out


def _decode(llm, rng, batch: int, steps: int) -> float:
    """Seconds per decode step at `batch` sequences."""
    from sparsex import SamplingParams
    prompts = [{"prompt_token_ids": _ids(rng, 128)} for _ in range(batch)]

    def run(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0
    run(2)                                                                 # warm: graphs, kernels
    return (statistics.median(run(steps + 1) for _ in range(3)) - statistics.median(run(1) for _ in range(3))) / steps


def _copy_bandwidth(device) -> float | None:
    """Bytes per second of a 2 GiB device copy (read + written), CUDA only."""
    import torch
    if device.type != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize(device)
    return 2 * a.numel() * 10 / (time.perf_counter() - t0)


def _comm_share(llm, prompt_fn) -> float:
    """Share of rank 0's device (CPU: host) time in the collectives during `prompt_fn()`."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = llm.llm_engine.runner.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        prompt_fn()
        if cuda:
            torch.cuda.synchronize()
    comm = total = 0.0
    for e in prof.key_averages():
        t = e.self_device_time_total if cuda else e.self_cpu_time_total
        total += t
        name = e.key.lower()
        if any(s in name for s in ("allreduce", "all_reduce", "allgather", "all_gather", "nccl")):
            comm += t
    return comm / max(total, 1e-9)


def one(args) -> dict:
    """Every section at one tensor_parallel_size (this process is rank 0)."""
    from sparsex import LLM, SamplingParams
    rng = np.random.default_rng(0)
    llm = LLM(model=args.model, cache="sparsex", dtype=args.dtype, device=args.device,
              tensor_parallel_size=args.one, kv_cache_memory=args.kv_cache_memory,
              max_model_len=max(args.prefill) + 1024)
    eng = llm.llm_engine
    runner = eng.runner.runner if args.one > 1 else eng.runner
    res = {"tp": args.one, "model": args.model, "dtype": str(runner.dtype), "device": str(runner.device),
           "prefill": [], "decode": []}
    _ttft(llm, {"prompt_token_ids": _ids(rng, 256)})                       # warm
    for n in args.prefill:
        k = max(1, (n - HEAD - QUESTION) // PASSAGE)
        passages = [_ids(rng, PASSAGE) for _ in range(k)]
        full = [_ttft(llm, {"prompt_token_ids": _ids(rng, n)})[0] for _ in range(3)]
        llm.generate([{"segments": [_ids(rng, HEAD), _ids(rng, PASSAGE)] + passages + [_ids(rng, QUESTION)]}],
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)     # caches the passages
        blended, out = [], None
        for r in range(4):                                                 # the first compiles: untimed
            order = np.random.default_rng(r).permutation(k)
            t, out = _ttft(llm, {"segments": [_ids(rng, HEAD)] + [passages[i] for i in order] + [_ids(rng, QUESTION)]})
            if r:
                blended.append(t)
        res["prefill"].append({"tokens": n, "full_s": statistics.median(full), "blended_s": statistics.median(blended),
                               "reused": out.num_reused_tokens, "recomputed": out.num_recomputed_tokens})
    bw = _copy_bandwidth(runner.device)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    weight_bytes += sum(b.numel() * b.element_size() for b in runner.model.buffers())
    for batch in args.decode_batch:
        step = _decode(llm, rng, batch, args.decode_steps)
        kv = batch * (128 + args.decode_steps // 2) * runner.bytes_per_block() // runner.block_size
        floor = (weight_bytes + kv) / bw if bw else None
        res["decode"].append({"batch": batch, "step_s": step, "tokens_per_s": batch / step,
                              "hbm_floor_fraction": floor / step if floor else None})
    if args.one > 1:
        from sparsex import SamplingParams as SP
        prompts = [{"prompt_token_ids": _ids(rng, 128)} for _ in range(16)]
        res["comm_share_decode16"] = _comm_share(llm, lambda: llm.generate(
            prompts, SP(temperature=0.0, max_tokens=9, ignore_eos=True), use_tqdm=False))
        res["comm_share_prefill"] = _comm_share(llm, lambda: _ttft(llm, {"prompt_token_ids": _ids(rng, args.prefill[0])}))
    eng.close()
    return res


def _table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n{title}")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama3-8b")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-memory", type=parse_bytes, default="24G")
    ap.add_argument("--prefill", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--decode-batch", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--out")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)            # internal: run one size here
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args)), flush=True)
        return
    results = []
    for tp in args.tp:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(tp)] + [
            a for a in sys.argv[1:] if a != "--one"]
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout
        results.append(json.loads(next(line[7:] for line in out.splitlines() if line.startswith("RESULT "))))
    base = {r["tokens"]: r["full_s"] for r in results[0]["prefill"]}
    _table(f"prefill TTFT ({args.model}, {results[0]['dtype']}, {results[0]['device']})",
           ["TP", "tokens", "full ms", "blended ms", "blended / full", f"full vs TP={results[0]['tp']}", "recomputed / reused"],
           [[str(r["tp"]), str(p["tokens"]), f"{p['full_s'] * 1e3:.1f}", f"{p['blended_s'] * 1e3:.1f}",
             f"{p['blended_s'] / p['full_s']:.3f}", f"{base[p['tokens']] / p['full_s']:.2f}x",
             f"{p['recomputed']} / {p['reused']}"] for r in results for p in r["prefill"]])
    _table("decode", ["TP", "batch", "ms / step", "tokens/s", "HBM floor fraction"],
           [[str(r["tp"]), str(d["batch"]), f"{d['step_s'] * 1e3:.2f}", f"{d['tokens_per_s']:.1f}",
             "-" if d["hbm_floor_fraction"] is None else f"{d['hbm_floor_fraction']:.2f}"]
            for r in results for d in r["decode"]])
    comm = [r for r in results if "comm_share_decode16" in r]
    if comm:
        _table("collectives' share of rank 0's time", ["TP", "decode, batch 16", f"prefill {args.prefill[0]}"],
               [[str(r["tp"]), f"{r['comm_share_decode16']:.1%}", f"{r['comm_share_prefill']:.1%}"] for r in comm])
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "tensor_parallel.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
