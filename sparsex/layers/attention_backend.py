"""Attention over the paged KV cache: the torch (CPU) backend, which is also the reference.

A backend provides two functions, both reading `AttentionMetadata`:
  store_kv(key, value, k_cache, v_cache, slot_mapping)
  attention(query, k_cache, v_cache, metadata, scale, key=None, value=None, *,
            sliding_window=None, logits_soft_cap=None) -> output
Caches are per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.
The GPU backend (Triton) implements the same two functions, keyword options included.

A row at position i sees keys j <= i; with `sliding_window` W only j > i - W (Mistral, Gemma's local
layers; transformers' sliding_window_causal mask), and with `logits_soft_cap` C its scaled scores s
become C * tanh(s / C) before the mask and softmax (Gemma). Every path below honours both and reads
only the keys of the window (the native kernels skip the blocks before it; the torch paths gather
from its start and mask it additively: a windowed fresh prefill goes to masked SDPA or the row
chunks, not causal SDPA); SDPA cannot cap, so softcapped layers run multi-row sequences as row chunks
and single rows through explicit scores.

How the CPU backend spends its time (2-core AVX-512 box, SmolLM2 shapes, measured):
- Sequences with one query row (decode, or a sparse layer that kept a single row) go to the
  native paged decode kernel (cpu_kernels.decode_attention): one call per layer reads K/V straight
  from the cache. Without it (SPARSEX_NATIVE_KERNELS=0, no compiler, an unsupported dtype or head
  dim, or tensors off the CPU as when this backend is the GPU kernels' reference) they are batched
  into one masked SDPA call per layer over gathered keys. That runs in float32 even for bf16
  models: torch's CPU flash kernel is ~7x slower on bf16 single-row queries than on float32.
- Sequences with several rows (prefill, prefix-hit extend, chunked prefill, SparseX's sparse
  rows) go to the native flash-style kernel (cpu_kernels.multi_row_attention) under the same
  conditions, on AVX-512 CPUs: tiles of rows x a KV head's query heads against key blocks, online
  softmax in float32, scores never written to memory; 1.3-1.6x faster than the GEMM path below at
  1k-4k tokens (bf16), ~2x in float32. On an AVX2-only CPU it was 2-4.5x slower than that path
  (cpu_kernels.multi_row_preferred). Without it, a prefill with nothing cached (rows exactly
  positions 0..n-1) is one causal torch SDPA call over the step's own K/V; any other multi-row
  sequence (extend, sparse rows) gathers its keys once and makes one SDPA call per _SDPA_CHUNK_ROWS
  rows with an additive mask built once a step, where rows x keys stays under _MAX_SDPA_MASK_ELEMS
  (on the 2-core AVX2 EPYC, fp32, 0.5-4k keys: 1.1-2.3x faster than the row chunks for an extend,
  1.1-1.4x for sparse rows). The rest run as row chunks of two GEMMs each: a chunk only multiplies
  against the keys up to its last row's position, and only the keys between its first and last
  row's positions need a mask. That skips the causal upper triangle like flash attention does,
  but with MKL/oneDNN GEMMs, which were ~1.5x faster than torch's CPU flash kernel at 1k-4k
  tokens on an AVX-512 CPU (on an AVX2 EPYC causal SDPA was 1.5-2.4x faster than them for a fresh
  prefill, hence that path). Scores are computed in the model dtype, or float32 where bf16 GEMMs
  are emulated (20-75x slower there at 0.5-4k keys); the softmax accumulates in float32 and rounds P to the
  compute dtype, as flash kernels do before the PV product.
- Everything that depends only on the step (cache slot of every visible key, chunk bounds,
  masks) is built once, at the first layer, and reused by all layers (`CpuAttentionPlan`): in
  `md.backend_plan` for plain layers, in `md.variant_plans` keyed by (sliding_window, softcapped)
  for the others, so a model alternating sliding and global layers builds two plans a step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from sparsex.config import cpu_has_native_bf16
from sparsex.layers import cpu_kernels
from sparsex.layers.attention_metadata import AttentionMetadata

# Score elements per KV head a row chunk materialises; bounds the working set to stay in cache.
_CHUNK_SCORE_ELEMS = 1 << 19
_MIN_CHUNK, _MAX_CHUNK = 32, 256
# Masked SDPA: rows per call (a call computes its masked keys too: with 256 rows an extend of n rows
# wastes ~128 / n of its work; one call for all rows was 1.3x slower than the GEMM chunks on a 3.5k
# extend), and the mask elements (rows x keys, compute dtype) a step's masked sequences may hold
# together; past it (e.g. a late chunk of a long chunked prefill) a sequence runs as GEMM row chunks.
_SDPA_CHUNK_ROWS = 256
_MAX_SDPA_MASK_ELEMS = 1 << 24


@dataclass
class _RowChunk:
    r0: int                          # query rows r0:r1 (flat, all sequences)
    r1: int
    k0: int                          # keys k0..kend-1 are visible to at least one row (k0 > 0: a window)
    kend: int
    mstart: int                      # keys mstart..kend-1 are hidden from some rows
    bias: torch.Tensor | None        # [r1 - r0, kend - mstart], 0 or -inf (None: nothing hidden)


@dataclass
class _MultiRowSeq:
    slots: torch.Tensor              # [kend_max - k0] int64, cache slot of key positions k0..kend_max-1
    k0: int                          # the first key any row sees (0 without a window)
    chunks: list[_RowChunk]


@dataclass
class _CausalSeq:
    """A sequence whose rows are exactly positions 0..n-1 (a prefill with nothing cached): its keys
    are this step's own K/V rows r0:r1, so torch's causal SDPA reads them in place."""
    r0: int
    r1: int
    slots: torch.Tensor              # [r1 - r0] int64, their cache slots (read when the step's K/V are not passed)


@dataclass
class _MaskedChunk:
    r0: int                          # query rows r0:r1 (flat, all sequences)
    r1: int
    k0: int                          # keys k0..kend-1: from its first row's window start (0 without
    kend: int                        # a window) to its last row's position
    mask: torch.Tensor               # [r1 - r0, kend - k0], 0 or -inf, in the compute dtype


@dataclass
class _MaskedSeq:
    """A multi-row sequence whose rows are not 0..n-1 (extend, sparse rows, or any sequence a sliding
    window reaches into): its keys gathered from the cache once, then one SDPA call per chunk of
    _SDPA_CHUNK_ROWS rows over the keys they see."""
    slots: torch.Tensor              # [kend_max - k0] int64, cache slot of key positions k0..kend_max-1
    k0: int                          # the first key any row sees (0 without a window)
    chunks: list[_MaskedChunk]


@dataclass
class _NativeMultiRowBatch:
    """Multi-row sequences for the native flash-style kernel."""
    rows: torch.Tensor | None        # [R] int64, the rows of these sequences; None: all rows, in order
    block_tables: torch.Tensor       # [S, max_blocks] int32, those sequences' block tables
    query_start: torch.Tensor        # [S + 1] int64, sequence s owns rows query_start[s]:query_start[s+1] of `rows`
    positions: torch.Tensor          # [R] int64, each row's position


@dataclass
class _SingleRowBatch:
    """One-row sequences for the native decode kernel."""
    rows: torch.Tensor | None        # [S] int64, the one query row of each such sequence; None: all rows, in order
    block_tables: torch.Tensor       # [S, max_blocks] int32, those sequences' block tables
    positions: torch.Tensor          # [S] int64, each row's position


@dataclass
class _GatheredSingleRowBatch:
    """One-row sequences for one masked SDPA call over gathered keys."""
    rows: torch.Tensor               # [S] int64, the one query row of each such sequence
    slots: torch.Tensor              # [S * L] int64, slot of keys a..a+L-1 per sequence, a its window
                                     # start (0 without a window); padded with 0
    mask: torch.Tensor               # [S, 1, 1, L] bool, True = visible
    max_len: int                     # L


@dataclass
class CpuAttentionPlan:
    """Per-step precomputation shared by every layer with the same sliding window and softcapping
    (the metadata is the same for all layers)."""
    single: _SingleRowBatch | _GatheredSingleRowBatch | None
    multi: _NativeMultiRowBatch | list[_MultiRowSeq] = field(default_factory=list)   # [] when none
    causal: list[_CausalSeq] = field(default_factory=list)   # only without the native multi-row kernel
    masked: list[_MaskedSeq] = field(default_factory=list)   # likewise
    gemm_dtype: torch.dtype = torch.float32                   # what the row chunks and masked SDPA compute in


def _slots_of(block_table: torch.Tensor, n: int, block_size: int, start: int = 0) -> torch.Tensor:
    """Cache slots of key positions start..start+n-1: [n] int64."""
    p = torch.arange(start, start + n, dtype=torch.int64, device=block_table.device)
    return block_table[p // block_size].to(torch.int64) * block_size + p % block_size   # [n]


def _hidden_bias(row_pos: torch.Tensor, k0: int, kend: int, neg_inf: torch.Tensor, zero: torch.Tensor,
                 window: int | None = None) -> torch.Tensor:
    """[rows, kend - k0]: -inf where key position k0.. is past the row's position (or, with a window,
    at or before position - window), else 0."""
    key_pos = torch.arange(k0, kend, device=row_pos.device)[None, :]
    hidden = key_pos > row_pos[:, None]
    if window is not None:
        hidden |= key_pos <= row_pos[:, None] - window
    return torch.where(hidden, neg_inf, zero)


def _key_range(pos: list[int], window: int | None) -> tuple[int, int]:
    """(k0, kend): rows at positions `pos` see keys k0..kend-1 between them."""
    return (0 if window is None else max(0, min(pos) + 1 - window)), max(pos) + 1


def _chunk_rows(num_kv_groups: int, kend: int) -> int:
    c = _CHUNK_SCORE_ELEMS // max(1, num_kv_groups * kend)
    c = 1 << max(0, int(math.log2(max(1, c))))
    return max(_MIN_CHUNK, min(_MAX_CHUNK, c))


def _seq_subset(md: AttentionMetadata, seqs: list[int], rows: Callable[[], torch.Tensor]):
    """(rows, block tables, positions) of the sequences `seqs`, whose rows `rows()` gives, for a
    native kernel; rows is None when they are every sequence (then every row, in order: no gather,
    no scatter)."""
    if len(seqs) == md.num_seqs:
        return None, md.block_tables, md.positions
    dev = md.block_tables.device
    rows_t = rows().to(dev)                                              # [R] int64
    return (rows_t, md.block_tables.index_select(0, torch.tensor(seqs, device=dev)),
            md.positions.index_select(0, rows_t))


def _on_rows(kernel, query: torch.Tensor, rows: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
    """kernel(query rows) written to those rows of `out` (allocated when None); rows None: every row."""
    if rows is None:
        return kernel(query)
    out = torch.empty_like(query) if out is None else out
    out.index_copy_(0, rows, kernel(query.index_select(0, rows)))
    return out


def _native_multi(md: AttentionMetadata, seqs: list[int]) -> _NativeMultiRowBatch:
    cu = md.cu_seqlens_q_cpu
    query_start = torch.tensor([0] + [cu[s + 1] - cu[s] for s in seqs], dtype=torch.int64).cumsum(0)
    rows, tables, positions = _seq_subset(md, seqs, lambda: torch.cat([torch.arange(cu[s], cu[s + 1]) for s in seqs]))
    return _NativeMultiRowBatch(rows, tables, query_start.to(md.block_tables.device), positions)


def build_plan(md: AttentionMetadata, block_size: int, num_kv_groups: int, dtype: torch.dtype,
               native: bool, native_multi: bool, sdpa: bool = False, window: int | None = None) -> CpuAttentionPlan:
    """`native`: one-row sequences go to cpu_kernels.decode_attention (else gathered SDPA);
    `native_multi`: multi-row ones to cpu_kernels.multi_row_attention (else GEMM row chunks in
    `dtype`); `sdpa`: without `native_multi`, a prefill with nothing cached goes to causal SDPA and
    the other multi-row sequences to masked SDPA in `dtype` (within _MAX_SDPA_MASK_ELEMS).
    `window`: a sliding window of that many keys; the native kernels apply it themselves, the other
    paths get keys, masks and chunk bounds for it (a sequence whose rows all sit below position
    `window` is planned as without one: the window hides none of its keys)."""
    positions = md.positions.tolist()
    cu = md.cu_seqlens_q_cpu
    single_rows, single_lens, single_seqs, multi_seqs = [], [], [], []
    multi: list[_MultiRowSeq] = []
    causal: list[_CausalSeq] = []
    masked: list[_MaskedSeq] = []
    mask_budget = _MAX_SDPA_MASK_ELEMS
    dev = md.block_tables.device          # the CPU normally; any device when used as the reference
    neg_inf = torch.tensor(float("-inf"), dtype=dtype, device=dev)
    zero = torch.zeros((), dtype=dtype, device=dev)
    for s in range(md.num_seqs):
        q0, q1 = cu[s], cu[s + 1]
        if q1 - q0 == 1:
            single_rows.append(q0)
            single_lens.append(positions[q0] + 1)
            single_seqs.append(s)
            continue
        if q1 == q0:
            continue
        if native_multi:
            multi_seqs.append(s)
            continue
        rows_pos = positions[q0:q1]
        kmax = max(rows_pos) + 1
        win = window if window is not None and kmax > window else None    # None: it hides nothing here
        if sdpa and win is None and md.seq_lens_cpu[s] == q1 - q0 and rows_pos == list(range(q1 - q0)):
            causal.append(_CausalSeq(q0, q1, _slots_of(md.block_tables[s], q1 - q0, block_size)))
            continue
        if sdpa:
            bounds = [(r0, min(q1, r0 + _SDPA_CHUNK_ROWS)) for r0 in range(q0, q1, _SDPA_CHUNK_ROWS)]
            ranges = [_key_range(positions[r0:r1], win) for r0, r1 in bounds]      # (k0, kend) per chunk
            if (q1 - q0) * max(kend - k0 for k0, kend in ranges) <= mask_budget:
                chunks = []
                for (r0, r1), (k0, kend) in zip(bounds, ranges):
                    mask_budget -= (r1 - r0) * (kend - k0)
                    mask = _hidden_bias(md.positions[r0:r1].to(dev), k0, kend, neg_inf, zero, win)
                    chunks.append(_MaskedChunk(r0, r1, k0, kend, mask))
                seq_k0 = min(k0 for k0, _ in ranges)
                masked.append(_MaskedSeq(_slots_of(md.block_tables[s], kmax - seq_k0, block_size, seq_k0), seq_k0,
                                         chunks))
                continue
        chunks = []
        # a window bounds the keys a chunk multiplies (~window of them) and so its score working set
        c = _chunk_rows(num_kv_groups, kmax if win is None else min(kmax, win))
        for r0 in range(q0, q1, c):
            r1 = min(q1, r0 + c)
            pos = rows_pos[r0 - q0:r1 - q0]
            k0, kend = _key_range(pos, win)
            # the first key hidden from some row: past the first row's position, or, where the rows'
            # windows start at different keys, the chunk's first key
            mstart = k0 if win is not None and max(pos) + 1 - win > k0 else min(pos) + 1
            bias = (_hidden_bias(md.positions[r0:r1].to(dev), mstart, kend, neg_inf, zero, win)
                    if mstart < kend else None)
            chunks.append(_RowChunk(r0, r1, k0, kend, mstart, bias))
        seq_k0 = min(ch.k0 for ch in chunks)
        multi.append(_MultiRowSeq(_slots_of(md.block_tables[s], kmax - seq_k0, block_size, seq_k0), seq_k0, chunks))
    single = None
    if single_rows and native:
        single = _SingleRowBatch(*_seq_subset(md, single_seqs, lambda: torch.tensor(single_rows)))
    elif single_rows:
        # with a window, row s's keys start at a = its length - window: only keys a..a+L-1 are gathered
        starts = [0] * len(single_lens) if window is None else [max(0, n - window) for n in single_lens]
        lens_l = [n - a for n, a in zip(single_lens, starts)]
        L = max(lens_l)
        slots = torch.cat([_slots_of(md.block_tables[s], L, block_size, a) for s, a in zip(single_seqs, starts)])
        lens = torch.tensor(lens_l, device=dev)
        mask = (torch.arange(L, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        # a padded key reads whatever slot the padded block-table entry points at: masked out
        slots = torch.where(mask.flatten(), slots.view(len(single_seqs), L).flatten(), 0)
        single = _GatheredSingleRowBatch(torch.tensor(single_rows, device=dev), slots, mask, L)
    return CpuAttentionPlan(single, _native_multi(md, multi_seqs) if multi_seqs else multi, causal, masked, dtype)


def _new_plan(md: AttentionMetadata, query: torch.Tensor, k_cache: torch.Tensor, groups: int,
              window: int | None, softcapped: bool) -> CpuAttentionPlan:
    """The step's plan for layers with this window and softcapping: which paths this CPU and these
    tensors allow, then build_plan."""
    native = (query.shape[2] in cpu_kernels.ATTENTION_HEAD_DIMS and k_cache.dtype == query.dtype
              and md.positions.dtype == torch.int64 and md.block_tables.dtype == torch.int32
              and cpu_kernels.supports(query, k_cache))
    # where the flash kernel is not preferred (an AVX2 CPU): torch's SDPA (causal for a fresh
    # prefill, masked for the other multi-row sequences); masked SDPA and GEMMs in float32
    # when bf16 GEMMs would be emulated (20-75x slower at 0.5-4k)
    flash_preferred = cpu_kernels.multi_row_preferred()
    on_cpu = query.device.type == "cpu"
    gemm_dtype = (torch.float32 if on_cpu and query.dtype == torch.bfloat16 and not cpu_has_native_bf16()
                  else query.dtype)
    # SDPA cannot softcap the scores: softcapped layers' multi-row sequences run as row chunks
    return build_plan(md, k_cache.shape[1], groups, gemm_dtype, native, native and flash_preferred,
                      sdpa=on_cpu and not flash_preferred and not softcapped, window=window)


def _variant_plan(md: AttentionMetadata, query: torch.Tensor, k_cache: torch.Tensor, groups: int,
                  sliding_window: int | None, logits_soft_cap: float | None) -> CpuAttentionPlan:
    """The plan of a layer with a sliding window or softcapped logits, built at the first such layer of
    the step: keyed by what it depends on, (window, softcapped), never by the cap's value."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) != sliding_window
                                       or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if logits_soft_cap is not None and not 0 < logits_soft_cap < math.inf:     # NaN fails too
        raise ValueError(f"logits_soft_cap must be a positive finite float or None, got {logits_soft_cap!r}")
    key = (sliding_window, logits_soft_cap is not None)
    if md.variant_plans is None:
        md.variant_plans = {}
    plan = md.variant_plans.get(key)
    if plan is None:
        plan = md.variant_plans[key] = _new_plan(md, query, k_cache, groups, sliding_window, key[1])
    return plan


