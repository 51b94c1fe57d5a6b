"""Triton kernels (attention, KV store, K/V re-rotation) against the torch reference.

The Triton tests need triton and CUDA (or TRITON_INTERPRET=1, which runs the kernels on CPU tensors,
slowly); they are skipped otherwise. The re-rotation reference test runs on CPU everywhere (CI).
Inputs are random (never zeros) and outputs are poisoned with NaN first, so an unwritten element fails.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from sparsex.layers.attention_backend import TorchAttentionBackend
from sparsex.layers.attention_metadata import AttentionMetadata
from sparsex.layers.triton_rerotate import copy_and_rerotate_torch

# relative-norm tolerances: fp32 runs through tf32 tensor cores (tf32_dots below); bf16 operands land near 4e-3
TOL = {torch.float32: 2e-3, torch.bfloat16: 1.5e-2, torch.float16: 5e-3}


@pytest.fixture(autouse=True)
def tf32_dots():
    """The kernels' logic is under test, not fp32 rounding: their fp32 dots run as tf32 here (about 7x
    faster to compile and run than full fp32, which tests/test_gpu_model_families.py covers end to end)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(before)


# (num_heads, num_kv_heads): GQA ratios 1, 3, 4, 8
GQA = [(4, 4), (6, 2), (8, 2), (16, 2)]


@pytest.fixture
def device() -> torch.device:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    pytest.skip("Triton kernels need CUDA (or TRITON_INTERPRET=1)")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float().cpu(), ref.float().cpu()          # references may be computed on the CPU
    return ((out - ref).norm() / ref.norm()).item()


