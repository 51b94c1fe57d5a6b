"""Time SparseX's Triton kernels on one GPU against torch, and print a table (GPU machine only).

    PYTHONPATH=. python3 benchmarks/gpu_kernels.py [--sweep] [--out DIR]

Shapes are Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), bf16, KV block size 16,
with the cache blocks shuffled (a fragmented pool, as in serving). Every case first checks the
Triton output against torch (rel. L2 error, printed). Times are medians of CUDA-event timings after
warm-up: compute-bound attention through triton.testing.do_bench (which flushes the L2 before every
run); short memory-bound kernels (decode, copies) through CUDA-graph replay over several distinct input
sets, so neither host launch cost nor a warm L2 enters their numbers.

Rates are against ceilings measured in the same call: a device-to-device copy (bytes read + written)
and an 8192^3 bf16 matmul. Causal attention FLOPs count only visible (row, key) pairs:
4 * head_dim * num_heads * sum over rows of (position + 1).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from sparsex.layers.attention_backend import TorchAttentionBackend  # noqa: E402
from sparsex.layers.attention_metadata import AttentionMetadata  # noqa: E402
from sparsex.layers.triton_attention import (  # noqa: E402
    TritonAttentionBackend, _decode_kernel, _prefill_config, _prefill_kernel, decode_attention, prefill_attention,
)
from sparsex.layers.triton_probe import kv_deviation, query_key_mass  # noqa: E402
from sparsex.layers.triton_rerotate import LayerPointers, copy_and_rerotate_layers, copy_and_rerotate_torch  # noqa: E402
from sparsex.segment import selectors  # noqa: E402

H, HKV, D, BS = 32, 8, 128, 16
DT = torch.bfloat16
DEV = torch.device("cuda")
SCALE = 1.0 / math.sqrt(D)
ROWS: list[dict] = []


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")


def graph_ms(fns: list, reps: int = 30) -> float:
    """Median GPU time of one call, from CUDA-graph replays that run every fn of `fns` once in a row.

    For short, memory-bound kernels: the graph removes the host launch cost (which do_bench would
    time, as the GPU idles waiting for it), and the fns work on distinct inputs whose total is
    several times the 60 MB L2, so no call finds its data in cache.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                                           # compile + warm-up outside capture
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(fns))
    return sorted(times)[len(times) // 2]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def record(case: str, impl: str, ms: float, *, flops: float | None = None, nbytes: float | None = None,
           err: float | None = None, note: str = "") -> None:
    ROWS.append(dict(case=case, impl=impl, ms=ms, flops=flops, bytes=nbytes, err=err, note=note))
    print(f"  {case:34s} {impl:34s} {ms:9.3f} ms  err={err if err is not None else '-'} {note}", flush=True)


def measure_ceilings() -> tuple[float, float]:
    x = torch.randn(512 * 2**20, device=DEV, dtype=torch.float32)          # 2 GiB
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median")
    tbps = 2 * x.numel() * 4 / ms / 1e9
    del x, y
    a = torch.randn(8192, 8192, device=DEV, dtype=DT)
    b = torch.randn(8192, 8192, device=DEV, dtype=DT)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=10, rep=200, return_mode="median")
    return tbps, 2 * 8192**3 / ms / 1e9