def _softcapped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                     cap: float) -> torch.Tensor:
    """F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True) with the
    scaled scores softcapped to cap * tanh(s / cap) before the mask (HF Gemma), which SDPA cannot do.
    q [B, H, M, D]; k, v [B, KVH, L, D] (query head h reads KV head h // (H / KVH)); mask
    [B, 1, M, L] bool, True = visible. Returns [B, H, M, D]."""
    B, H, M, D = q.shape
    kvh, L = k.shape[1], k.shape[2]
    g = H // kvh
    s = torch.matmul(q.reshape(B, kvh, g * M, D), k.transpose(-1, -2)).mul_(scale)   # [B, KVH, G*M, L]
    s = s.div_(cap).tanh_().mul_(cap).view(B, H, M, L).masked_fill_(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p.view(B, kvh, g * M, L), v).view(B, H, M, D)


class TorchAttentionBackend:
    """Exact per-row causal attention (optionally sliding-window and softcapped) with torch GEMMs and
    SDPA, or the native kernels (see the module docstring). An `AttentionBackend`
    (attention_backend_protocol.py), used as the class."""

    name = "torch"

    @staticmethod
    def store_kv(
        key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> None:
        if (cpu_kernels.supports(key, value, k_cache) and key.dtype == value.dtype == k_cache.dtype
                and slot_mapping.dtype == torch.int64):
            cpu_kernels.store_kv(key, value, k_cache, v_cache, slot_mapping)    # both index copies in one call
            return
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    @staticmethod
    def attention(
        query: torch.Tensor,        # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,     # this step's K/V (already stored); unused here
        value: torch.Tensor | None = None,
        *,
        sliding_window: int | None = None,   # a row at position i sees keys i - sliding_window + 1 .. i
        logits_soft_cap: float | None = None,   # scaled scores s -> logits_soft_cap * tanh(s / logits_soft_cap)
    ) -> torch.Tensor:              # [num_tokens, num_heads, head_dim]
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[2]
        groups = num_heads // num_kv_heads
        if sliding_window is None and logits_soft_cap is None:
            plan = md.backend_plan
            if plan is None:
                plan = md.backend_plan = _new_plan(md, query, k_cache, groups, None, False)
        else:
            plan = _variant_plan(md, query, k_cache, groups, sliding_window, logits_soft_cap)
        single, multi = plan.single, plan.multi
        if isinstance(single, _SingleRowBatch):
            decode = lambda q: cpu_kernels.decode_attention(q, k_cache, v_cache, single.block_tables, single.positions,
                                                            scale, sliding_window, logits_soft_cap)   # [S, H, D]
            if single.rows is None:                                  # a pure decode step
                return decode(query)
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)            # [num_slots, KVH, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)

        if isinstance(multi, _NativeMultiRowBatch):
            out = _on_rows(lambda q: cpu_kernels.multi_row_attention(q, k_cache, v_cache, multi.block_tables,
                                                                     multi.query_start, multi.positions, scale,
                                                                     sliding_window, logits_soft_cap),
                           query, multi.rows, None)                  # [T, H, D]
        elif multi:
            # queries KV-head-major once per layer, scale folded in: a chunk's rows are then one
            # contiguous [rows * groups, D] block per KV head (rows outer, groups inner)
            gemm_dtype = plan.gemm_dtype
            q_all = query.new_empty(num_kv_heads, query.shape[0], groups, head_dim, dtype=gemm_dtype)  # [KVH, T, G, D]
            torch.mul(query.view(-1, num_kv_heads, groups, head_dim).transpose(0, 1), scale, out=q_all)
            o_all = torch.empty_like(q_all)   # rows of one-row sequences are filled below
            for seq in multi:
                k = k_flat.index_select(0, seq.slots).to(gemm_dtype)      # [n, KVH, D], keys seq.k0..
                v = v_flat.index_select(0, seq.slots).to(gemm_dtype)
                k_t = k.permute(1, 2, 0).contiguous()                     # [KVH, D, n]
                v_h = v.permute(1, 0, 2).contiguous()                     # [KVH, n, D]
                for ch in seq.chunks:
                    c, a, b = ch.r1 - ch.r0, ch.k0 - seq.k0, ch.kend - seq.k0   # keys ch.k0..ch.kend-1
                    q = q_all[:, ch.r0:ch.r1].reshape(num_kv_heads, c * groups, head_dim)
                    scores = torch.bmm(q, k_t[:, :, a:b]).view(num_kv_heads, c, groups, b - a)
                    if logits_soft_cap is not None:                       # scaled already: q carries the scale
                        scores.div_(logits_soft_cap).tanh_().mul_(logits_soft_cap)
                    if ch.bias is not None:
                        scores[..., ch.mstart - ch.k0:] += ch.bias[:, None, :]
                    probs = torch.softmax(scores, dim=-1)                 # float32 accumulation inside
                    o = torch.bmm(probs.view(num_kv_heads, c * groups, b - a), v_h[:, a:b])  # [KVH, c*G, D]
                    o_all[:, ch.r0:ch.r1] = o.view(num_kv_heads, c, groups, head_dim)
            out = o_all.transpose(0, 1).reshape(-1, num_heads, head_dim).to(query.dtype)   # [T, H, D]
        else:
            out = torch.empty_like(query)

        for seq in plan.causal:
            if key is not None:
                k, v = key[seq.r0:seq.r1], value[seq.r0:seq.r1]                  # [n, KVH, D]
            else:                            # a selection layer passes none: its rows' K/V are stored
                k = k_flat.index_select(0, seq.slots).to(query.dtype)
                v = v_flat.index_select(0, seq.slots).to(query.dtype)
            o = F.scaled_dot_product_attention(query[seq.r0:seq.r1].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                               enable_gqa=groups > 1)          # [1, H, n, D]
            out[seq.r0:seq.r1] = o[0].transpose(0, 1)

        for seq in plan.masked:                  # never softcapped (those run as row chunks)
            cdt = plan.gemm_dtype
            k = k_flat.index_select(0, seq.slots).to(cdt).transpose(0, 1)[None]     # [1, KVH, kend_max - k0, D]
            v = v_flat.index_select(0, seq.slots).to(cdt).transpose(0, 1)[None]
            for ch in seq.chunks:
                a, b = ch.k0 - seq.k0, ch.kend - seq.k0                            # keys ch.k0..ch.kend-1
                o = F.scaled_dot_product_attention(query[ch.r0:ch.r1].to(cdt).transpose(0, 1)[None], k[:, :, a:b],
                                                   v[:, :, a:b], attn_mask=ch.mask, scale=scale,
                                                   enable_gqa=groups > 1)           # [1, H, rows, D]
                out[ch.r0:ch.r1] = o[0].transpose(0, 1).to(out.dtype)

        if isinstance(single, _SingleRowBatch):
            out = _on_rows(decode, query, single.rows, out)
        elif single is not None:
            b = single
            S, L = b.rows.shape[0], b.max_len
            q = query.index_select(0, b.rows).float().unsqueeze(2)   # [S, H, 1, D]
            k = k_flat.index_select(0, b.slots).view(S, L, num_kv_heads, head_dim).float()
            v = v_flat.index_select(0, b.slots).view(S, L, num_kv_heads, head_dim).float()
            if logits_soft_cap is None:
                o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=b.mask,
                                                   scale=scale, enable_gqa=groups > 1)  # [S, H, 1, D]
            else:
                o = _softcapped_sdpa(q, k.transpose(1, 2), v.transpose(1, 2), b.mask, scale, logits_soft_cap)
            out.index_copy_(0, b.rows, o.squeeze(2).to(out.dtype))
        return out