def make_batch(
    seqs: list[tuple[int, torch.Tensor]],     # per sequence: (seq_len, absolute positions of its query rows)
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, device: torch.device, contiguous: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random query rows and a filled paged cache whose blocks are scattered (a shuffled block pool)."""
    blocks_per_seq = [(n + block_size - 1) // block_size for n, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    pool = torch.randperm(num_blocks)                                     # physical blocks, shuffled
    max_blocks = max(blocks_per_seq)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)   # garbage beyond seq_len too
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    used = 0
    slot_rows, positions, cu = [], [], [0]
    for s, ((n, rows), nb) in enumerate(zip(seqs, blocks_per_seq)):
        block_tables[s, :nb] = pool[used:used + nb].int()
        used += nb
        rows = rows.to(torch.int64)
        slot_rows.append(block_tables[s, rows // block_size].long() * block_size + rows % block_size)
        positions.append(rows)
        cu.append(cu[-1] + rows.numel())
    num_tokens = cu[-1]
    query = torch.randn(num_tokens, num_heads, head_dim).to(dtype)
    seq_lens = [n for n, _ in seqs]
    md = AttentionMetadata(
        positions=torch.cat(positions).to(device),
        slot_mapping=torch.cat(slot_rows).to(device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
        max_seq_len=max(seq_lens),
        cu_seqlens_q_cpu=cu,
        seq_lens_cpu=seq_lens,
        contiguous=contiguous,
    )
    return query.to(device), k_cache.to(device), v_cache.to(device), md


def reference(query, k_cache, v_cache, md, scale) -> torch.Tensor:
    """TorchAttentionBackend on fp32 copies: the exact answer the kernels approximate."""
    return TorchAttentionBackend.attention(query.float(), k_cache.float(), v_cache.float(), md, scale)


def check_attention(seqs, heads, head_dim, dtype, device, contiguous, block_size=16, decode=False):
    from sparsex.layers import triton_attention as ta

    num_heads, num_kv_heads = heads
    query, k_cache, v_cache, md = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size,
                                             dtype, device, contiguous)
    scale = 1.0 / math.sqrt(head_dim)
    ref = reference(query, k_cache, v_cache, md, scale)
    # prefill: from the paged cache and from a contiguous copy of the keys (TMA on Hopper)
    for gather in (None,) if decode else (False, True):
        out = torch.full_like(query, float("nan"))
        if decode:
            ta.decode_attention(query, k_cache, v_cache, md, scale, out=out)
        else:
            ta.prefill_attention(query, k_cache, v_cache, md, scale, out=out, gather=gather)
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"gather={gather}: rel err {err:.2e}"
    # the backend's own dispatch gives the same result
    again = ta.TritonAttentionBackend.attention(query, k_cache, v_cache, md, scale)
    assert rel_err(again, ref) < TOL[dtype]
    return err


def full_rows(n: int) -> torch.Tensor:
    return torch.arange(n)


def tail_rows(n: int, q: int) -> torch.Tensor:
    return torch.arange(n - q, n)


def sparse_rows(n: int, frac: float, tail: int, gen: torch.Generator) -> torch.Tensor:
    """A random subset of the prompt's positions plus its last `tail` positions, sorted."""
    body = torch.randperm(n - tail, generator=gen)[: int(frac * (n - tail))]
    return torch.cat((body.sort().values, torch.arange(n - tail, n)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA)
def test_prefill_ragged(device, heads, head_dim, dtype):
    # block-unaligned lengths, a 1-token prompt, and one longer than several key tiles
    seqs = [(n, full_rows(n)) for n in (1, 17, 100, 333)]
    check_attention(seqs, heads, head_dim, dtype, device, contiguous=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", GQA)
def test_extend_after_prefix_hit(device, heads, dtype):
    # queries only for the tail: chunked prefill / prefix-cache hit; one chunk of a single row
    seqs = [(300, tail_rows(300, 45)), (129, tail_rows(129, 1)), (520, tail_rows(520, 200)), (64, tail_rows(64, 64))]
    check_attention(seqs, heads, 128, dtype, device, contiguous=True, block_size=32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA)
def test_sparse_rows(device, heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(heads[0] * 1000 + head_dim)
    shapes = ((700, 0.15, 16), (257, 0.3, 1), (1500, 0.05, 64))          # (prompt length, fraction, tail rows)
    seqs = [(n, sparse_rows(n, frac, tail, gen)) for n, frac, tail in shapes]
    check_attention(seqs, heads, head_dim, dtype, device, contiguous=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_rows_with_empty_sequence(device, dtype):
    # select_rows can leave a sequence with no rows; rows need not be sorted either
    gen = torch.Generator().manual_seed(7)
    rows = sparse_rows(400, 0.2, 8, gen)
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    seqs = [(50, torch.empty(0, dtype=torch.int64)), (400, rows), (90, torch.empty(0, dtype=torch.int64))]
    check_attention(seqs, (8, 2), 128, dtype, device, contiguous=False)


@pytest.mark.gpu
def test_sparse_rows_long_prompt_two_sequences(device):
    # several key tiles per query tile, two sequences of different lengths in one gathered copy
    # (the shorter one's padding blocks are copied but must never be read)
    gen = torch.Generator().manual_seed(11)
    seqs = [(3000, sparse_rows(3000, 0.2, 48, gen)), (1100, sparse_rows(1100, 0.5, 16, gen))]
    check_attention(seqs, (32, 8), 128, torch.bfloat16, device, contiguous=False)


@pytest.mark.gpu
def test_gather_pays_only_for_many_rows_per_key(device):
    from sparsex.layers import triton_attention as ta

    def md_for(seqs):
        return make_batch(seqs, 8, 2, 64, 16, torch.bfloat16, device, contiguous=False)[3]
    gen = torch.Generator().manual_seed(3)
    big = md_for([(8192, sparse_rows(8192, 0.15, 64, gen))])        # ~1.3k rows over 8k keys: pays
    assert ta.gather_pays(big, big.cu_seqlens_q_cpu[-1], 16)
    few = md_for([(8192, tail_rows(8192, 300))])                     # too few rows to repay the copy
    assert not ta.gather_pays(few, few.cu_seqlens_q_cpu[-1], 16)
    # many rows, but spread over many short sequences padded to the longest: the copy is mostly padding
    mixed = md_for([(8192, tail_rows(8192, 1))] + [(64, full_rows(64))] * 12)
    assert not ta.gather_pays(mixed, mixed.cu_seqlens_q_cpu[-1], 16)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", GQA)
def test_mixed_decode_and_prefill_rows(device, heads):
    # decode rows and prefill chunks in one step go through the varlen kernel
    seqs = [(1000, tail_rows(1000, 1)), (77, full_rows(77)), (2048, tail_rows(2048, 1)), (300, tail_rows(300, 30))]
    check_attention(seqs, heads, 128, torch.bfloat16, device, contiguous=True, block_size=64)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA)
def test_decode(device, heads, head_dim, dtype):
    # long and short contexts in one batch: split-K with some splits empty for the short ones
    lens = (1, 15, 16, 17, 4000, 12345)
    seqs = [(n, tail_rows(n, 1)) for n in lens]
    check_attention(seqs, heads, head_dim, dtype, device, contiguous=True, decode=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_decode_split_counts(device, num_splits):
    from sparsex.layers import triton_attention as ta

    seqs = [(n, tail_rows(n, 1)) for n in (5, 700, 3001)]
    query, k_cache, v_cache, md = make_batch(seqs, 32, 8, 128, 16, torch.bfloat16, device, True)
    ref = reference(query, k_cache, v_cache, md, 0.1)
    out = ta.decode_attention(query, k_cache, v_cache, md, 0.1, num_splits=num_splits)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv(device, dtype):
    from sparsex.layers.triton_attention import TritonAttentionBackend

    num_blocks, block_size, num_kv_heads, head_dim = 9, 16, 3, 64       # 3 heads: padded head tile
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, device=device)[:50]
    key = torch.randn(50, num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn(50, num_kv_heads, head_dim, device=device).to(dtype)
    TorchAttentionBackend.store_kv(key, value, k_ref, v_ref, slots)
    TritonAttentionBackend.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# ---- sliding window and softcapped logits (Gemma 2/3, Mistral) ---------------------------------------
# fp32 and fp16 run everywhere (the interpreter too); bf16 only on CUDA: the Triton 3.9 interpreter's
# bf16 tl.dot returns garbage (the bf16 cases of the tests above fail under it as well)
WINDOW_DTYPES = [torch.float32, torch.float16,
                 pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
                     not torch.cuda.is_available(), reason="bf16 tl.dot is broken in the Triton interpreter"))]


def dense_reference(query, k_cache, v_cache, md, scale, window=None, cap=None) -> torch.Tensor:
    """HF eager attention in float64, per sequence: scores s = q.k * scale, softcapped to
    cap * tanh(s / cap), keys j > i (and, with a window, j <= i - window) at -inf, softmax, P.V."""
    num_kv_heads, head_dim, bs = k_cache.shape[2], k_cache.shape[3], k_cache.shape[1]
    group = query.shape[1] // num_kv_heads
    k_flat = k_cache.cpu().double().reshape(-1, num_kv_heads, head_dim)
    v_flat = v_cache.cpu().double().reshape(-1, num_kv_heads, head_dim)
    q_all, positions, tables = query.cpu().double(), md.positions.cpu(), md.block_tables.cpu().long()
    out = torch.zeros(q_all.shape, dtype=torch.float64)
    cu = md.cu_seqlens_q_cpu
    for s in range(md.num_seqs):
        if cu[s + 1] == cu[s]:
            continue
        pos = positions[cu[s]:cu[s + 1]]                                      # [rows]
        keys = torch.arange(int(pos.max()) + 1)
        slots = tables[s, keys // bs] * bs + keys % bs
        k = k_flat[slots].repeat_interleave(group, dim=1)                     # [n, H, D]
        v = v_flat[slots].repeat_interleave(group, dim=1)
        att = torch.einsum("thd,nhd->thn", q_all[cu[s]:cu[s + 1]], k) * scale  # [rows, H, n]
        if cap is not None:
            att = cap * torch.tanh(att / cap)
        hidden = keys[None, None, :] > pos[:, None, None]
        if window is not None:
            hidden |= keys[None, None, :] <= pos[:, None, None] - window
        out[cu[s]:cu[s + 1]] = torch.einsum("thn,nhd->thd", att.masked_fill(hidden, float("-inf")).softmax(-1), v)
    return out


def check_window(seqs, heads, head_dim, dtype, device, contiguous, window, cap, decode_splits=None, scale=None,
                 poison=False):
    """The kernels (prefill from the paged cache and from a gathered copy, or decode with each split
    count) and the backend's dispatch against the dense reference. `poison`: NaN in every key and value
    before the window of every row of its sequence first, so that reading one shows."""
    from sparsex.layers import triton_attention as ta

    query, k_cache, v_cache, md = make_batch(seqs, heads[0], heads[1], head_dim, 16, dtype, device, contiguous)
    scale = head_dim ** -0.5 if scale is None else scale
    ref = dense_reference(query, k_cache, v_cache, md, scale, window, cap)
    if poison and window is not None:
        cu = md.cu_seqlens_q_cpu
        for s in range(md.num_seqs):
            if cu[s + 1] == cu[s]:
                continue
            first = int(md.positions[cu[s]:cu[s + 1]].min()) + 1 - window
            for p in range(max(first, 0)):
                blk = int(md.block_tables[s, p // 16])
                k_cache[blk, p % 16] = float("nan")
                v_cache[blk, p % 16] = float("nan")
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    runs = {}
    if decode_splits is None:
        for gather in (False, True):
            out = torch.full_like(query, float("nan"))
            runs[f"gather={gather}"] = ta.prefill_attention(query, k_cache, v_cache, md, scale, out=out,
                                                            gather=gather, **kw)
    else:
        for n in decode_splits:
            out = torch.full_like(query, float("nan"))
            runs[f"splits={n}"] = ta.decode_attention(query, k_cache, v_cache, md, scale, out=out, num_splits=n, **kw)
    runs["backend"] = ta.TritonAttentionBackend.attention(query, k_cache, v_cache, md, scale, **kw)
    for name, out in runs.items():
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"{name}: rel err {err:.2e}"
    return query, k_cache, v_cache, md, ref


# windows of 1 key, inside a key block, across blocks, as long as the prefill (70), past every sequence;
# alone, with a softcap, and a softcap alone
WINDOW_CAP = [(1, None), (16, None), (37, 2.0), (70, None), (1000, 2.0), (None, 2.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", WINDOW_DTYPES)
@pytest.mark.parametrize("window,cap", WINDOW_CAP)
def test_window_softcap_prefill_and_extend(device, window, cap, dtype):
    # a prefill from position 0, an extend after 130 cached keys, a one-row chunk mixed in
    seqs = [(70, full_rows(70)), (150, tail_rows(150, 20)), (90, tail_rows(90, 1))]
    check_window(seqs, (6, 2), 32, dtype, device, True, window, cap)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 64), ((8, 1), 32), ((4, 1), 256)])   # MHA, GQA 8, Gemma 3 270M
@pytest.mark.parametrize("window,cap", [(24, None), (24, 3.0)])
def test_window_softcap_heads(device, heads, head_dim, window, cap):
    seqs = [(100, full_rows(100)), (61, tail_rows(61, 7))]
    check_window(seqs, heads, head_dim, torch.float32, device, True, window, cap)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", WINDOW_DTYPES)
@pytest.mark.parametrize("window,cap", [(16, None), (50, 2.0), (None, 2.0)])
def test_window_softcap_sparse_rows(device, window, cap, dtype):
    # rows scattered through the prompt (unsorted in one sequence), a sequence left without rows
    gen = torch.Generator().manual_seed(5)
    rows = sparse_rows(260, 0.15, 8, gen)
    seqs = [(260, rows[torch.randperm(rows.numel(), generator=gen)]), (40, torch.empty(0, dtype=torch.int64)),
            (120, sparse_rows(120, 0.3, 1, gen))]
    check_window(seqs, (6, 2), 32, dtype, device, False, window, cap)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", WINDOW_DTYPES)
@pytest.mark.parametrize("window,cap", [(1, None), (20, 2.0), (100, None), (5000, 2.0), (None, 2.0)])
def test_window_softcap_decode(device, window, cap, dtype):
    # split counts of 1, 3 and 16: with a window the splits share its keys, and those past them (all
    # but one or two for the short windows) are empty and must weigh nothing in the merge
    seqs = [(n, tail_rows(n, 1)) for n in (1, 15, 40, 300)]
    check_window(seqs, (4, 2), 32, dtype, device, True, window, cap, decode_splits=(None, 1, 3, 16))


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [None, 2.0])
def test_window_reads_no_key_before_it(device, cap):
    """NaN in every key and value before each row's window (of each sequence): the output stays exact,
    for prefill, extend, sparse rows and split decode."""
    gen = torch.Generator().manual_seed(9)
    cases = [([(70, full_rows(70))], True), ([(200, tail_rows(200, 12))], True),
             ([(300, sparse_rows(300, 0.1, 4, gen))], False)]
    for seqs, contiguous in cases:
        check_window(seqs, (4, 2), 32, torch.float32, device, contiguous, 40, cap, poison=True)
    check_window([(n, tail_rows(n, 1)) for n in (30, 333, 1000)], (4, 2), 32, torch.float32, device, True, 40, cap,
                 decode_splits=(1, 4), poison=True)


@pytest.mark.gpu
def test_window_skips_key_blocks_before_it(device, monkeypatch):
    """A sliding layer's cost is O(window) per row at any length: the key loops start at the tile's
    first visible key (counted by wrapping the key-block step, interpreter only)."""
    from sparsex.layers import triton_attention as ta
    if device.type == "cuda":
        pytest.skip("counts key blocks through the interpreter")
    starts = []
    block = ta._key_block

    def counting(start, *args):
        starts.append(int(start))
        return block.fn(start, *args)
    monkeypatch.setattr(ta, "_key_block", counting)
    # 8 rows at positions 992..999 with a window of 40 see keys 953..999: two key blocks (32 keys in
    # fp32) from 953 for each of the 2 KV heads, not the 32 blocks from key 0
    query, k_cache, v_cache, md = make_batch([(1000, tail_rows(1000, 8))], 4, 2, 32, 16, torch.float32, device, True)
    for gather in (False, True):
        starts.clear()
        ta.prefill_attention(query, k_cache, v_cache, md, 0.2, gather=gather, sliding_window=40)
        assert sorted(starts) == [953, 953, 985, 985], gather
    starts.clear()
    ta.prefill_attention(query, k_cache, v_cache, md, 0.2, gather=False)
    assert len(starts) == 2 * 32                                          # without a window: every block
    # decode at position 999, window 100: keys 900..999, two blocks of 64 keys shared by the splits
    query, k_cache, v_cache, md = make_batch([(1000, tail_rows(1000, 1))], 4, 2, 32, 16, torch.float32, device, True)
    for splits, want in ((1, [900, 964]), (2, [900, 964]), (8, [900, 964])):
        starts.clear()
        ta.decode_attention(query, k_cache, v_cache, md, 0.2, num_splits=splits, sliding_window=100)
        assert sorted(starts) == sorted(want * 2), splits


try:        # a jitted function sees module globals only: the softcap's tanh under test is defined here
    import triton
    import triton.language as tl

    from sparsex.layers.triton_attention import _tanh

    @triton.jit
    def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(y_ptr + offs, _tanh(x), mask=offs < n)
except ImportError:
    _tanh_kernel = None


@pytest.mark.gpu
def test_softcap_tanh_is_accurate(device):
    """The kernels' tanh (tl has none) to 1e-6 relative over the whole range, saturating without NaN."""
    x = torch.cat([torch.linspace(-12, 12, 20001), torch.logspace(-30, 2, 400), torch.linspace(0.39, 0.41, 401),
                   torch.tensor([0.0, 0.4, 3.0e4, 1e30, float("inf")])])
    x = torch.cat([x, -x]).float()
    y = torch.empty_like(x, device=device)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x.to(device), y, x.numel(), BLOCK=1024)
    want = torch.tanh(x.double())
    y = y.cpu().double()
    assert not torch.isnan(y).any()
    rel = ((y - want).abs() / want.abs().clamp_min(1e-300))[want != 0]
    assert rel.max().item() < 1e-6, rel.max().item()
    assert torch.equal(y[x == 0], torch.zeros_like(y[x == 0]))


@pytest.mark.gpu
def test_window_or_softcap_keeps_off_causal_sdpa(device, monkeypatch):
    """The plain-prefill shortcut (torch's causal SDPA) neither caps nor slides: taken with neither,
    or with a window that hides nothing (every sequence fits in it), never otherwise."""
    from sparsex.layers import triton_attention as ta

    taken = []
    sdpa = ta._causal_sdpa
    monkeypatch.setattr(ta, "_causal_sdpa", lambda *a: taken.append(1) or sdpa(*a))
    seqs = [(60, full_rows(60)), (77, tail_rows(77, 60))]                 # a prefill, a short cached prefix
    query, k_cache, v_cache, md = make_batch(seqs, 4, 2, 32, 16, torch.float16, device, True)
    assert ta._short_prefix_lens(md) is not None
    key = k_cache.view(-1, 2, 32)[md.slot_mapping]
    value = v_cache.view(-1, 2, 32)[md.slot_mapping]
    for window, cap, via_sdpa in ((None, None, True), (77, None, True), (5000, None, True), (76, None, False),
                                  (16, None, False), (None, 2.0, False), (5000, 2.0, False)):
        taken.clear()
        out = ta.TritonAttentionBackend.attention(query, k_cache, v_cache, md, 0.2, key=key, value=value,
                                                  sliding_window=window, logits_soft_cap=cap)
        assert bool(taken) == via_sdpa, (window, cap)
        ref = dense_reference(query, k_cache, v_cache, md, 0.2, window, cap)
        assert rel_err(out, ref) < TOL[torch.float16], (window, cap)


@pytest.mark.gpu
def test_fixed_split_graph_backend_window_and_softcap(device):
    """The CUDA-graph decode backend (a fixed split count) runs sliding and softcapped layers, with
    no more splits than the window needs; plain layers exactly as decode_attention."""
    from sparsex.engine.cuda_graph import FixedSplitDecodeBackend
    from sparsex.layers import triton_attention as ta

    assert ta.window_num_splits(64, None) == 64 and ta.window_num_splits(64, 20) == 1
    assert ta.window_num_splits(64, 1000) == 8 and ta.window_num_splits(4, 1000) == 4
    backend = FixedSplitDecodeBackend(16)
    seqs = [(n, tail_rows(n, 1)) for n in (1, 50, 700)]
    query, k_cache, v_cache, md = make_batch(seqs, 4, 2, 32, 16, torch.float32, device, True)
    for window, cap in ((None, None), (20, None), (200, 2.0), (None, 5.0)):
        out = backend.attention(query, k_cache, v_cache, md, 0.2, sliding_window=window, logits_soft_cap=cap)
        assert rel_err(out, dense_reference(query, k_cache, v_cache, md, 0.2, window, cap)) < TOL[torch.float32]
        if window is None and cap is None:
            assert torch.equal(out, ta.decode_attention(query, k_cache, v_cache, md, 0.2, num_splits=16))


@pytest.mark.unit
@pytest.mark.parametrize("kwargs", [dict(sliding_window=0), dict(sliding_window=-4), dict(sliding_window=2.5),
                                    dict(sliding_window=True), dict(logits_soft_cap=0.0),
                                    dict(logits_soft_cap=-1.0), dict(logits_soft_cap=math.nan),
                                    dict(logits_soft_cap=math.inf)])
def test_rejects_bad_window_or_cap(kwargs):
    """As the torch backend: ValueError naming the option, before any kernel runs (CPU tensors here)."""
    pytest.importorskip("triton")
    from sparsex.engine.cuda_graph import FixedSplitDecodeBackend
    from sparsex.layers import triton_attention as ta

    name = next(iter(kwargs))
    prefill = make_batch([(20, full_rows(20))], 4, 2, 32, 16, torch.float32, torch.device("cpu"), True)
    decode = make_batch([(20, tail_rows(20, 1))], 4, 2, 32, 16, torch.float32, torch.device("cpu"), True)
    calls = [lambda: ta.TritonAttentionBackend.attention(*prefill, 0.2, **kwargs),
             lambda: ta.TritonAttentionBackend.attention(*decode, 0.2, **kwargs),
             lambda: FixedSplitDecodeBackend(4).attention(*decode, 0.2, **kwargs),
             lambda: ta.prefill_attention(*prefill, 0.2, **kwargs),
             lambda: ta.decode_attention(*decode, 0.2, **kwargs)]
    for call in calls:
        with pytest.raises(ValueError, match=name):
            call()


# ---- re-rotation ----------------------------------------------------------------------------


def rope_f64(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE in float64: x [n, heads, D] at positions pos [n] (rotary part = 2*len(inv_freq))."""
    half = inv_freq.numel()
    ang = pos.double()[:, None] * inv_freq.double()[None, :]             # [n, half]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x = x.double()
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s, rest), dim=-1)


def rerotate_case(dtype: torch.dtype, head_dim: int, rot_dim: int, device: torch.device, fn) -> float:
    gen = torch.Generator().manual_seed(head_dim + rot_dim)
    num_blocks, block_size, num_kv_heads = 64, 16, 4
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))   # [rot/2], Llama-3 theta
    n = 300
    raw = torch.randn(n, num_kv_heads, head_dim, generator=gen)           # un-rotated keys
    a = torch.randint(0, 30000, (n,), generator=gen)                      # old positions
    b = torch.randint(0, 30000, (n,), generator=gen)                      # new positions
    slots = torch.randperm(num_blocks * block_size, generator=gen)
    src, dst = slots[:n], slots[n:2 * n]                                  # disjoint
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_cache.view(-1, num_kv_heads, head_dim)[src] = rope_f64(raw, a, inv_freq).to(dtype)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[dst] = False
    k_before, v_before = k_cache.clone(), v_cache.clone()
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    fn(k_cache, v_cache, src.to(device), dst.to(device), (b - a).to(device), inv_freq.to(device))
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    k_flat, v_flat = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    want = rope_f64(raw, b, inv_freq)                                     # the key computed at its new position
    assert torch.equal(v_flat[dst], v_before.view(-1, num_kv_heads, head_dim)[src])
    assert torch.equal(k_flat[untouched], k_before.view(-1, num_kv_heads, head_dim)[untouched])
    assert torch.equal(v_flat[untouched], v_before.view(-1, num_kv_heads, head_dim)[untouched])
    return rel_err(k_flat[dst], want)


@pytest.mark.unit
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (128, 64)])
def test_rerotate_torch_matches_rope_at_new_position(head_dim, rot_dim):
    assert rerotate_case(torch.float32, head_dim, rot_dim, torch.device("cpu"), copy_and_rerotate_torch) < 1e-5
    assert rerotate_case(torch.bfloat16, head_dim, rot_dim, torch.device("cpu"), copy_and_rerotate_torch) < 1e-2


@pytest.mark.unit
def test_rerotate_torch_round_trip_and_in_place():
    # rotating by +d then -d in place gives the key back (rows moved onto themselves)
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(8, 16, 2, 64, generator=gen)
    v_cache = torch.randn(8, 16, 2, 64, generator=gen)
    k0, v0 = k_cache.clone(), v_cache.clone()
    slots = torch.arange(0, 128, 3)
    delta = torch.randint(-5000, 5000, (slots.numel(),), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    copy_and_rerotate_torch(k_cache, v_cache, slots, slots, delta, inv_freq)
    assert not torch.allclose(k_cache, k0)
    copy_and_rerotate_torch(k_cache, v_cache, slots, slots, -delta, inv_freq)
    assert torch.allclose(k_cache, k0, atol=1e-5) and torch.equal(v_cache, v0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (128, 64)])
def test_rerotate_triton(device, dtype, head_dim, rot_dim):
    from sparsex.layers.triton_rerotate import LayerPointers, copy_and_rerotate_layers

    def one_layer(k_cache, v_cache, *plan):
        copy_and_rerotate_layers(LayerPointers([(k_cache, v_cache)]), *plan)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rerotate_case(dtype, head_dim, rot_dim, device, one_layer) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 64)])
def test_rerotate_every_layer_in_one_launch_equals_one_launch_per_layer(device, dtype, head_dim, rot_dim):
    """copy_and_rerotate_layers over three layers (one launch, caches found through address tables)
    writes exactly what one launch per layer writes, and nothing else: each layer's own K/V."""
    from sparsex.layers.triton_rerotate import LayerPointers, copy_and_rerotate_layers
    gen = torch.Generator().manual_seed(11)
    shape = (40, 16, 4, head_dim)
    caches = [(torch.randn(shape, generator=gen).to(dtype).to(device), torch.randn(shape, generator=gen).to(dtype).to(device))
              for _ in range(3)]
    ref = [(k.clone(), v.clone()) for k, v in caches]
    slots = torch.randperm(shape[0] * shape[1], generator=gen)
    src, dst = slots[:250].to(device), slots[250:500].to(device)
    delta = torch.randint(-20000, 20000, (250,), generator=gen).to(device)
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))).to(device)
    for k, v in ref:
        copy_and_rerotate_layers(LayerPointers([(k, v)]), src, dst, delta, inv_freq)
    copy_and_rerotate_layers(LayerPointers(caches), src, dst, delta, inv_freq)
    for (k, v), (rk, rv) in zip(caches, ref):
        assert torch.equal(k, rk) and torch.equal(v, rv)


@pytest.mark.unit
def test_layer_pointers_refuse_caches_of_different_layouts():
    from sparsex.layers.triton_rerotate import LayerPointers
    a = (torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64))
    with pytest.raises(ValueError, match="layer 0's shape"):
        LayerPointers([a, (torch.zeros(5, 16, 2, 64), torch.zeros(5, 16, 2, 64))])
    assert LayerPointers([a, a]).num_layers == 2