def paged_batch(seq_lens: list[int], rows: list[torch.Tensor], contiguous: bool):
    """Random K/V for every position of each sequence in shuffled cache blocks, plus query rows."""
    nbs = [(n + BS - 1) // BS for n in seq_lens]
    pool = torch.randperm(sum(nbs), device=DEV).int()
    bt = torch.zeros(len(seq_lens), max(nbs), dtype=torch.int32, device=DEV)
    k_cache = torch.empty(sum(nbs), BS, HKV, D, device=DEV, dtype=DT)
    v_cache = torch.empty_like(k_cache)
    dense_k, dense_v, pos, slots, cu, used = [], [], [], [], [0], 0
    for s, (n, r, nb) in enumerate(zip(seq_lens, rows, nbs)):
        bt[s, :nb] = pool[used:used + nb]
        used += nb
        k = torch.randn(n, HKV, D, device=DEV, dtype=DT)                   # [n, HKV, D]
        v = torch.randn(n, HKV, D, device=DEV, dtype=DT)
        all_slots = bt[s, torch.arange(n, device=DEV) // BS].long() * BS + torch.arange(n, device=DEV) % BS
        TorchAttentionBackend.store_kv(k, v, k_cache, v_cache, all_slots)
        dense_k.append(k)
        dense_v.append(v)
        r = r.to(DEV)
        pos.append(r)
        slots.append(all_slots[r])
        cu.append(cu[-1] + r.numel())
    md = AttentionMetadata(
        positions=torch.cat(pos), slot_mapping=torch.cat(slots),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV), block_tables=bt,
        max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])), max_seq_len=max(seq_lens),
        cu_seqlens_q_cpu=cu, seq_lens_cpu=list(seq_lens), contiguous=contiguous,
    )
    q = torch.randn(cu[-1], H, D, device=DEV, dtype=DT)                    # [T, H, D]
    return q, k_cache, v_cache, md, dense_k, dense_v


def default_config() -> dict:
    return _prefill_config(D, DT, H // HKV)


def config_tag(cfg: dict) -> str:
    tag = "m{block_m} n{block_n} w{num_warps} s{num_stages}".format(**cfg)
    return tag + (", default" if cfg == default_config() else "")


def causal_flops(positions: torch.Tensor) -> float:
    return 4.0 * D * H * float((positions.double() + 1).sum())


def sdpa(q, k, v, backend, **kw):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, scale=SCALE, **kw)


