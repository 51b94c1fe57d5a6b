"""The selection probe's scores in Triton (CUDA): CacheBlend's K/V deviation and sparse_q's query
attention mass, each from the tensors the probe layer already holds, in few launches.

The torch versions (`selectors.kv_deviation_scores`, `selectors.query_attention_mass`) are the
reference and the CPU path. On the GPU they took ~35 small launches a blended request and, at 8k
tokens, built a [KVH, m, G, S] score matrix (67 MB in bf16, softmaxed into 134 MB of fp32): ~0.9 ms
of the 8k step's ~45 ms, at the 2% of TTFT a selection may cost. Here:

- `kv_deviation`: one program per reused row reads its fresh K/V rows and the cached copies at its
  slot (no gathered copies) -> ||K - K'||^2 + ||V - V'||^2 in fp32.
- `query_key_mass`: the mean attention probability the query rows put on each key, read straight
  from the paged cache through the block table (no gathered copy of the sequence's keys), in two
  passes that never hold the score matrix: pass 1 the log-sum-exp of every (query row, head) line
  over its visible keys, pass 2, per key tile and KV head, the sum over lines of exp(score - lse);
  then a sum over KV heads. The cache
  must already hold this step's fresh keys (call it after the layer's K/V store).
Scores use the tensor cores on the input dtype and accumulate in fp32; softmax in base 2.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:                    # CPU-only installs: the torch selectors are the path there
    triton = None

_LOG2E = 1.4426950408889634


if triton is not None:

    @triton.jit
    def _kv_deviation_kernel(
        k, v, k_cache, v_cache, rows, slot_mapping, out,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_ks, stride_kch, stride_vs, stride_vch,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        """Program i: reused row i (step row rows[i], its cached copy at slot slot_mapping[rows[i]])."""
        i = tl.program_id(0)
        row = tl.load(rows + i).to(tl.int64)
        slot = tl.load(slot_mapping + row).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)[:, None]
        offs_d = tl.arange(0, BLOCK_D)[None, :]
        ok = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
        kf = tl.load(k + row * stride_kt + offs_h * stride_kh + offs_d, mask=ok, other=0.0).to(tl.float32)
        kc = tl.load(k_cache + slot * stride_ks + offs_h * stride_kch + offs_d, mask=ok, other=0.0).to(tl.float32)
        vf = tl.load(v + row * stride_vt + offs_h * stride_vh + offs_d, mask=ok, other=0.0).to(tl.float32)
        vc = tl.load(v_cache + slot * stride_vs + offs_h * stride_vch + offs_d, mask=ok, other=0.0).to(tl.float32)
        dk = kf - kc
        dv = vf - vc
        tl.store(out + i, tl.sum(tl.sum(dk * dk + dv * dv, 1), 0))

    @triton.jit
    def _paged_keys(k_cache, bt_row, kv_head, n, n_ok, stride_kb, stride_ks, stride_kh,
                    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Keys at positions n ([BLOCK_N]) of one KV head, through the block table -> [BLOCK_N, D]."""
        page = tl.load(bt_row + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        ptrs = (k_cache + page[:, None] * stride_kb + (n % BLOCK_SIZE)[:, None] * stride_ks
                + kv_head * stride_kh + offs_d[None, :])
        return tl.load(ptrs, mask=n_ok[:, None], other=0.0)

    @triton.jit
    def _query_lines(q, rows, positions, kv_head, lines, num_lines, stride_qt, stride_qh,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Lines `lines` ([BLOCK_M]; line l = query row l // GROUP, head kv_head * GROUP + l % GROUP)
        -> (q [BLOCK_M, D], position [BLOCK_M], valid [BLOCK_M])."""
        ok = lines < num_lines
        row = tl.load(rows + lines // GROUP, mask=ok, other=0).to(tl.int64)
        head = kv_head * GROUP + lines % GROUP
        offs_d = tl.arange(0, HEAD_DIM)
        qt = tl.load(q + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                     mask=ok[:, None], other=0.0)
        pos = tl.load(positions + row, mask=ok, other=0)                 # invalid lines see key 0 (no NaN)
        return qt, pos, ok

    # per-request sizes are not specialised on (divisible by 16, == 1): one compilation serves every
    # request, so the start-up warm-up covers them (sparsex/engine/warmup.py)
    @triton.jit(do_not_specialize=["num_lines", "seq_len"])
    def _query_lse_kernel(
        q, rows, positions, k_cache, bt_row, lse, num_lines, seq_len,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, qk_scale,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Program (h, j): lines j*BLOCK_M.. of KV head h -> lse[h, line] (base 2) over keys <= position."""
        kv_head = tl.program_id(0)
        lines = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        qt, pos, ok = _query_lines(q, rows, positions, kv_head, lines, num_lines, stride_qt, stride_qh,
                                   GROUP, HEAD_DIM)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for start in range(0, seq_len, BLOCK_N):       # the query rows are a step's last: no early stop
            n = start + tl.arange(0, BLOCK_N)
            kt = _paged_keys(k_cache, bt_row, kv_head, n, n < seq_len, stride_kb, stride_ks, stride_kh,
                             BLOCK_SIZE, HEAD_DIM)
            s = tl.dot(qt, tl.trans(kt.to(qt.dtype))) * qk_scale        # [BLOCK_M, BLOCK_N]
            s = tl.where((n[None, :] <= pos[:, None]) & (n[None, :] < seq_len), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))                        # finite: every line sees key 0 first
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
            m_i = m_new
        tl.store(lse + kv_head * num_lines + lines, m_i + tl.log2(l_i), mask=ok)

    @triton.jit(do_not_specialize=["num_lines", "seq_len"])
    def _query_mass_kernel(
        q, rows, positions, k_cache, bt_row, lse, out, num_lines, seq_len,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, qk_scale, inv_count,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        """Program (j, h): keys j*BLOCK_N.. of KV head h -> out[h, key] = sum over h's lines of the
        line's attention probability on the key, times inv_count."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kv_head = tl.program_id(1)
        n_ok = n < seq_len
        acc = tl.zeros([BLOCK_N], tl.float32)
        kt = _paged_keys(k_cache, bt_row, kv_head, n, n_ok, stride_kb, stride_ks, stride_kh, BLOCK_SIZE, HEAD_DIM)
        for l0 in range(0, num_lines, BLOCK_M):
            lines = l0 + tl.arange(0, BLOCK_M)
            qt, pos, ok = _query_lines(q, rows, positions, kv_head, lines, num_lines, stride_qt, stride_qh,
                                       GROUP, HEAD_DIM)
            lse_l = tl.load(lse + kv_head * num_lines + lines, mask=ok, other=0.0)
            s = tl.dot(qt, tl.trans(kt.to(qt.dtype))) * qk_scale         # [BLOCK_M, BLOCK_N]
            visible = (n[None, :] <= pos[:, None]) & ok[:, None] & n_ok[None, :]
            acc += tl.sum(tl.where(visible, tl.exp2(s - lse_l[:, None]), 0.0), 0)
        tl.store(out + kv_head * seq_len + n, acc * inv_count, mask=n_ok)


def kv_deviation(
    k: torch.Tensor,             # [T, KVH, D] this step's fresh keys (last dim contiguous)
    v: torch.Tensor,             # [T, KVH, D]
    k_cache: torch.Tensor,       # [num_blocks, block_size, KVH, D], still holding the re-rotated copies
    v_cache: torch.Tensor,
    rows: torch.Tensor,          # [R] int64 step rows of the reused tokens
    slot_mapping: torch.Tensor,  # [T] int64 every step row's cache slot
) -> torch.Tensor:
    """`selectors.kv_deviation_scores(k[rows], v[rows], cache[slot_mapping[rows]]...)` in one launch
    -> [R] fp32."""
    num_rows = rows.numel()
    out = torch.empty(num_rows, dtype=torch.float32, device=k.device)
    if num_rows == 0:
        return out
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    for t in (k, v, k_cache, v_cache):
        assert t.stride(-1) == 1
    assert k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1) and v_cache.stride(0) == v_cache.shape[1] * v_cache.stride(1)
    _kv_deviation_kernel[(num_rows,)](
        k, v, k_cache, v_cache, rows, slot_mapping, out,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim), num_warps=4)
    return out


def query_key_mass(
    q: torch.Tensor,             # [T, H, D] this step's queries (last dim contiguous)
    rows: torch.Tensor,          # [m] int64 the query rows to weigh
    positions: torch.Tensor,     # [T] int64 absolute position of every step row
    k_cache: torch.Tensor,       # [num_blocks, block_size, KVH, D], this step's K already stored
    block_table: torch.Tensor,   # [>= ceil(seq_len / block_size)] int32, the sequence's blocks
    seq_len: int,
    scale: float,
) -> torch.Tensor:
    """`selectors.query_attention_mass(q[rows], keys, positions[rows], scale)` over the sequence's
    keys 0..seq_len-1 in the paged cache, in three launches -> [seq_len] fp32."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    m = rows.numel()
    if m == 0 or seq_len == 0:
        return torch.zeros(seq_len, dtype=torch.float32, device=q.device)
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and head_dim >= 16 and head_dim == triton.next_power_of_2(head_dim)
    num_lines = m * group
    lse = torch.empty(num_kv_heads, num_lines, dtype=torch.float32, device=q.device)
    per_head = torch.empty(num_kv_heads, seq_len, dtype=torch.float32, device=q.device)
    qk_scale = scale * _LOG2E
    common = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), qk_scale)
    # the grids are (KV head x line block) and (key block x KV head): at 8k keys and 128 query rows
    # of Llama-3-8B, 128 and 1,024 programs
    _query_lse_kernel[(num_kv_heads, triton.cdiv(num_lines, 32))](
        q, rows, positions, k_cache, block_table, lse, num_lines, seq_len, *common,
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=32, BLOCK_N=64, num_warps=4)
    _query_mass_kernel[(triton.cdiv(seq_len, 64), num_kv_heads)](
        q, rows, positions, k_cache, block_table, lse, per_head, num_lines, seq_len, *common, 1.0 / (m * num_heads),
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=64, BLOCK_N=64, num_warps=4)
    return per_head.sum(0)                                               # mean over every (row, head)
