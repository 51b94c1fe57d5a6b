"""Attention over the paged KV cache in Triton: one varlen prefill/extend kernel and a split-K decode.

Same contract as `TorchAttentionBackend` (attention_backend.py), which is the reference:
caches are per layer `[num_blocks, block_size, num_kv_heads, head_dim]`, laid out by position, and
every query row attends to keys `0..positions[row]` of its sequence. No mask tensor exists: the mask
is `key <= position`, evaluated per row inside the kernel, so plain prefill, chunked prefill, prefix
hits and SparseX's sparse rows (rows scattered through a prompt) are one code path.
A sliding window W (Mistral, Gemma's local layers) keeps keys `position - W + 1 ..` only, and a
logit softcap C (Gemma 2) maps the scaled scores s to C * tanh(s / C) before the mask and softmax.
Both are constexprs of the kernels (WINDOW, SOFTCAP: one compilation per value, nothing read at a
CUDA-graph replay); without them the kernels compile to exactly what they were before these existed.

Layout of the work (why it looks like this):
- GQA is packed into the M side of each tile: a program owns one KV head and `ROWS` query rows ×
  `G` query heads of that KV head (`M = ROWS * G` lines, line m = row m // G, head m % G). Each K/V
  block is then loaded once for all G heads, and a sequence with few rows (a decode row mixed into a
  prefill batch, the 64 tail rows of a sparse step) still fills the tensor-core tile.
- The key loop of a tile stops at the tile's largest position; key blocks at or below its smallest
  position need no mask, so a dense causal tile pays for the mask on ~1-2 blocks only.
- Tiles are found without host data: tile t of sequence s is program `cu_q[s] // ROWS + s + t`
  (a binary search over cu_seqlens_q inside the kernel), and the grid is an upper bound built
  from host ints. Programs run last-tile-first, so the longest causal tiles start earliest.
- Keys come through the block table (16-token pages gathered by pointer), or, when a step's rows
  are many per key (SparseX's sparse layers, long extends: `gather_pays`), from a contiguous copy of
  each sequence's keys made once a layer, read through TMA descriptors on Hopper: the paged loads
  were about a quarter of the sparse-row kernel's time, the copy costs ~1/10 of that saving.
- Decode (every sequence has exactly one row) splits each sequence's keys across programs
  (split-K) so a few long sequences still fill the GPU, then a small kernel merges the splits by
  their log-sum-exp.
- With a window the key loops start at the first key any line of the tile sees (not at key 0 or a
  block boundary), so a sliding layer reads O(window) keys per row at any context length and never
  a key before the window; a decode's splits share the window's keys. Torch's causal SDPA (the
  plain-prefill shortcut) neither slides nor caps: it serves such layers only when the window hides
  no key and nothing is capped.
Softmax is online, in base 2 (the scale is folded with log2 e), accumulated in fp32.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sparsex.layers.attention_metadata import AttentionMetadata

_LOG2E = 1.4426950408889634


@triton.jit
def _tanh(x):
    """tanh in fp32 to ~1e-7 relative (tl has no tanh, and libdevice's does not run in the interpreter):
    an odd Taylor polynomial where |x| < 0.4, where 1 - 2 / (e^2x + 1) would cancel; that form elsewhere
    (it saturates to +-1 for large |x|: never NaN)."""
    x2 = x * x
    p = x + x * x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
        -0.05396825396825397 + x2 * (0.021869488536155203 + x2 * -0.008863235529902197))))
    e = 1.0 - 2.0 / (tl.exp2(x * 2.885390081777927) + 1.0)             # exp(2x) = exp2(2x log2 e)
    return tl.where(tl.abs(x) < 0.4, p, e)


@triton.jit
def _key_block(
    start, acc, m_i, l_i, q, pos_m, k_base, v_base, bt_row, k_desc, v_desc, kv_col, hi,
    stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, KV_MODE: tl.constexpr, PREC: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One key block [start, start + BLOCK_N) of the online softmax. KV_MODE: 0 paged (slots through
    the block table), 1 gathered (row `start + i` of a contiguous copy: k_base already points at the
    sequence's row 0 and this KV head), 2 gathered through TMA descriptors (rows `start + i`, columns
    `kv_col`..+HEAD_DIM of the copy viewed as [rows, num_kv_heads * head_dim]).
    WINDOW > 0: in a masked block line m sees only keys n > pos_m - WINDOW. SOFTCAP > 0: scores
    s = q.k * scale become SOFTCAP * tanh(s / SOFTCAP), qk_scale being scale / SOFTCAP."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    n = start + offs_n                                                   # [BLOCK_N] key positions
    n_ok = n < hi
    if KV_MODE == 2:
        k = k_desc.load([start, kv_col])                                 # [BLOCK_N, D]
        v = v_desc.load([start, kv_col])
    else:
        if KV_MODE == 0:
            # key position -> cache slot through the block table (blocks need not be contiguous)
            if MASKED:
                page = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
            else:
                page = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
            in_block = n % BLOCK_SIZE
            k_ptrs = k_base + page[:, None] * stride_kb + in_block[:, None] * stride_ks + offs_d[None, :]
            v_ptrs = v_base + page[:, None] * stride_vb + in_block[:, None] * stride_vs + offs_d[None, :]
        else:
            k_ptrs = k_base + n[:, None].to(tl.int64) * stride_ks + offs_d[None, :]
            v_ptrs = v_base + n[:, None].to(tl.int64) * stride_vs + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)           # [BLOCK_N, D]
            v = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
    if SOFTCAP > 0:
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale   # s / SOFTCAP
        qk = _tanh(qk) * (SOFTCAP * 1.4426950408889634)                  # capped, in base-2 units
    else:
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * qk_scale   # [M, BLOCK_N]
    if MASKED:
        visible = (n[None, :] <= pos_m[:, None]) & n_ok[None, :]
        if WINDOW > 0:
            visible = visible & (n[None, :] > pos_m[:, None] - WINDOW)
        qk = tl.where(visible, qk, float("-inf"))
    # Without a window every line sees key 0 in the first block it processes (positions >= 0), so
    # m_new is finite from the first iteration on and no exp2(-inf - -inf) NaN can appear.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if WINDOW > 0:
        if MASKED:
            # with one, a line may see no key of this block and none before it (its window starts
            # later than the tile's first): m_new = -inf, and the exponents use 0 instead (p = alpha = 0)
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(qk - m_ref[:, None])
        else:
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
    return acc, m_new, l_i


@triton.jit
def _attend_keys(
    acc, m_i, l_i,                 # running state: [M, D] fp32, [M] fp32, [M] fp32
    q,                             # [M, D] query lines, input dtype
    pos_m,                         # [M] int32, absolute position of each line
    k_base, v_base,                # cache (or gathered copy) pointers, already offset to this KV head
    bt_row,                        # pointer to this sequence's block-table row (KV_MODE 0)
    k_desc, v_desc, kv_col,        # TMA descriptors and this KV head's first column (KV_MODE 2)
    lo, hi,                        # key range [lo, hi) (rows of the copy in KV_MODE 2); lo a multiple of BLOCK_N in
                                   # modes 0/1 without a window (with one it starts at the window's first key)
    stride_kb, stride_ks, stride_vb, stride_vs,
    qk_scale,                      # softmax scale * log2(e); with SOFTCAP, scale / SOFTCAP
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr, KV_MODE: tl.constexpr, PREC: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    if KV_MODE == 2 and not MASKED:
        # Hopper: TMA loads leave the warps free, and warp specialisation overlaps them with the MMAs
        for start in tl.range(lo, hi, BLOCK_N, warp_specialize=True):
            acc, m_i, l_i = _key_block(start, acc, m_i, l_i, q, pos_m, k_base, v_base, bt_row, k_desc, v_desc,
                                       kv_col, hi, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                       BLOCK_SIZE, BLOCK_N, HEAD_DIM, MASKED, KV_MODE, PREC, WINDOW, SOFTCAP)
    else:
        for start in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _key_block(start, acc, m_i, l_i, q, pos_m, k_base, v_base, bt_row, k_desc, v_desc,
                                       kv_col, hi, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                       BLOCK_SIZE, BLOCK_N, HEAD_DIM, MASKED, KV_MODE, PREC, WINDOW, SOFTCAP)
    return acc, m_i, l_i


# the block-table width (stride_bt) and rows_per_seq follow the request's length: not specialised on,
# so one compilation serves every length and the start-up warm-up covers it (sparsex/engine/warmup.py)
@triton.jit(do_not_specialize=["stride_bt", "rows_per_seq"])
def _prefill_kernel(
    q_ptr, k_cache, v_cache, out_ptr,
    positions, cu_seqlens_q, seq_lens, block_tables,
    num_seqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt,
    k_desc, v_desc,                # KV_MODE 2: TMA descriptors over the gathered copy
    rows_per_seq,                  # KV_MODE 1/2: rows of the gathered copy per sequence
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, KV_MODE: tl.constexpr,
    WINDOW: tl.constexpr = 0,      # > 0: a sliding window of that many keys (the row's own included)
    SOFTCAP: tl.constexpr = 0.0,   # > 0: scores softcapped to SOFTCAP * tanh(s / SOFTCAP); qk_scale = scale / SOFTCAP
):
    ROWS: tl.constexpr = BLOCK_M // G            # query rows per tile
    kvh = tl.program_id(0)
    pid = tl.num_programs(1) - 1 - tl.program_id(1)      # last tiles (most keys) first

    # sequence of this program: the largest s with cu_q[s] // ROWS + s <= pid (strictly increasing in s)
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tl.load(cu_seqlens_q + mid) // ROWS + mid <= pid:
            lo = mid
        else:
            hi = mid - 1
    s = lo
    q_start = tl.load(cu_seqlens_q + s)
    q_end = tl.load(cu_seqlens_q + s + 1)
    row0 = q_start + (pid - (q_start // ROWS + s)) * ROWS
    if row0 >= q_end:                             # spare program of the upper-bound grid
        return

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (row0 + offs_m // G).to(tl.int64)                              # [M] query row of each line
    head = kvh * G + offs_m % G                                          # [M] query head of each line
    line_ok = (offs_m < ROWS * G) & (row < q_end)
    # padding lines get position 0: they see key 0, stay finite, and are never stored
    pos_m = tl.load(positions + row, mask=line_ok, other=0).to(tl.int32)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=line_ok[:, None], other=0.0)                         # [M, D]

    seq_len = tl.load(seq_lens + s)
    kv_end = tl.minimum(tl.max(tl.where(line_ok, pos_m, 0)) + 1, seq_len)
    # keys <= the smallest position are visible to every line: no mask up to that block boundary
    min_pos = tl.min(tl.where(line_ok, pos_m, 2147483647))
    full_end = tl.minimum((min_pos + 1) // BLOCK_N * BLOCK_N, kv_end // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    bt_row = block_tables + s * stride_bt
    key_row0 = s.to(tl.int64) * rows_per_seq           # the sequence's key 0 in a gathered copy
    if KV_MODE == 0:
        k_base = k_cache + kvh * stride_kh
        v_base = v_cache + kvh * stride_vh
    else:
        k_base = k_cache + key_row0 * stride_ks + kvh * stride_kh
        v_base = v_cache + key_row0 * stride_vs + kvh * stride_vh
    # KV_MODE 2 addresses rows of the whole copy: the range is shifted by the sequence's first row
    # (a multiple of BLOCK_N is not needed: TMA takes any row offset)
    if KV_MODE == 2:
        shift = key_row0.to(tl.int32)
    else:
        shift = 0
    if WINDOW > 0:
        # line m sees keys (pos_m - WINDOW, pos_m]. The key blocks start at the first key any line
        # sees, key_lo (TMA and the paged loads take any start): keys before it are never read, so a
        # sliding layer costs O(window) per row at any context length. Keys [full_lo, full_end), at or
        # after the largest position's window start and at or below the smallest position, are visible
        # to every line: unmasked; the blocks before and after them are masked.
        max_pos = tl.max(tl.where(line_ok, pos_m, 0))
        pos_m = tl.where(line_ok, pos_m, max_pos)       # padding lines: a real row's keys, never 0/0
        key_lo = tl.maximum(min_pos - WINDOW + 1, 0)
        full_lo = tl.minimum(key_lo + tl.cdiv(tl.maximum(max_pos - WINDOW + 1 - key_lo, 0), BLOCK_N) * BLOCK_N,
                             kv_end)
        full_end = full_lo + tl.maximum(tl.minimum(min_pos + 1, kv_end) - full_lo, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, pos_m + shift, k_base, v_base, bt_row, k_desc, v_desc,
                                     kvh * HEAD_DIM, shift + key_lo, shift + full_lo,
                                     stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, KV_MODE, PREC, WINDOW, SOFTCAP)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, pos_m + shift, k_base, v_base, bt_row, k_desc, v_desc,
                                     kvh * HEAD_DIM, shift + full_lo, shift + full_end,
                                     stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, KV_MODE, PREC, WINDOW, SOFTCAP)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, pos_m + shift, k_base, v_base, bt_row, k_desc, v_desc,
                                     kvh * HEAD_DIM, shift + full_end, shift + kv_end,
                                     stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, KV_MODE, PREC, WINDOW, SOFTCAP)
    else:
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, pos_m + shift, k_base, v_base, bt_row, k_desc, v_desc,
                                     kvh * HEAD_DIM, shift, shift + full_end,
                                     stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, KV_MODE, PREC, WINDOW, SOFTCAP)
        acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, pos_m + shift, k_base, v_base, bt_row, k_desc, v_desc,
                                     kvh * HEAD_DIM, shift + full_end, shift + kv_end,
                                     stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                     BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, KV_MODE, PREC, WINDOW, SOFTCAP)
    out = acc / l_i[:, None]
    tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=line_ok[:, None])


@triton.jit
def _decode_kernel(
    q_ptr, k_cache, v_cache, out_ptr, part_o, part_lse,
    positions, seq_lens, block_tables, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_bt, num_heads, num_splits,
    G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr,
    WINDOW: tl.constexpr = 0,      # as in _prefill_kernel
    SOFTCAP: tl.constexpr = 0.0,
):
    s = tl.program_id(0)                          # sequence == its single query row
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < G
    head = kvh * G + offs_g                                              # [BLOCK_G]
    q = tl.load(q_ptr + s.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None], other=0.0)                            # [BLOCK_G, D]
    pos = tl.load(positions + s).to(tl.int32)
    kv_len = tl.minimum(pos + 1, tl.load(seq_lens + s))
    if WINDOW > 0:
        # the splits share the window's keys [key_lo, kv_len) in equal chunks from key_lo on (the paged
        # loads take any start): no program reads a key before the window, every key a program reads
        # is in it (only the causal mask of the last partial block remains), and split 0, holding
        # key_lo, is never empty; splits past the window's keys are, and weigh nothing in the merge
        key_lo = tl.maximum(pos - WINDOW + 1, 0)
        chunk = tl.cdiv(tl.cdiv(kv_len - key_lo, num_splits), BLOCK_N) * BLOCK_N
        lo = key_lo + split * chunk
    else:
        # this split's key range: equal chunks, rounded up to whole key blocks
        chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_len)
    full_end = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    pos_m = tl.full([BLOCK_G], 0, tl.int32) + pos

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    k_base = k_cache + kvh * stride_kh
    v_base = v_cache + kvh * stride_vh
    bt_row = block_tables + s * stride_bt
    # WINDOW 0 below: the range already lies inside the window
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, pos_m, k_base, v_base, bt_row, k_cache, v_cache, 0,
                                 lo, full_end, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                 BLOCK_SIZE, BLOCK_N, HEAD_DIM, False, 0, PREC, 0, SOFTCAP)
    acc, m_i, l_i = _attend_keys(acc, m_i, l_i, q, pos_m, k_base, v_base, bt_row, k_cache, v_cache, 0,
                                 full_end, hi, stride_kb, stride_ks, stride_vb, stride_vs, qk_scale,
                                 BLOCK_SIZE, BLOCK_N, HEAD_DIM, True, 0, PREC, 0, SOFTCAP)
    if not SPLIT:
        tl.store(out_ptr + s.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    else:
        # an empty split (short sequence) leaves l = 0, m = -inf: lse = -inf, weight 0 in the merge
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))  # base-2 log-sum-exp
        idx = (s * num_heads + head) * num_splits + split                # [BLOCK_G]
        tl.store(part_lse + idx, lse, mask=g_ok)
        tl.store(part_o + idx[:, None] * HEAD_DIM + offs_d[None, :], acc / l_safe[:, None],
                 mask=g_ok[:, None])


@triton.jit
def _decode_merge_kernel(
    part_o, part_lse, out_ptr, stride_ot, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    base = (s * num_heads + h) * num_splits
    lse = tl.load(part_lse + base + offs_s, mask=offs_s < num_splits, other=float("-inf"))  # [S]
    w = tl.exp2(lse - tl.max(lse, 0))                                    # split 0 is never empty
    o = tl.load(part_o + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=(offs_s < num_splits)[:, None], other=0.0)          # [S, D]
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(out_ptr + s.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


@triton.jit
def _store_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckb, stride_cks, stride_ckh, stride_cvb, stride_cvs, stride_cvh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t)
    if slot < 0:                                  # padding token: nothing to store
        return
    page = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = (offs_h < NUM_KV_HEADS)[:, None]
    t64 = t.to(tl.int64)
    k = tl.load(key + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=ok)
    v = tl.load(value + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=ok)
    k_dst = k_cache + page * stride_ckb + in_block * stride_cks + offs_h[:, None] * stride_ckh + offs_d[None, :]
    v_dst = v_cache + page * stride_cvb + in_block * stride_cvs + offs_h[:, None] * stride_cvh + offs_d[None, :]
    tl.store(k_dst, k.to(k_cache.dtype.element_ty), mask=ok)
    tl.store(v_dst, v.to(v_cache.dtype.element_ty), mask=ok)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":                     # Triton's CPU interpreter (TRITON_INTERPRET=1)
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dot_precision() -> str:
    """How fp32 attention dots run (bf16/fp16 ignore it): as torch runs fp32 matmuls. Under torch's
    default (`torch.get_float32_matmul_precision() == "highest"`) in full fp32, so an fp32 engine gives
    transformers' logprobs and greedy tokens on the GPU; "high"/"medium" allow tf32 tensor-core dots
    (rel. error ~3e-4, enough to flip a near-tie MoE route or a greedy token on large logits)."""
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def _prefill_config(head_dim: int, dtype: torch.dtype, group: int, gathered: bool = False) -> dict:
    if dtype == torch.float32 or head_dim > 128:
        cfg = dict(block_m=64, block_n=32, num_warps=4, num_stages=2)   # fp32 tiles are twice the bytes
    elif head_dim <= 64:
        cfg = dict(block_m=128, block_n=64, num_warps=4, num_stages=3)
    else:
        # best (or within 3%) of 9 configs swept on the H200 at 2k-32k, bf16 (benchmarks/gpu_kernels.py
        # --sweep); from a gathered copy a third stage pays (0.254 -> 0.200 ms at 8k sparse rows), from
        # the paged cache it did not (0.287 -> 0.290)
        cfg = dict(block_m=128, block_n=128, num_warps=8, num_stages=3 if gathered else 2)
    cfg["block_m"] = max(cfg["block_m"], triton.next_power_of_2(group))  # at least one row per tile
    return cfg


def _check_shapes(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    _, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert head_dim & (head_dim - 1) == 0 and head_dim >= 16, "head_dim must be a power of two >= 16"
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    return num_heads, num_kv_heads, head_dim


# The paged loads (a block-table lookup and a gather per 16-key block) cost about a quarter of the
# sparse-row kernel's time: measured on the H200 (Llama-3-8B attention shape, bf16, 15% of the rows),
# the same kernel reading a contiguous copy of the keys through TMA took 0.200 ms instead of 0.292 at
# 8k keys and 2.62 ms instead of 3.54 at 32k, and making the copy 0.034 / 0.085 ms a layer. The copy
# is paid per key and the gain per (row, key), so it pays from ~470 query rows at both lengths.
GATHER_MIN_ROWS = 512


def gather_pays(md: AttentionMetadata, num_rows: int, block_size: int, window: int | None = None) -> bool:
    """Host ints only: do the step's rows attend to enough keys for a contiguous copy of every
    sequence's keys (`num_seqs x max_blocks` blocks) to cost less than it saves? The gain grows with
    (rows x keys) of each sequence, the copy's cost with the keys copied. With a sliding window a row
    reads at most `window` keys (the copy still holds them all)."""
    if num_rows < GATHER_MIN_ROWS:
        return False
    copied = md.num_seqs * md.block_tables.shape[1] * block_size
    cu = md.cu_seqlens_q_cpu
    seen = (lambda n: n) if window is None else (lambda n: min(n, window))
    pairs = sum((cu[s + 1] - cu[s]) * seen(n) for s, n in enumerate(md.seq_lens_cpu))
    return pairs >= GATHER_MIN_ROWS * copied


@functools.cache
def _tma_ok(device: torch.device) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


class _GatherPlan:
    """The Triton backend's per-step precomputation (AttentionMetadata.backend_plan) for reading a
    contiguous copy of the keys: which blocks make it up, and one K and one V buffer (with their TMA
    descriptors) that every layer of the step gathers into, so the descriptors are made once a step
    and not twice a layer. Reusing the buffers is safe: layer l + 1's gather is queued on the stream
    after layer l's attention has read them. Transient memory: 2 x keys x KV heads x head_dim
    elements for the step (Llama-3-8B, bf16: 4 KiB a key, 128 MiB at 32k keys)."""

    def __init__(self, md: AttentionMetadata, k_cache: torch.Tensor, block_n: int, tma: bool):
        self.blocks = md.block_tables.reshape(-1).long()                  # [num_seqs * max_blocks]
        self.rows_per_seq = md.block_tables.shape[1] * k_cache.shape[1]     # sequence s starts at row s * this
        shape = (self.blocks.numel(), *k_cache.shape[1:])                  # [blocks, block_size, KVH, D]
        self.key = (k_cache.shape[1:], k_cache.dtype, block_n, tma)
        self.k = torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device)
        self.v = torch.empty_like(self.k)
        self.k_desc = self.v_desc = None
        if tma:
            from triton.tools.tensor_descriptor import TensorDescriptor
            rows, d = shape[0] * shape[1], shape[3]
            self.k_desc = TensorDescriptor.from_tensor(self.k.view(rows, -1), [block_n, d])
            self.v_desc = TensorDescriptor.from_tensor(self.v.view(rows, -1), [block_n, d])

    def gather(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values, contiguous: [num_seqs * max_blocks * block_size, KVH, D] each;
        sequence s's key at position p is row s * max_blocks * block_size + p (padding entries of the
        block table point at block 0: copied, never read)."""
        torch.index_select(k_cache, 0, self.blocks, out=self.k)
        torch.index_select(v_cache, 0, self.blocks, out=self.v)
        kvh, d = k_cache.shape[2], k_cache.shape[3]
        return self.k.view(-1, kvh, d), self.v.view(-1, kvh, d)


def _gather_plan(md: AttentionMetadata, k_cache: torch.Tensor, block_n: int) -> _GatherPlan:
    tma = _tma_ok(k_cache.device)
    plan = md.backend_plan
    if not isinstance(plan, _GatherPlan) or plan.key != (k_cache.shape[1:], k_cache.dtype, block_n, tma):
        plan = md.backend_plan = _GatherPlan(md, k_cache, block_n, tma)
    return plan


def check_window_and_cap(sliding_window, logits_soft_cap) -> tuple[int | None, float | None]:
    """The two attention options, validated as TorchAttentionBackend does (ValueError): a window of
    at least one key, a positive finite cap; returned as (int, float) or None."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if logits_soft_cap is not None and not 0 < logits_soft_cap < math.inf:     # NaN fails too
        raise ValueError(f"logits_soft_cap must be a positive finite float or None, got {logits_soft_cap!r}")
    return (None if sliding_window is None else int(sliding_window),
            None if logits_soft_cap is None else float(logits_soft_cap))


def _variant(scale: float, sliding_window: int | None, logits_soft_cap: float | None) -> tuple[float, dict]:
    """(qk_scale, constexprs) of a kernel launch: the scale in base-2 units (scale / cap when
    softcapped: the kernel takes tanh of that and multiplies by cap * log2 e), and the WINDOW /
    SOFTCAP constexprs, left out without them so the plain launch is exactly the one before they
    existed (same specialisation, same compiled kernel)."""
    consts = {}
    if sliding_window is not None:
        consts["WINDOW"] = sliding_window
    if logits_soft_cap is not None:
        consts["SOFTCAP"] = logits_soft_cap
        return scale / logits_soft_cap, consts
    return scale * _LOG2E, consts


def prefill_attention(
    query: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,          # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    gather: bool | None = None,     # read a contiguous copy of the keys; None: when it pays (gather_pays)
    *,
    sliding_window: int | None = None,   # a row at position i sees keys i - sliding_window + 1 .. i
    logits_soft_cap: float | None = None,   # scaled scores s -> logits_soft_cap * tanh(s / logits_soft_cap)
    **config,                       # block_m, block_n, num_warps, num_stages (benchmark sweeps)
) -> torch.Tensor:                  # [num_tokens, num_heads, head_dim]
    sliding_window, logits_soft_cap = check_window_and_cap(sliding_window, logits_soft_cap)
    num_heads, num_kv_heads, head_dim = _check_shapes(query, k_cache, v_cache)
    group = num_heads // num_kv_heads
    out = torch.empty_like(query) if out is None else out
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return out
    if gather is None:
        gather = query.is_cuda and gather_pays(md, num_tokens, k_cache.shape[1], sliding_window)
    cfg = _prefill_config(head_dim, query.dtype, group, gather) | config
    rows = cfg["block_m"] // group
    # upper bound on tiles from host ints only: sum_s cdiv(q_len_s, rows) <= num_tokens // rows + num_seqs
    grid = (num_kv_heads, num_tokens // rows + md.num_seqs)
    kv_mode, k_src, v_src, k_desc, v_desc, rows_per_seq = 0, k_cache, v_cache, k_cache, v_cache, 0
    k_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))   # (block, slot, head)
    v_strides = (v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    if gather:
        plan = _gather_plan(md, k_cache, cfg["block_n"])
        k_src, v_src = plan.gather(k_cache, v_cache)                       # [rows, KVH, D]
        rows_per_seq = plan.rows_per_seq
        k_strides = (0, k_src.stride(0), k_src.stride(1))                 # (unused, row, head)
        v_strides = (0, v_src.stride(0), v_src.stride(1))
        kv_mode = 1
        if plan.k_desc is not None:
            k_desc, v_desc, kv_mode = plan.k_desc, plan.v_desc, 2
    qk_scale, variant = _variant(scale, sliding_window, logits_soft_cap)
    _prefill_kernel[grid](
        query, k_src, v_src, out,
        md.positions, md.cu_seqlens_q, md.seq_lens, md.block_tables,
        md.num_seqs, qk_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *k_strides, *v_strides,
        md.block_tables.stride(0),
        k_desc, v_desc, rows_per_seq,
        G=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], PREC=_dot_precision(), KV_MODE=kv_mode, **variant,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, num_sms: int) -> int:
    """Split-K only when (sequence, KV head) programs fill less than one wave of SMs: then aim at
    ~2 programs per SM, each with at least two key blocks. A full wave gains nothing from the merge."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:
        return 1
    want = triton.cdiv(2 * num_sms, programs)
    return max(1, min(want, triton.cdiv(max_seq_len, 2 * block_n), 64))


def window_num_splits(num_splits: int, sliding_window: int | None, block_n: int = 64) -> int:
    """A split count for a sliding-window layer: a row reads at most `sliding_window` keys, so more
    splits than decode_num_splits gives for that length (two key blocks each at least) only add
    empty programs (correct, but work for the merge). Host ints only."""
    if sliding_window is None:
        return num_splits
    return max(1, min(num_splits, triton.cdiv(sliding_window, 2 * block_n)))


def decode_attention(
    query: torch.Tensor,            # [num_seqs, num_heads, head_dim], one row per sequence
    k_cache: torch.Tensor,          # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    *,
    sliding_window: int | None = None,   # as prefill_attention
    logits_soft_cap: float | None = None,
) -> torch.Tensor:                  # [num_seqs, num_heads, head_dim]
    """One query row per sequence. `num_splits` programs share each (sequence, KV head)'s keys (with
    a sliding window: the window's keys); None picks them from the step (decode_num_splits, then
    window_num_splits). A given count is used as is: splits past a short sequence's (or window's)
    keys are empty and weigh nothing in the merge."""
    sliding_window, logits_soft_cap = check_window_and_cap(sliding_window, logits_soft_cap)
    num_heads, num_kv_heads, head_dim = _check_shapes(query, k_cache, v_cache)
    group = num_heads // num_kv_heads
    num_seqs = query.shape[0]
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = window_num_splits(
            decode_num_splits(num_seqs, num_kv_heads, md.max_seq_len, block_n, _num_sms(query.device)),
            sliding_window, block_n)
    if num_splits > 1:
        part_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_o = part_lse = out                     # unused: the kernel writes `out` directly
    qk_scale, variant = _variant(scale, sliding_window, logits_soft_cap)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, out, part_o, part_lse,
        md.positions, md.seq_lens, md.block_tables, qk_scale,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        md.block_tables.stride(0), num_heads, num_splits,
        G=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, SPLIT=num_splits > 1,
        PREC=_dot_precision(), **variant, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out


class TritonAttentionBackend:
    """GPU backend: Triton kernels over the paged cache. An `AttentionBackend`
    (attention_backend_protocol.py), used as the class, as TorchAttentionBackend is."""

    name = "triton"

    @staticmethod
    def store_kv(
        key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64; a negative slot is skipped
    ) -> None:
        num_tokens, num_kv_heads, head_dim = key.shape
        if num_tokens == 0:
            return
        assert head_dim & (head_dim - 1) == 0, "head_dim must be a power of two"
        assert key.stride(-1) == 1 and value.stride(-1) == 1
        _store_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_SIZE=k_cache.shape[1],
            num_warps=4,
        )

    @staticmethod
    def attention(
        query: torch.Tensor,        # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,     # this step's K/V ([num_tokens, num_kv_heads, head_dim])
        value: torch.Tensor | None = None,
        *,
        sliding_window: int | None = None,   # as TorchAttentionBackend.attention: a row at position i
        logits_soft_cap: float | None = None,   # sees keys i - sliding_window + 1 .. i; scores s -> cap * tanh(s / cap)
    ) -> torch.Tensor:              # [num_tokens, num_heads, head_dim]
        sliding_window, logits_soft_cap = check_window_and_cap(sliding_window, logits_soft_cap)
        # host ints only: no device->host sync on this path
        if query.shape[0] == md.num_seqs and md.max_seqlen_q == 1:
            return decode_attention(query, k_cache, v_cache, md, scale, sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap)
        # causal SDPA neither caps scores nor slides: only where there is no cap and the window hides
        # no key (every sequence fits in it)
        if (key is not None and query.dtype in (torch.float16, torch.bfloat16) and logits_soft_cap is None
                and (sliding_window is None or max(md.seq_lens_cpu) <= sliding_window)):
            prefix_lens = _short_prefix_lens(md)
            if prefix_lens is not None:
                return _causal_sdpa(query, key, value, k_cache, v_cache, md, scale, prefix_lens)
        return prefill_attention(query, k_cache, v_cache, md, scale, sliding_window=sliding_window,
                                 logits_soft_cap=logits_soft_cap)


