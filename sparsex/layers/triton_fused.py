"""Fused elementwise kernels for the GPU path: residual-add + RMSNorm, SiLU·mul, and RoPE on q/k.

In eager torch each of these is 3-9 small kernels (casts to float32, pow/mean/rsqrt, cat of the
rotated halves, ...): ~10 extra kernels a layer, which dominate a decode step's non-GEMM time and
the sparse layers of a blended prefill (few rows, launch-bound). Each function here is one kernel
and reproduces the eager arithmetic (float32 inside, the same roundings to the model dtype), so the
torch code in `layernorm.py` / `models/decoder.py` / `rotary_embedding.py` stays the reference
(`tests/test_triton_kernels.py` compares them). Imported only for CUDA tensors (Triton is a GPU
dependency; CPU installs never import this module).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro,
                     n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        # the sum is rounded to the model dtype first, as `x + residual` is in eager torch
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [rows, hidden]. Without residual: norm(x); with: (norm(x + residual), x + residual)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    block = triton.next_power_of_2(n)
    if rows:
        _rms_norm_kernel[(rows,)](x, res, weight, out, res_out, x.stride(0), res.stride(0), out.stride(0),
                                  res_out.stride(0), n, eps, HAS_RES=residual is not None, BLOCK=block,
                                  num_warps=4 if block <= 2048 else 8)
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    u = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)                          # F.silu rounds to the dtype
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * inter] (gate first) -> silu(gate) * up: [rows, inter]."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                            BLOCK=block, num_warps=4)
    return out


@triton.jit
def _rotate_heads(x_row, out_row, stride_xh, h0, num_heads, c, s, cache_row, stride_ch, cache_ok,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, STORE: tl.constexpr):
    """Heads [h0, h0 + BLOCK_H) of one token: x_row / out_row point at the token's head 0; the
    output is contiguous ([heads, 2 * HALF] per token). STORE: the rotated heads go to the cache
    row `cache_row` (head stride `stride_ch`) as well, where `cache_ok`."""
    h = h0 + tl.arange(0, BLOCK_H)                                       # [BLOCK_H]
    d = tl.arange(0, HALF)                                               # [HALF]
    ok = (h < num_heads)[:, None]
    base = x_row + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    r1, r2 = (x1f * c - x2f * s).to(x1.dtype), (x2f * c + x1f * s).to(x1.dtype)
    obase = out_row + h[:, None] * (2 * HALF) + d[None, :]
    tl.store(obase, r1, mask=ok)
    tl.store(obase + HALF, r2, mask=ok)
    if STORE:
        cbase = cache_row + h[:, None] * stride_ch + d[None, :]
        tl.store(cbase, r1.to(cache_row.dtype.element_ty), mask=ok & cache_ok)
        tl.store(cbase + HALF, r2.to(cache_row.dtype.element_ty), mask=ok & cache_ok)


@triton.jit
def _rope_qk_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
                    stride_ks, stride_kch, stride_vs, stride_vch, num_q_heads, num_k_heads,
                    HALF: tl.constexpr, BLOCK_H: tl.constexpr, STORE: tl.constexpr):
    """Program (t, j): token t, head block j; the first cdiv(num_q_heads, BLOCK_H) blocks are q's,
    then k's (one launch for both: the launch, not the work, is what a small layer pays for).
    STORE (the K/V store fused in): k's blocks write the rotated k to the cache at slot_mapping[t]
    too, and as many blocks again copy v's heads into the cache; a negative slot stores nothing."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    num_k_blocks = tl.cdiv(num_k_heads, BLOCK_H)
    slot = 0
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    if j < num_q_blocks + num_k_blocks:
        p = tl.load(pos_ptr + t).to(tl.int64)
        d = tl.arange(0, HALF)
        c = tl.load(cos_ptr + p * stride_c + d)[None, :]                 # [1, HALF] float32
        s = tl.load(sin_ptr + p * stride_c + d)[None, :]
        if j < num_q_blocks:
            _rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * (num_q_heads * 2 * HALF), stride_qh,
                          j * BLOCK_H, num_q_heads, c, s, kc_ptr, 0, False, HALF, BLOCK_H, False)
        else:
            _rotate_heads(k_ptr + t * stride_kt, ko_ptr + t * (num_k_heads * 2 * HALF), stride_kh,
                          (j - num_q_blocks) * BLOCK_H, num_k_heads, c, s, kc_ptr + slot * stride_ks, stride_kch,
                          slot >= 0, HALF, BLOCK_H, STORE)
    elif STORE:
        h = (j - num_q_blocks - num_k_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = (h < num_k_heads)[:, None] & (slot >= 0)
        dd = tl.arange(0, 2 * HALF)
        x = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dd[None, :], mask=ok)
        tl.store(vc_ptr + slot * stride_vs + h[:, None] * stride_vch + dd[None, :], x.to(vc_ptr.dtype.element_ty), mask=ok)


def _rope(q, k, positions, cos_cache, sin_cache, store: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_qk` / `rope_qk_store`; store: (v, k_cache, v_cache, slot_mapping) or None."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if k.shape[0] != tokens or k.shape[2] != head_dim or (store is not None and store[0].shape != k.shape):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}"
                         + (f" and v {tuple(store[0].shape)}" if store is not None else "") + " disagree")
    q_out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, kv_heads, head_dim), dtype=k.dtype, device=k.device)
    if store is None:
        v, k_cache, v_cache, slots = k, k, k, positions                  # never read (STORE=False)
        cache_strides = (0, 0, 0, 0)
    else:
        v, k_cache, v_cache, slots = store
        for c in (k_cache, v_cache):
            if c.stride(0) != c.shape[1] * c.stride(1) or c.stride(-1) != 1 or c.shape[2:] != k.shape[1:]:
                raise ValueError(f"cache {tuple(c.shape)} / strides {c.stride()} are not "
                                 "[blocks, block_size, kv_heads, head_dim] by slot")
        cache_strides = (k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2))
    block_h = min(16, triton.next_power_of_2(max(heads, kv_heads)))
    kv_blocks = triton.cdiv(kv_heads, block_h)
    if tokens:
        _rope_qk_kernel[(tokens, triton.cdiv(heads, block_h) + kv_blocks * (1 if store is None else 2))](
            q, k, v, q_out, k_out, k_cache, v_cache, positions, slots, cos_cache, sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_cache.stride(0),
            *cache_strides, heads, kv_heads, HALF=head_dim // 2, BLOCK_H=block_h, STORE=store is not None,
            num_warps=4)
    return q_out, k_out


def rope_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
            sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim] (any strides, last dim
    contiguous), rotate_half layout with the full head_dim rotated; cos/sin_cache:
    [max_position, head_dim/2] float32 -> new contiguous q and k, from one kernel launch."""
    return _rope(q, k, positions, cos_cache, sin_cache, None)


def rope_qk_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  cos_cache: torch.Tensor, sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_qk`, and the rotated k and v stored into the paged caches ([num_blocks, block_size,
    kv_heads, head_dim]) at `slot_mapping` ([tokens] int64, negative: skipped), in one launch: a
    layer's RoPE and K/V store were two launches of ~40 us of host time each, 32 layers a step."""
    return _rope(q, k, positions, cos_cache, sin_cache, (v, k_cache, v_cache, slot_mapping))