# ---- the selection probe's scores (triton_probe.py) against the torch selectors ----------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (8, 128)])
def test_kv_deviation_matches_torch_selector(device, dtype, num_kv_heads, head_dim):
    """Fresh K/V are strided views of one qkv row (as the model makes them); the copies sit at
    scattered slots of a paged cache."""
    from sparsex.layers.triton_probe import kv_deviation
    from sparsex.segment.selectors import kv_deviation_scores
    gen = torch.Generator().manual_seed(5)
    t, kvd = 300, num_kv_heads * head_dim
    qkv = torch.randn(t, 4 * kvd + kvd + kvd, generator=gen).to(dtype)
    k = qkv[:, 4 * kvd:5 * kvd].view(t, num_kv_heads, head_dim)
    v = qkv[:, 5 * kvd:].view(t, num_kv_heads, head_dim)
    k_cache = torch.randn(30, 16, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(30, 16, num_kv_heads, head_dim, generator=gen).to(dtype)
    slot_mapping = torch.randperm(30 * 16, generator=gen)[:t]
    rows = torch.randperm(t, generator=gen)[:217]
    slots = slot_mapping[rows]
    ref = kv_deviation_scores(k[rows], v[rows], k_cache.view(-1, num_kv_heads, head_dim)[slots],
                              v_cache.view(-1, num_kv_heads, head_dim)[slots])
    to = lambda x: x.to(device)
    out = kv_deviation(to(k), to(v), to(k_cache), to(v_cache), to(rows), to(slot_mapping))
    assert out.shape == (217,) and out.dtype == torch.float32
    assert torch.allclose(out.cpu(), ref, rtol=1e-4, atol=1e-3)
    assert kv_deviation(to(k), to(v), to(k_cache), to(v_cache), to(rows[:0]), to(slot_mapping)).numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 64), ((6, 2), 64), ((32, 8), 128)])