def _short_prefix_lens(md: AttentionMetadata) -> list[int] | None:
    """Per sequence, the cached keys before this step's rows, when torch's causal SDPA can serve the
    step: every sequence's rows are its last positions (no sparse rows) after a cached prefix no
    longer than the rows themselves. None otherwise (the paged kernel serves it)."""
    if not md.contiguous:
        return None
    cu = md.cu_seqlens_q_cpu
    lens = []
    for s, n in enumerate(md.seq_lens_cpu):
        m = cu[s + 1] - cu[s]
        if n - m > m:
            return None
        lens.append(n - m)
    return lens


def _causal_sdpa(query, key, value, k_cache, v_cache, md: AttentionMetadata, scale: float,
                 prefix_lens: list[int]) -> torch.Tensor:
    """Prefill and short-prefix extend through torch's fused causal SDPA (flash / cuDNN; ~530 TFLOP/s
    on the H200 against ~345 for the paged kernel), one call per sequence, as vLLM does with
    flash-attn's varlen prefill. A sequence with p cached keys gets them gathered from its blocks and
    p zero query rows prepended, so the square causal mask is exactly "key <= own position"; the
    padded rows cost p^2/2 of n^2/2 score elements, which is why the prefix must be short
    (p <= rows: beyond that the paged kernel, which skips them, is faster).
    Measured and rejected earlier: gathered keys with a lower-right causal mask (q_len != kv_len)
    were 10-25% slower than the paged kernel at 8k-32k."""
    cu = md.cu_seqlens_q_cpu
    bs = k_cache.shape[1]
    group = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for s in range(md.num_seqs):
        a, b, p = cu[s], cu[s + 1], prefix_lens[s]
        q, k, v = query[a:b], key[a:b], value[a:b]                        # [m, H or KVH, D]
        if p:
            blocks = md.block_tables[s, : (p + bs - 1) // bs].long()
            k = torch.cat((k_cache[blocks].flatten(0, 1)[:p], k))         # [p + m, KVH, D]
            v = torch.cat((v_cache[blocks].flatten(0, 1)[:p], v))
            q = torch.cat((q.new_zeros(p, *q.shape[1:]), q))              # [p + m, H, D]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=group > 1)             # [1, H, p + m, D]
        out[a:b] = o[0, :, p:].transpose(0, 1)
    return out


__all__ = ["TritonAttentionBackend", "prefill_attention", "decode_attention", "decode_num_splits",
           "window_num_splits", "check_window_and_cap"]
