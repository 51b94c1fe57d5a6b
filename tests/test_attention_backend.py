"""The CPU attention backend against a naive reference: per row, softmax over keys 0..position.

Covers every row shape a step can have (plain prefill, prefix-hit extend, sparse rows at
scattered positions, single-row decodes of different lengths, all mixed in one step), several
row chunks per sequence, shuffled block tables, both dtypes, both single-row paths (the native
decode kernel and the gathered SDPA fallback) and every multi-row one (the native flash-style kernel;
causal SDPA for a fresh prefill, masked SDPA and GEMM row chunks for the rest). Sliding-window and
softcapped layers are checked on every path against a dense reference (the full score matrix,
capped and masked), as are the plans a step keeps for them."""
from __future__ import annotations

import math

import pytest
import torch

import sparsex.layers.attention_backend as ab
from sparsex.layers import cpu_kernels
from sparsex.layers.attention_backend import TorchAttentionBackend
from sparsex.layers.attention_metadata import AttentionMetadata

pytestmark = pytest.mark.unit

H, KVH, D, BS = 6, 2, 16, 4


def _reference(query, k_cache, v_cache, rows_of_seq, positions, tables, scale):
    k_flat, v_flat = k_cache.view(-1, KVH, D).double(), v_cache.view(-1, KVH, D).double()
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s, rows in enumerate(rows_of_seq):
        for r in rows:
            p = positions[r]
            slots = [tables[s][i // BS] * BS + i % BS for i in range(p + 1)]
            k = k_flat[slots].repeat_interleave(H // KVH, dim=1)        # [p+1, H, D]
            v = v_flat[slots].repeat_interleave(H // KVH, dim=1)
            att = torch.einsum("hd,nhd->hn", query[r].double(), k) * scale
            out[r] = torch.einsum("hn,nhd->hd", att.softmax(-1), v)
    return out


def _dense_reference(query, k_cache, v_cache, rows_of_seq, positions, tables, scale, window=None, cap=None):
    """HF eager attention in float64, per sequence: the full [rows, H, keys] score matrix s = q·k * scale,
    softcapped to cap * tanh(s / cap), keys j > i (and, with a window, j <= i - window) set to -inf,
    softmax, P·V."""
    k_flat, v_flat = k_cache.view(-1, KVH, D).double(), v_cache.view(-1, KVH, D).double()
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s, rows in enumerate(rows_of_seq):
        rows = list(rows)
        pos = torch.tensor([positions[r] for r in rows])                    # [rows]
        n = int(pos.max()) + 1
        slots = [tables[s][i // BS] * BS + i % BS for i in range(n)]
        k = k_flat[slots].repeat_interleave(H // KVH, dim=1)                # [n, H, D]
        v = v_flat[slots].repeat_interleave(H // KVH, dim=1)
        att = torch.einsum("thd,nhd->thn", query[rows].double(), k) * scale  # [rows, H, n]
        if cap is not None:
            att = cap * torch.tanh(att / cap)
        key_pos, row_pos = torch.arange(n)[None, None, :], pos[:, None, None]
        hidden = key_pos > row_pos
        if window is not None:
            hidden |= key_pos <= row_pos - window
        out[rows] = torch.einsum("thn,nhd->thd", att.masked_fill(hidden, float("-inf")).softmax(-1), v)
    return out


def _metadata(seq_rows_pos: list[list[int]], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    positions = [p for rows in seq_rows_pos for p in rows]
    cu = [0]
    for rows in seq_rows_pos:
        cu.append(cu[-1] + len(rows))
    width = max(map(len, tables))
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    slots = [tables[s][p // BS] * BS + p % BS for s, rows in enumerate(seq_rows_pos) for p in rows]
    contiguous = all(rows == list(range(n - len(rows), n)) for rows, n in zip(seq_rows_pos, seq_lens))
    return AttentionMetadata(
        positions=torch.tensor(positions), slot_mapping=torch.tensor(slots),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt, max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])), max_seq_len=max(seq_lens),
        cu_seqlens_q_cpu=cu, seq_lens_cpu=seq_lens, contiguous=contiguous)


SEQ_LENS = [37, 29, 50, 9, 23, 41]


def _mixed_step(dtype, num_blocks: int = 64, first_block: int = 0):
    """One step with every row shape: (metadata, block tables, k_cache, v_cache, query). The
    sequences' blocks are first_block..num_blocks-1, shuffled."""
    g = torch.Generator().manual_seed(0)
    seq_rows_pos = [
        list(range(37)),                                  # plain prefill
        list(range(17, 29)),                              # prefix hit: 17 cached, 12 new rows
        sorted(torch.randperm(50, generator=g)[:13].tolist()),   # sparse rows at scattered positions
        [8],                                              # decode
        [22],                                             # decode, other length
        [5],                                              # one sparse row far from the end
    ]
    perm = (torch.randperm(num_blocks - first_block, generator=g) + first_block).tolist()   # not contiguous
    tables, at = [], 0
    for n in SEQ_LENS:
        nb = (n + BS - 1) // BS
        tables.append(perm[at:at + nb])
        at += nb
    k_cache = torch.randn(num_blocks, BS, KVH, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, BS, KVH, D, generator=g).to(dtype)
    md = _metadata(seq_rows_pos, SEQ_LENS, tables)
    query = torch.randn(md.cu_seqlens_q_cpu[-1], H, D, generator=g).to(dtype)
    return md, tables, k_cache, v_cache, query


def _rows_of_seq(md: AttentionMetadata) -> list[range]:
    return [range(a, b) for a, b in zip(md.cu_seqlens_q_cpu, md.cu_seqlens_q_cpu[1:])]


def _use_paths(monkeypatch, native: bool, native_multi: bool) -> None:
    """(True, True): both native kernels (an AVX-512 CPU); (True, False): the native decode kernel
    and torch for multi-row sequences (an AVX2-only CPU); (False, False): torch only."""
    if native and cpu_kernels.native() is None:
        pytest.skip("native CPU kernels not available")
    if not native:
        monkeypatch.setattr(cpu_kernels, "native", lambda: None)
    monkeypatch.setattr(cpu_kernels, "multi_row_preferred", lambda: native_multi)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
# one chunk per sequence and masked SDPA where it fits / many small chunks and no masked SDPA
@pytest.mark.parametrize("chunk_elems", [1 << 19, 64])
@pytest.mark.parametrize("native,native_multi", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("pass_kv", [False, True])
def test_matches_reference_on_every_row_shape(monkeypatch, dtype, atol, chunk_elems, native, native_multi, pass_kv):
    """(True, True): both native kernels (an AVX-512 CPU); (True, False): the native decode kernel,
    causal SDPA for the fresh prefill and masked SDPA (or, past its mask budget, GEMM row chunks)
    for the other multi-row sequences (an AVX2-only CPU); (False, False): torch only. `pass_kv`: the step's own K/V rows are given, as the
    model passes them (the fresh prefill's SDPA reads them instead of the cache)."""
    _use_paths(monkeypatch, native, native_multi)
    monkeypatch.setattr(ab, "_CHUNK_SCORE_ELEMS", chunk_elems)
    monkeypatch.setattr(ab, "_MIN_CHUNK", 4)
    # the extend (12 x 29) fits, the sparse rows (13 x <= 50) do not: both SDPA paths and the chunks
    monkeypatch.setattr(ab, "_MAX_SDPA_MASK_ELEMS", 12 * 29 if chunk_elems == 1 << 19 else 0)
    monkeypatch.setattr(ab, "_SDPA_CHUNK_ROWS", 5)       # several SDPA calls, each over the keys its rows see
    md, tables, k_cache, v_cache, query = _mixed_step(dtype)
    scale = D ** -0.5
    kv = {}
    if pass_kv:
        slots = md.slot_mapping
        kv = dict(key=k_cache.view(-1, KVH, D)[slots], value=v_cache.view(-1, KVH, D)[slots])   # [T, KVH, D]
    out = TorchAttentionBackend.attention(query, k_cache, v_cache, md, scale, **kv)
    plan = md.backend_plan
    assert isinstance(plan.single, ab._SingleRowBatch if native else ab._GatheredSingleRowBatch)
    if native_multi:                                      # the flash kernel: row chunks do not apply
        assert isinstance(plan.multi, ab._NativeMultiRowBatch) and plan.multi.query_start.numel() == 4
    else:
        assert [(c.r0, c.r1) for c in plan.causal] == [(0, 37)]
        if chunk_elems == 64:
            assert len(plan.multi) == 2 and not plan.masked and all(len(seq.chunks) > 1 for seq in plan.multi)
        else:
            assert len(plan.multi) == 1 and [m.slots.numel() for m in plan.masked] == [29]
            assert [(c.r0, c.r1, c.mask.shape[1]) for c in plan.masked[0].chunks] == [(37, 42, 22), (42, 47, 27), (47, 49, 29)]
    # a second layer reuses the plan
    again = TorchAttentionBackend.attention(query, k_cache, v_cache, md, scale, **kv)
    assert md.backend_plan is plan and torch.equal(out, again)
    ref = _reference(query, k_cache, v_cache, _rows_of_seq(md), md.positions.tolist(), tables, scale)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


# windows of 1 key, across blocks (BS = 4), the decode sequence's length (9), the extend's (29) and
# past every sequence (max length 50); alone, with a softcap, and a softcap alone
WINDOW_CAP = [(1, None), (5, None), (9, None), (29, None), (64, None), (5, 2.0), (29, 2.0), (None, 2.0)]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("native,native_multi", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("masked_sdpa", [True, False])
@pytest.mark.parametrize("window,cap", WINDOW_CAP)
def test_window_and_softcap_match_dense_reference(monkeypatch, dtype, atol, native, native_multi, masked_sdpa,
                                                  window, cap):
    """A mixed step (prefill from position 0, extend after cached keys, sparse rows, decodes of
    different lengths) on every path: the native kernels; without the flash kernel, masked SDPA for
    every multi-row sequence the window reaches into (`masked_sdpa`: the mask budget fits them all)
    or else GEMM row chunks, small ones here; a softcap sends them all to the row chunks."""
    _use_paths(monkeypatch, native, native_multi)
    monkeypatch.setattr(ab, "_CHUNK_SCORE_ELEMS", 64)
    monkeypatch.setattr(ab, "_MIN_CHUNK", 4)
    monkeypatch.setattr(ab, "_MAX_SDPA_MASK_ELEMS", 1 << 24 if masked_sdpa else 0)
    monkeypatch.setattr(ab, "_SDPA_CHUNK_ROWS", 5)
    md, tables, k_cache, v_cache, query = _mixed_step(dtype)
    kv = dict(key=k_cache.view(-1, KVH, D)[md.slot_mapping], value=v_cache.view(-1, KVH, D)[md.slot_mapping])
    scale = D ** -0.5
    out = TorchAttentionBackend.attention(query, k_cache, v_cache, md, scale, **kv,
                                          sliding_window=window, logits_soft_cap=cap)
    assert md.backend_plan is None and list(md.variant_plans) == [(window, cap is not None)]
    plan = md.variant_plans[(window, cap is not None)]
    if not native_multi:
        prefill_windowed = window is not None and window < 37
        assert len(plan.causal) == (cap is None and not prefill_windowed)
        if cap is not None or not masked_sdpa:        # every other multi-row sequence as row chunks
            assert not plan.masked and len(plan.multi) == 3 - len(plan.causal)
        else:
            assert not plan.multi and len(plan.masked) == 3 - len(plan.causal)
    ref = _dense_reference(query, k_cache, v_cache, _rows_of_seq(md), md.positions.tolist(), tables, scale,
                           window, cap)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("native,native_multi", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("masked_sdpa", [True, False])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_window_covering_every_key_is_exactly_no_window(monkeypatch, dtype, native, native_multi, masked_sdpa, cap):
    """A window as long as the longest sequence (50) or longer hides nothing: bit-identical output and
    the same plan (a fresh prefill still goes to causal SDPA)."""
    _use_paths(monkeypatch, native, native_multi)
    monkeypatch.setattr(ab, "_MAX_SDPA_MASK_ELEMS", 1 << 24 if masked_sdpa else 0)
    monkeypatch.setattr(ab, "_SDPA_CHUNK_ROWS", 5)
    md, _, k_cache, v_cache, query = _mixed_step(dtype)
    plain = TorchAttentionBackend.attention(query, k_cache, v_cache, md, 0.3, logits_soft_cap=cap)
    for window in (50, 51, 10_000):
        md_w = _mixed_step(dtype)[0]
        out = TorchAttentionBackend.attention(query, k_cache, v_cache, md_w, 0.3, sliding_window=window,
                                              logits_soft_cap=cap)
        assert torch.equal(out, plain)
        plan = md_w.variant_plans[(window, cap is not None)]
        assert len(plan.causal) == (not native_multi and cap is None)


def test_sliding_and_global_layers_keep_one_plan_each():
    """Layers alternating global / sliding (and softcapped) attention build one plan per kind a
    step, each reused by the later layers of its kind; a row subset starts without any."""
    md, _, k_cache, v_cache, query = _mixed_step(torch.float32)
    run = lambda m, q, **kw: TorchAttentionBackend.attention(q, k_cache, v_cache, m, 0.3, **kw)
    layers = lambda: [run(md, query), run(md, query, sliding_window=8),
                      run(md, query, sliding_window=8, logits_soft_cap=5.0)]
    first = layers()
    plans = md.backend_plan, dict(md.variant_plans)
    assert list(plans[1]) == [(8, False), (8, True)]
    for _ in range(2):                                   # the next layers
        again = layers()
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert md.backend_plan is plans[0] and md.variant_plans == plans[1]
        assert all(md.variant_plans[k] is plans[1][k] for k in plans[1])
    # another cap value reuses the softcapped plan (it depends only on there being a cap)
    run(md, query, sliding_window=8, logits_soft_cap=30.0)
    assert md.variant_plans == plans[1]
    keep = torch.tensor([3, 20, 36, 40, 45, 55, 63])       # rows of the prefill, the extend, the sparse rows, a decode
    sub = md.select_rows(keep)
    assert sub.backend_plan is None and sub.variant_plans is None
    part = run(sub, query[keep], sliding_window=8)
    assert list(sub.variant_plans) == [(8, False)]
    torch.testing.assert_close(part, first[1][keep], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kwargs", [dict(sliding_window=0), dict(sliding_window=-4), dict(sliding_window=2.5),
                                    dict(sliding_window=True), dict(logits_soft_cap=0.0),
                                    dict(logits_soft_cap=-1.0), dict(logits_soft_cap=math.nan),
                                    dict(logits_soft_cap=math.inf)])
def test_rejects_bad_window_or_cap(kwargs):
    md, _, k_cache, v_cache, query = _mixed_step(torch.float32)
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        TorchAttentionBackend.attention(query, k_cache, v_cache, md, 0.3, **kwargs)


@pytest.mark.parametrize("native,native_multi", [(True, False), (False, False)])
@pytest.mark.parametrize("masked_sdpa", [True, False])
@pytest.mark.parametrize("cap", [None, 2.0])
def test_window_reads_no_key_before_it(monkeypatch, native, native_multi, masked_sdpa, cap):
    """The keys before every row's window of a sequence are never read (a long prompt on a sliding
    layer costs O(window) per row): NaN there leaves the output exact. The flash kernel reads from the
    64-key block holding a tile's first key: tests/test_cpu_kernels.py checks it on longer sequences."""
    _use_paths(monkeypatch, native, native_multi)
    monkeypatch.setattr(ab, "_CHUNK_SCORE_ELEMS", 64)
    monkeypatch.setattr(ab, "_MIN_CHUNK", 4)
    monkeypatch.setattr(ab, "_MAX_SDPA_MASK_ELEMS", 1 << 24 if masked_sdpa else 0)
    window = 6
    # block 0 holds no sequence's keys: the gathered decode path pads with slot 0
    md, tables, k_cache, v_cache, query = _mixed_step(torch.float32, num_blocks=65, first_block=1)
    ref = _dense_reference(query, k_cache, v_cache, _rows_of_seq(md), md.positions.tolist(), tables, 0.3,
                           window, cap)
    for s, rows in enumerate(_rows_of_seq(md)):
        first_key = min(md.positions[rows.start:rows.stop].tolist()) + 1 - window
        for p in range(first_key):                       # keys before every row's window
            k_cache[tables[s][p // BS], p % BS] = float("nan")
            v_cache[tables[s][p // BS], p % BS] = float("nan")
    out = TorchAttentionBackend.attention(query, k_cache, v_cache, md, 0.3, sliding_window=window,
                                          logits_soft_cap=cap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


def test_select_rows_gets_a_fresh_plan():
    g = torch.Generator().manual_seed(1)
    md = _metadata([list(range(20))], [20], [[3, 1, 0, 4, 2]])
    k_cache = torch.randn(5, BS, KVH, D, generator=g)
    v_cache = torch.randn(5, BS, KVH, D, generator=g)
    query = torch.randn(20, H, D, generator=g)
    full = TorchAttentionBackend.attention(query, k_cache, v_cache, md, 0.25)
    keep = torch.tensor([2, 7, 19])
    sub = md.select_rows(keep)
    assert sub.backend_plan is None
    part = TorchAttentionBackend.attention(query[keep], k_cache, v_cache, sub, 0.25)
    torch.testing.assert_close(part, full[keep], atol=1e-5, rtol=0)


def test_select_rows_with_given_counts_matches_the_derived_ones():
    md = _metadata([list(range(6)), list(range(10))], [6, 10], [[0, 1], [2, 3, 4]])
    keep = torch.tensor([1, 4, 6, 9, 15])
    derived = md.select_rows(keep)
    given = md.select_rows(keep, [2, 3])
    assert derived.cu_seqlens_q_cpu == given.cu_seqlens_q_cpu == [0, 2, 5]
    assert given.cu_seqlens_q.tolist() == [0, 2, 5] and given.cu_seqlens_q.dtype == torch.int32
    assert derived.max_seqlen_q == given.max_seqlen_q == 3
    with pytest.raises(ValueError, match="rows_per_seq"):
        md.select_rows(keep, [3, 3])


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("native_bf16", [False, True])
def test_sparse_rows_compute_in_float32_where_bf16_gemms_are_emulated(monkeypatch, native_bf16, masked):
    """bf16 GEMMs on a CPU without native bf16 (AVX2) ran 20-75x slower than float32 at 0.5-4k keys:
    the row chunks and the masked SDPA then compute in float32 and round the output to bf16 once."""
    monkeypatch.setattr(ab, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(cpu_kernels, "multi_row_preferred", lambda: False)
    monkeypatch.setattr(ab, "_MAX_SDPA_MASK_ELEMS", 1 << 24 if masked else 0)
    g = torch.Generator().manual_seed(2)
    rows, tables = [[3, 9, 14, 15]], [[2, 0, 3, 1]]      # sparse rows: masked SDPA or row chunks
    md = _metadata(rows, [16], tables)
    k_cache = torch.randn(4, BS, KVH, D, generator=g).bfloat16()
    v_cache = torch.randn(4, BS, KVH, D, generator=g).bfloat16()
    query = torch.randn(4, H, D, generator=g).bfloat16()
    out = TorchAttentionBackend.attention(query, k_cache, v_cache, md, 0.25)
    plan = md.backend_plan
    want = torch.bfloat16 if native_bf16 else torch.float32
    assert plan.gemm_dtype == want and not plan.causal
    assert [c.mask.dtype for m in plan.masked for c in m.chunks] == ([want] if masked else [])
    assert len(plan.multi) == (not masked)
    assert out.dtype == torch.bfloat16
    ref = _reference(query, k_cache, v_cache, [range(4)], md.positions.tolist(), tables, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=3e-2, rtol=0)


@pytest.mark.parametrize("capability,preferred", [("AVX512", True), ("AVX2", False), ("DEFAULT", False)])
def test_flash_kernel_only_where_avx512(monkeypatch, capability, preferred):
    """The multi-row kernel's 512-bit vectors spill on AVX2 (2-4.5x slower than the GEMM chunks there):
    it is chosen by the CPU torch reports."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    cpu_kernels.multi_row_preferred.cache_clear()
    try:
        assert cpu_kernels.multi_row_preferred() is preferred
    finally:
        cpu_kernels.multi_row_preferred.cache_clear()