@pytest.mark.parametrize("seq_len,num_query_rows", [(1000, 1), (1000, 40), (437, 130)])
def test_query_key_mass_matches_torch_selector(device, dtype, heads, head_dim, seq_len, num_query_rows):
    """The mean attention probability of some query rows on every key of a sequence, read through a
    shuffled block table, equals selectors.query_attention_mass on the gathered keys (fp32). The
    query rows are the last rows of the step and some sparse rows before them (positions below
    other keys, so the visibility mask matters); the sequence length is not block-aligned."""
    from sparsex.layers.triton_probe import query_key_mass
    from sparsex.segment.selectors import query_attention_mass
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seq_len + num_query_rows)
    rows_pos = sparse_rows(seq_len, 0.2, min(num_query_rows, 24), gen)      # the step's rows
    _, k_cache, _, md = make_batch([(seq_len, rows_pos)], num_heads, num_kv_heads, head_dim, 16,
                                   dtype, torch.device("cpu"), contiguous=False)
    q = torch.randn(rows_pos.numel(), num_heads, head_dim, generator=gen).to(dtype) * 2.0
    query_rows = torch.arange(rows_pos.numel())[-num_query_rows:]
    keys = k_cache[md.block_tables[0].long()].flatten(0, 1)[:seq_len]       # [S, KVH, D] gathered
    scale = head_dim ** -0.5
    ref = query_attention_mass(q[query_rows].float(), keys.float(), md.positions[query_rows], scale)
    to = lambda x: x.to(device)
    out = query_key_mass(to(q), to(query_rows), to(md.positions), to(k_cache), to(md.block_tables[0]),
                         seq_len, scale)
    assert out.shape == (seq_len,) and out.dtype == torch.float32
    assert abs(out.sum().item() - 1.0) < 1e-3                               # a mean of distributions
    tol = 2e-3 if dtype == torch.float32 else 1.5e-2
    assert rel_err(out.cpu(), ref) < tol
    hidden = torch.arange(seq_len) > md.positions[query_rows].max()
    assert torch.all(out.cpu()[hidden] == 0)                                # keys no query row sees


