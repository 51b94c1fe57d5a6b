"""CPU attention backend, one layer: the paths `attention_backend.build_plan` chooses between where
the native flash-style kernel is not preferred (AVX2 CPUs).

Rows:
  fresh prefill of n tokens (causal SDPA), an extend of n / 8 rows after a cached prefix
  (prefix hit, chunked prefill), an extend of n - 32 rows after 32 cached (a blend's full layers
  after an exact hit on the system prompt) and n / 7 sparse rows over n keys (SparseX's sparse
  layers); the extends and sparse rows run masked SDPA over gathered keys, 256 rows a call. Each
  against the backend's GEMM row-chunk path (`sdpa=False`) in the model dtype and in float32 (for
  bf16: the dtype a CPU without native bf16 computes in).
Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64); K/V/Q are random, which does not
change the cost. Prints a markdown table of median ms per layer.

    .venv/bin/python benchmarks/cpu_attention.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from sparsex.config import cpu_has_native_bf16
from sparsex.layers.attention_backend import TorchAttentionBackend, build_plan
from sparsex.layers.attention_metadata import AttentionMetadata

H, KVH, D, BS = 9, 3, 64, 16


def _metadata(rows: torch.Tensor, n: int) -> AttentionMetadata:
    t = rows.numel()
    table = torch.arange(n // BS + 1, dtype=torch.int32)[None]
    contiguous = t == n
    return AttentionMetadata(rows, rows, torch.tensor([0, t], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                             table, t, n, [0, t], [n], contiguous=contiguous)


def _time_layer(query, k_cache, v_cache, rows, n, gemm_dtype, sdpa, repeats) -> float:
    """Median ms of one layer's attention with the plan fixed to the given choices."""
    def once():
        md = _metadata(rows, n)
        md.backend_plan = build_plan(md, BS, H // KVH, gemm_dtype, native=True, native_multi=False,
                                     sdpa=sdpa)
        return TorchAttentionBackend.attention(query, k_cache, v_cache, md, D ** -0.5)
    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    print("| dtype | rows | keys | GEMM chunks, model dtype (ms) | GEMM chunks, float32 (ms) | backend (ms) | backend runs |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # what the backend computes masked SDPA and chunks in on this CPU
        compute = torch.float32 if dtype == torch.bfloat16 and not cpu_has_native_bf16() else dtype
        for n in map(int, args.lengths.split(",")):
            k_cache = torch.randn(n // BS + 1, BS, KVH, D, generator=g).to(dtype)
            v_cache = torch.randn(n // BS + 1, BS, KVH, D, generator=g).to(dtype)
            for kind, rows in (("fresh prefill", torch.arange(n)), ("extend", torch.arange(n - n // 8, n)),
                               ("extend after 32 cached", torch.arange(32, n)), ("sparse rows", torch.arange(0, n, 7))):
                query = torch.randn(rows.numel(), H, D, generator=g).to(dtype)
                run = lambda gemm_dtype, sdpa: _time_layer(query, k_cache, v_cache, rows, n, gemm_dtype, sdpa,
                                                           args.repeats)
                chunks = run(dtype, False)
                in_f32 = f"{run(torch.float32, False):.1f}" if dtype != torch.float32 else "-"
                backend = run(compute, True)
                how = "causal SDPA" if kind == "fresh prefill" else "masked SDPA"
                if kind != "fresh prefill" and compute != dtype:
                    how += " in float32"
                print(f"| {str(dtype).removeprefix('torch.')} | {kind} ({rows.numel()}) | {n} | {chunks:.1f} | "
                      f"{in_f32} | {backend:.1f} | {how} |", flush=True)

if __name__ == "__main__":
    main()