def prefill_cases(sweep: bool) -> None:
    configs = [default_config()]
    if sweep:
        configs += [dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
                    dict(block_m=128, block_n=32, num_warps=4, num_stages=4),
                    dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
                    dict(block_m=256, block_n=64, num_warps=8, num_stages=2)]
    for n in (2048, 8192, 32768):
        case = f"prefill {n // 1024}k (1 seq, causal)"
        q, kc, vc, md, dk, dv = paged_batch([n], [torch.arange(n)], contiguous=True)
        flops = causal_flops(md.positions)
        # dense contiguous [1, H, n, D] tensors for SDPA, K/V expanded to H heads (the flash path)
        qd = q.transpose(0, 1).unsqueeze(0)
        kd = dk[0].repeat_interleave(H // HKV, 1).transpose(0, 1).unsqueeze(0).contiguous()
        vd = dv[0].repeat_interleave(H // HKV, 1).transpose(0, 1).unsqueeze(0).contiguous()
        ref = sdpa(qd, kd, vd, SDPBackend.FLASH_ATTENTION, is_causal=True)
        record(case, "torch SDPA flash (dense, is_causal)",
               bench_ms(lambda: sdpa(qd, kd, vd, SDPBackend.FLASH_ATTENTION, is_causal=True)), flops=flops)
        try:
            out = sdpa(qd, kd, vd, SDPBackend.CUDNN_ATTENTION, is_causal=True)
            record(case, "torch SDPA cuDNN (dense, is_causal)",
                   bench_ms(lambda: sdpa(qd, kd, vd, SDPBackend.CUDNN_ATTENTION, is_causal=True)),
                   flops=flops, err=rel_err(out, ref))
        except RuntimeError as e:                                          # backend not available
            print(f"  cuDNN SDPA unavailable: {str(e)[:80]}")
        ref_t = ref[0].transpose(0, 1)                                      # [n, H, D]
        for cfg in configs:
            out = prefill_attention(q, kc, vc, md, SCALE, gather=False, **cfg)
            tag = config_tag(cfg)
            record(case, f"triton paged ({tag})",
                   bench_ms(lambda: prefill_attention(q, kc, vc, md, SCALE, out=out, gather=False, **cfg)),
                   flops=flops, err=rel_err(out, ref_t))
        out = prefill_attention(q, kc, vc, md, SCALE, gather=True)
        record(case, "triton, gathered keys (TMA), incl. the copy",
               bench_ms(lambda: prefill_attention(q, kc, vc, md, SCALE, out=out, gather=True)),
               flops=flops, err=rel_err(out, ref_t))
        del q, kc, vc, md, dk, dv, qd, kd, vd, ref, ref_t
        torch.cuda.empty_cache()


def sparse_cases(sweep: bool) -> None:
    configs = [default_config()]
    if sweep:
        configs += [dict(block_m=128, block_n=64, num_warps=8, num_stages=3),
                    dict(block_m=64, block_n=64, num_warps=4, num_stages=3),
                    dict(block_m=64, block_n=128, num_warps=4, num_stages=2),
                    dict(block_m=128, block_n=128, num_warps=8, num_stages=3),
                    dict(block_m=128, block_n=64, num_warps=4, num_stages=4),
                    dict(block_m=256, block_n=64, num_warps=8, num_stages=2)]
    gen = torch.Generator().manual_seed(0)
    for n in (8192, 32768):
        body = torch.randperm(n - 64, generator=gen)[: int(0.15 * (n - 64))].sort().values
        rows = torch.cat((body, torch.arange(n - 64, n)))                  # 15% of the prompt + 64 tail rows
        case = f"sparse extend {n // 1024}k ({rows.numel()} rows)"
        q, kc, vc, md, dk, dv = paged_batch([n], [rows], contiguous=False)
        flops = causal_flops(md.positions)
        qd = q.transpose(0, 1).unsqueeze(0)                                 # [1, H, R, D]
        kd = dk[0].repeat_interleave(H // HKV, 1).transpose(0, 1).unsqueeze(0).contiguous()
        vd = dv[0].repeat_interleave(H // HKV, 1).transpose(0, 1).unsqueeze(0).contiguous()
        mask = torch.arange(n, device=DEV)[None, :] <= md.positions[:, None]  # [R, n] exact per-row causal
        ref = sdpa(qd, kd, vd, SDPBackend.EFFICIENT_ATTENTION, attn_mask=mask)
        record(case, "torch SDPA mem-efficient + bool mask",
               bench_ms(lambda: sdpa(qd, kd, vd, SDPBackend.EFFICIENT_ATTENTION, attn_mask=mask)), flops=flops)
        if n <= 8192:
            out = TorchAttentionBackend.attention(q, kc, vc, md, SCALE)
            record(case, "TorchAttentionBackend (gather+mask)",
                   bench_ms(lambda: TorchAttentionBackend.attention(q, kc, vc, md, SCALE)),
                   flops=flops, err=rel_err(out, ref[0].transpose(0, 1)))
        ref_t = ref[0].transpose(0, 1)
        for cfg in configs:
            out = prefill_attention(q, kc, vc, md, SCALE, gather=False, **cfg)
            tag = config_tag(cfg)
            record(case, f"triton paged ({tag})",
                   bench_ms(lambda: prefill_attention(q, kc, vc, md, SCALE, out=out, gather=False, **cfg)),
                   flops=flops, err=rel_err(out, ref_t))
        # the engine's choice at this size: a contiguous copy of the keys (made inside the timed call),
        # read through TMA
        out = prefill_attention(q, kc, vc, md, SCALE, gather=True)
        record(case, "triton, gathered keys (TMA), incl. the copy",
               bench_ms(lambda: prefill_attention(q, kc, vc, md, SCALE, out=out, gather=True)),
               flops=flops, err=rel_err(out, ref_t))
        del q, kc, vc, md, dk, dv, qd, kd, vd, mask, ref, ref_t
        torch.cuda.empty_cache()


def decode_cases(sweep: bool) -> None:
    ctx = 2048
    for b in (1, 16, 64):
        case = f"decode batch {b}, ctx {ctx}"
        per_call = 2.0 * b * ctx * HKV * D * 2                               # K + V read once (q, out: noise)
        sets = [paged_batch([ctx] * b, [torch.tensor([ctx - 1])] * b, contiguous=True)
                for _ in range(max(1, math.ceil(256e6 / per_call)))]        # rotate inputs past the L2
        dense = []
        for q, _, _, _, dk, dv in sets:
            dense.append((q.unsqueeze(2),                                   # [b, H, 1, D]
                          torch.stack(dk).transpose(1, 2).contiguous(),     # [b, HKV, ctx, D]
                          torch.stack(dv).transpose(1, 2).contiguous()))
        q, kc, vc, md, _, _ = sets[0]
        qd, kd, vd = dense[0]
        ref = F.scaled_dot_product_attention(qd, kd, vd, scale=SCALE, enable_gqa=True)[:, :, 0]
        record(case, "torch SDPA (dense, enable_gqa)",
               graph_ms([functools.partial(F.scaled_dot_product_attention, qd_, kd_, vd_, scale=SCALE,
                                           enable_gqa=True) for qd_, kd_, vd_ in dense]),
               nbytes=per_call, note=f"{len(sets)} input sets")
        variants = [dict()]
        if sweep:
            variants += {1: [dict(num_splits=8), dict(num_splits=32)],
                         16: [dict(num_splits=1), dict(num_splits=4)],
                         64: [dict(num_splits=2)]}[b]
            variants += [dict(block_n=128, num_stages=2), dict(num_stages=4), dict(num_warps=2)]
        for v in variants:
            out = decode_attention(q, kc, vc, md, SCALE, **v)
            err = rel_err(out, ref)
            outs = [torch.empty_like(s_[0]) for s_ in sets]
            fns = [functools.partial(decode_attention, q_, kc_, vc_, md_, SCALE, out=o_, **v)
                   for (q_, kc_, vc_, md_, _, _), o_ in zip(sets, outs)]
            tag = ",".join(f"{k}={x}" for k, x in v.items()) or "auto splits"
            record(case, f"triton paged decode ({tag})", graph_ms(fns), nbytes=per_call, err=err)
        out = TritonAttentionBackend.attention(q, kc, vc, md, SCALE)        # dispatch picks decode
        assert rel_err(out, ref) < 2e-2
        del sets, dense, q, kc, vc, md, qd, kd, vd, ref
        torch.cuda.empty_cache()


def copy_cases() -> None:
    n, num_sets = 8192, 8                                                   # one 8k-token segment, one layer
    num_blocks = 2 * num_sets * n // BS
    kc = torch.randn(num_blocks, BS, HKV, D, device=DEV, dtype=DT)
    vc = torch.randn_like(kc)
    perm = torch.randperm(num_blocks * BS, device=DEV)
    src = [perm[2 * i * n:(2 * i + 1) * n] for i in range(num_sets)]       # disjoint sets: 8 x 33.5 MB moved
    dst = [perm[(2 * i + 1) * n:(2 * i + 2) * n] for i in range(num_sets)]
    delta = torch.randint(-20000, 20000, (n,), device=DEV)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=DEV).float() / D))
    nbytes = 4.0 * n * HKV * D * 2                                          # K, V read + written
    one_layer = LayerPointers([(kc, vc)])

    def copy_and_rerotate(k_cache, v_cache, *plan):        # the engine's kernel on this one layer
        copy_and_rerotate_layers(one_layer, *plan)
    k2, v2 = kc.clone(), vc.clone()
    copy_and_rerotate(kc, vc, src[0], dst[0], delta, inv_freq)
    copy_and_rerotate_torch(k2, v2, src[0], dst[0], delta, inv_freq)
    err = rel_err(kc.view(-1, HKV, D)[dst[0]], k2.view(-1, HKV, D)[dst[0]])
    del k2, v2
    case = f"re-rotate + copy {n} rows (1 layer)"
    for name, fn in (("torch reference", copy_and_rerotate_torch), ("triton", copy_and_rerotate)):
        fns = [functools.partial(fn, kc, vc, s_, d_, delta, inv_freq) for s_, d_ in zip(src, dst)]
        record(case, name, graph_ms(fns), nbytes=nbytes, err=err if name == "triton" else None)
    keys = [torch.randn(n, HKV, D, device=DEV, dtype=DT) for _ in range(num_sets)]
    vals = [torch.randn_like(k) for k in keys]
    case = f"store_kv {n} tokens (1 layer)"
    for name, fn in (("torch index_copy_", TorchAttentionBackend.store_kv),
                     ("triton", TritonAttentionBackend.store_kv)):
        fns = [functools.partial(fn, k, v, kc, vc, d_) for k, v, d_ in zip(keys, vals, dst)]
        record(case, name, graph_ms(fns), nbytes=nbytes)


def probe_cases() -> None:
    """The selection probe (triton_probe.py) at the 8k / 32k blended steps' sizes, against the torch
    selectors it replaced on the GPU, and RoPE + K/V store in one launch against two."""
    from sparsex.layers.rotary_embedding import RotaryEmbedding
    from sparsex.layers.triton_fused import rope_qk, rope_qk_store
    for n, reused in ((8192, 7168), (32768, 28672)):
        q, k_cache, v_cache, md, _, _ = paged_batch([n], [torch.arange(n - reused - 128, n)], contiguous=True)
        t = q.shape[0]
        k = torch.randn(t, HKV, D, device=DEV, dtype=DT)
        v = torch.randn_like(k)
        rows = torch.arange(reused, device=DEV)                              # the reused rows of the step
        query_rows = torch.arange(t - 128, t, device=DEV)                    # the question's rows
        slots = md.slot_mapping[rows]
        k_flat, v_flat = k_cache.view(-1, HKV, D), v_cache.view(-1, HKV, D)
        ref = selectors.kv_deviation_scores(k[rows], v[rows], k_flat[slots], v_flat[slots])
        out = kv_deviation(k, v, k_cache, v_cache, rows, md.slot_mapping)
        case = f"kv deviation, {reused} reused rows"
        nbytes = 4.0 * reused * HKV * D * 2                                  # fresh K, V + cached K, V read
        record(case, "torch selector", bench_ms(lambda: selectors.kv_deviation_scores(
            k[rows], v[rows], k_flat[slots], v_flat[slots])), nbytes=nbytes)
        record(case, "triton", bench_ms(lambda: kv_deviation(k, v, k_cache, v_cache, rows, md.slot_mapping)),
               nbytes=nbytes, err=rel_err(out, ref))
        keys = k_cache[md.block_tables[0].long()].flatten(0, 1)[:n]
        ref = selectors.query_attention_mass(q[query_rows], keys, md.positions[query_rows], SCALE)
        out = query_key_mass(q, query_rows, md.positions, k_cache, md.block_tables[0], n, SCALE)
        case = f"query mass, 128 rows x {n} keys"
        flops = 2 * 2.0 * 128 * H * D * n                                    # two passes of q.k
        record(case, "torch selector (gathered keys)", bench_ms(lambda: selectors.query_attention_mass(
            q[query_rows], k_cache[md.block_tables[0].long()].flatten(0, 1)[:n], md.positions[query_rows], SCALE)),
            flops=flops)
        record(case, "triton, paged", bench_ms(lambda: query_key_mass(q, query_rows, md.positions, k_cache,
                                                                        md.block_tables[0], n, SCALE)),
               flops=flops, err=rel_err(out, ref))
    rot = RotaryEmbedding(D, 500000.0, None, 32768)
    rot.build(DEV)
    n, num_sets = 8192, 8
    kc = torch.randn(2 * num_sets * n // BS, BS, HKV, D, device=DEV, dtype=DT)
    vc = torch.randn_like(kc)
    perm = torch.randperm(kc.shape[0] * BS, device=DEV)
    qkv = [torch.randn(n, (H + 2 * HKV) * D, device=DEV, dtype=DT) for _ in range(num_sets)]
    views = [(x[:, :H * D].view(n, H, D), x[:, H * D:(H + HKV) * D].view(n, HKV, D), x[:, (H + HKV) * D:].view(n, HKV, D))
             for x in qkv]
    pos = torch.randint(0, 32768, (n,), device=DEV)
    dsts = [perm[i * n:(i + 1) * n] for i in range(num_sets)]

    def two_launches(q_, k_, v_, d_):
        q2, k2 = rope_qk(q_, k_, pos, rot.cos_cache, rot.sin_cache)
        TritonAttentionBackend.store_kv(k2, v_, kc, vc, d_)
    case = f"RoPE q,k + KV store, {n} tokens"
    nbytes = 2.0 * n * (H + 2 * HKV) * D * 2 + 2.0 * n * HKV * D * 2          # q, k, v read; q, k out; k, v to the cache
    record(case, "rope_qk + store_kv (2 launches)",
           graph_ms([functools.partial(two_launches, *qv, d_) for qv, d_ in zip(views, dsts)]), nbytes=nbytes)
    record(case, "rope_qk_store (1 launch)",
           graph_ms([functools.partial(rope_qk_store, *qv, pos, rot.cos_cache, rot.sin_cache, kc, vc, d_)
                     for qv, d_ in zip(views, dsts)]), nbytes=nbytes)


def kernel_report() -> None:
    """Registers, spills and whether the tensor-core path is wgmma (Hopper) for each compiled kernel."""
    for fn in (_prefill_kernel, _decode_kernel):
        try:
            for kern in fn.device_caches[torch.cuda.current_device()][0].values():
                ptx = kern.asm.get("ptx", "")
                print(f"  {fn.__name__}: regs={kern.n_regs} spills={kern.n_spills} "
                      f"warps={kern.metadata.num_warps} shared={kern.metadata.shared} "
                      f"wgmma={'wgmma' in ptx} mma.sync={'mma.sync' in ptx}")
        except Exception as e:                                             # introspection is best effort
            print(f"  {fn.__name__}: no report ({e!r})")


def print_table(tbps: float, tflops: float) -> None:
    print(f"\nGPU: {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}, triton {triton.__version__}")
    print(f"measured ceilings: copy {tbps:.2f} TB/s, bf16 matmul {tflops:.0f} TFLOP/s")
    print(f"shape: {H} heads, {HKV} kv heads, head_dim {D}, bf16, KV block size {BS}\n")
    print("| case | implementation | time (ms) | TFLOP/s | TB/s | % of ceiling | rel err |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in ROWS:
        tf = r["flops"] / r["ms"] / 1e9 if r["flops"] else None
        bw = r["bytes"] / r["ms"] / 1e9 if r["bytes"] else None
        frac = tf / tflops if tf else (bw / tbps if bw else None)
        cells = [r["case"], r["impl"], f"{r['ms']:.3f}", f"{tf:.0f}" if tf else "", f"{bw:.2f}" if bw else "",
                 f"{100 * frac:.0f}%" if frac else "", f"{r['err']:.1e}" if r["err"] is not None else ""]
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument("--out", default=None, help="folder for a JSON copy of the results")
    ap.add_argument("--only", default="prefill,sparse,decode,copy,probe")
    args = ap.parse_args()
    torch.manual_seed(0)
    tbps, tflops = measure_ceilings()
    print(f"ceilings: {tbps:.2f} TB/s copy, {tflops:.0f} TFLOP/s bf16 matmul", flush=True)
    only = args.only.split(",")
    if "prefill" in only:
        prefill_cases(args.sweep)
    if "sparse" in only:
        sparse_cases(args.sweep)
    if "decode" in only:
        decode_cases(args.sweep)
    if "copy" in only:
        copy_cases()
    if "probe" in only:
        probe_cases()
    kernel_report()
    print_table(tbps, tflops)
    if args.out:
        with open(os.path.join(args.out, "gpu_kernels.json"), "w") as f:
            json.dump(dict(ceilings=dict(tbps=tbps, tflops=tflops), rows=ROWS), f, indent=1)


if __name__ == "__main__":
    main()