# ---- fused elementwise kernels (triton_fused.py) against the eager torch code they replace ----------
@pytest.fixture
def cuda() -> torch.device:
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        pytest.skip("the fused kernels run on CUDA tensors only")
    return torch.device("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_rms_norm_matches_eager(cuda, dtype, hidden, with_residual):
    from sparsex.layers.layernorm import RMSNorm
    from sparsex.layers.triton_fused import rms_norm
    norm = RMSNorm(hidden, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
    norm = norm.to(dtype)                                  # eager reference on the CPU
    x = torch.randn(37, hidden).to(dtype)
    res = torch.randn(37, hidden).to(dtype) if with_residual else None
    ref = norm(x, res) if with_residual else norm(x)
    out = rms_norm(x.to(cuda), norm.weight.to(cuda), 1e-5, res.to(cuda) if with_residual else None)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    if with_residual:
        assert torch.equal(out[1].cpu(), ref[1])           # the residual sum is the same rounding
        out, ref = out[0], ref[0]
    assert rel_err(out.cpu(), ref) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_and_mul_matches_eager(cuda, dtype):
    from sparsex.layers.triton_fused import silu_and_mul
    gate_up = (3 * torch.randn(29, 2 * 1536)).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = silu_and_mul(gate_up.to(cuda))
    assert rel_err(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads", [(64, 9), (128, 32), (64, 40)])
def test_fused_rope_matches_eager_on_strided_views(cuda, dtype, head_dim, heads):
    from sparsex.layers.rotary_embedding import RotaryEmbedding, rotate
    from sparsex.layers.triton_fused import rope_qk
    rot = RotaryEmbedding(head_dim, 10000.0, None, 4096)
    kv_heads = 3
    qkv = torch.randn(41, (heads + 2 * kv_heads) * head_dim).to(dtype)      # the fused projection's output
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)                 # strided views, as in Attention
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (41,))
    cos, sin = rot.cos_sin(positions)
    rot.build(cuda)
    qkv_d = qkv.to(cuda)
    q_d = qkv_d[:, : heads * head_dim].view(-1, heads, head_dim)
    k_d = qkv_d[:, heads * head_dim: (heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
    outs = rope_qk(q_d, k_d, positions.to(cuda), rot.cos_cache, rot.sin_cache)
    for x, out in zip((q, k), outs):
        assert out.is_contiguous() and out.shape == x.shape
        assert rel_err(out.cpu(), rotate(x, cos, sin)) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert torch.equal(qkv_d.cpu(), qkv)                                     # the inputs are left as they were


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 40, 8)])
def test_rope_and_store_in_one_launch_equals_rope_then_store(device, dtype, head_dim, heads, kv_heads):
    """rope_qk_store writes exactly what rope_qk + store_kv write (q, k and both caches, bit for
    bit), skips negative slots, and leaves every other slot alone."""
    from sparsex.layers.rotary_embedding import RotaryEmbedding
    from sparsex.layers.triton_attention import TritonAttentionBackend
    from sparsex.layers.triton_fused import rope_qk, rope_qk_store
    gen = torch.Generator().manual_seed(head_dim + heads)
    rot = RotaryEmbedding(head_dim, 500000.0, None, 4096)
    rot.build(device)
    t = 37
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(t, heads, head_dim)                 # strided views, as in Attention
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(t, kv_heads, head_dim)
    positions = torch.randint(0, 4096, (t,), generator=gen).to(device)
    slots = torch.randperm(20 * 16, generator=gen)[:t]
    slots[5] = -1                                                            # a padding row
    slots = slots.to(device)
    caches = [torch.randn(20, 16, kv_heads, head_dim, generator=gen).to(dtype).to(device) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    ref_q, ref_k = rope_qk(q, k, positions, rot.cos_cache, rot.sin_cache)
    TritonAttentionBackend.store_kv(ref_k, v, *ref_caches, slots)
    out_q, out_k = rope_qk_store(q, k, v, positions, rot.cos_cache, rot.sin_cache, *caches, slots)
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(caches[0], ref_caches[0]) and torch.equal(caches[1], ref_caches[1])
    with pytest.raises(ValueError, match="disagree"):
        rope_qk_store(q, k, v[:-1], positions, rot.cos_cache, rot.sin_cache, *caches, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [(8, 2), (6, 6)])
def test_plain_prefill_sdpa_dispatch_matches_paged_kernel(cuda, heads):
    """A step whose every sequence computes all its keys, or all but a short cached prefix, takes
    torch's causal SDPA on the fresh K/V (the prefix gathered, zero query rows padded in front); it
    must agree with the paged kernel (and the reference) on the same cache."""
    from sparsex.layers import triton_attention as ta
    num_heads, num_kv_heads = heads
    cases = {
        "plain": [(n, full_rows(n)) for n in (5, 64, 203)],
        # cached prefixes of 0, 1 block-unaligned, exactly as long as the rows, one block
        "short prefix": [(150, full_rows(150)), (77, tail_rows(77, 60)), (200, tail_rows(200, 100)),
                         (48, tail_rows(48, 32))],
    }
    for name, seqs in cases.items():
        query, k_cache, v_cache, md = make_batch(seqs, num_heads, num_kv_heads, 64, 16, torch.bfloat16, cuda, True)
        slots = md.slot_mapping
        key = k_cache.view(-1, num_kv_heads, 64)[slots]          # the step's own K/V are what the cache holds
        value = v_cache.view(-1, num_kv_heads, 64)[slots]
        assert ta._short_prefix_lens(md) is not None, name
        out = ta.TritonAttentionBackend.attention(query, k_cache, v_cache, md, 0.125, key=key, value=value)
        paged = ta.prefill_attention(query, k_cache, v_cache, md, 0.125)
        ref = reference(query, k_cache, v_cache, md, 0.125)
        assert rel_err(out, ref) < TOL[torch.bfloat16] and rel_err(out, paged) < TOL[torch.bfloat16], name
    # a prefix longer than the rows, or sparse rows, stays on the paged kernel
    _, _, _, md = make_batch([(300, tail_rows(300, 100))], num_heads, num_kv_heads, 64, 16, torch.bfloat16, cuda, True)
    assert ta._short_prefix_lens(md) is None


@pytest.mark.unit
def test_fp32_dot_precision_follows_torch_matmul_precision():
    pytest.importorskip("triton")
    from sparsex.layers.triton_attention import _dot_precision
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert _dot_precision() == "ieee"
        torch.set_float32_matmul_precision("high")
        assert _dot_precision() == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
