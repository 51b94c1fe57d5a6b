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

# relative-norm tolerances: fp32 runs through tf32 tensor cores; bf16 operands land near 4e-3
TOL = {torch.float32: 2e-3, torch.bfloat16: 1.5e-2, torch.float16: 5e-3}
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
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA)
def test_prefill_ragged(device, heads, head_dim, dtype):
    # block-unaligned lengths, a 1-token prompt, and one longer than several key tiles
    seqs = [(n, full_rows(n)) for n in (1, 17, 100, 333)]
    check_attention(seqs, heads, head_dim, dtype, device, contiguous=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", GQA)
def test_extend_after_prefix_hit(device, heads, dtype):
    # queries only for the tail: chunked prefill / prefix-cache hit; one chunk of a single row
    seqs = [(300, tail_rows(300, 45)), (129, tail_rows(129, 1)), (520, tail_rows(520, 200)), (64, tail_rows(64, 64))]
    check_attention(seqs, heads, 128, dtype, device, contiguous=True, block_size=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA)
def test_sparse_rows(device, heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(heads[0] * 1000 + head_dim)
    shapes = ((700, 0.15, 16), (257, 0.3, 1), (1500, 0.05, 64))          # (prompt length, fraction, tail rows)
    seqs = [(n, sparse_rows(n, frac, tail, gen)) for n, frac, tail in shapes]
    check_attention(seqs, heads, head_dim, dtype, device, contiguous=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sparse_rows_with_empty_sequence(device, dtype):
    # select_rows can leave a sequence with no rows; rows need not be sorted either
    gen = torch.Generator().manual_seed(7)
    rows = sparse_rows(400, 0.2, 8, gen)
    rows = rows[torch.randperm(rows.numel(), generator=gen)]
    seqs = [(50, torch.empty(0, dtype=torch.int64)), (400, rows), (90, torch.empty(0, dtype=torch.int64))]
    check_attention(seqs, (8, 2), 128, dtype, device, contiguous=False)


def test_sparse_rows_long_prompt_two_sequences(device):
    # several key tiles per query tile, two sequences of different lengths in one gathered copy
    # (the shorter one's padding blocks are copied but must never be read)
    gen = torch.Generator().manual_seed(11)
    seqs = [(3000, sparse_rows(3000, 0.2, 48, gen)), (1100, sparse_rows(1100, 0.5, 16, gen))]
    check_attention(seqs, (32, 8), 128, torch.bfloat16, device, contiguous=False)


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


@pytest.mark.parametrize("heads", GQA)
def test_mixed_decode_and_prefill_rows(device, heads):
    # decode rows and prefill chunks in one step go through the varlen kernel
    seqs = [(1000, tail_rows(1000, 1)), (77, full_rows(77)), (2048, tail_rows(2048, 1)), (300, tail_rows(300, 30))]
    check_attention(seqs, heads, 128, torch.bfloat16, device, contiguous=True, block_size=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA)
def test_decode(device, heads, head_dim, dtype):
    # long and short contexts in one batch: split-K with some splits empty for the short ones
    lens = (1, 15, 16, 17, 4000, 12345)
    seqs = [(n, tail_rows(n, 1)) for n in lens]
    check_attention(seqs, heads, head_dim, dtype, device, contiguous=True, decode=True)


@pytest.mark.parametrize("num_splits", [1, 3, 64])
def test_decode_split_counts(device, num_splits):
    from sparsex.layers import triton_attention as ta

    seqs = [(n, tail_rows(n, 1)) for n in (5, 700, 3001)]
    query, k_cache, v_cache, md = make_batch(seqs, 32, 8, 128, 16, torch.bfloat16, device, True)
    ref = reference(query, k_cache, v_cache, md, 0.1)
    out = ta.decode_attention(query, k_cache, v_cache, md, 0.1, num_splits=num_splits)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


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


@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (128, 64)])
def test_rerotate_torch_matches_rope_at_new_position(head_dim, rot_dim):
    assert rerotate_case(torch.float32, head_dim, rot_dim, torch.device("cpu"), copy_and_rerotate_torch) < 1e-5
    assert rerotate_case(torch.bfloat16, head_dim, rot_dim, torch.device("cpu"), copy_and_rerotate_torch) < 1e-2


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (128, 64)])
def test_rerotate_triton(device, dtype, head_dim, rot_dim):
    from sparsex.layers.triton_rerotate import LayerPointers, copy_and_rerotate_layers

    def one_layer(k_cache, v_cache, *plan):
        copy_and_rerotate_layers(LayerPointers([(k_cache, v_cache)]), *plan)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert rerotate_case(dtype, head_dim, rot_dim, device, one_layer) < tol


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


def test_layer_pointers_refuse_caches_of_different_layouts():
    from sparsex.layers.triton_rerotate import LayerPointers
    a = (torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64))
    with pytest.raises(ValueError, match="layer 0's shape"):
        LayerPointers([a, (torch.zeros(5, 16, 2, 64), torch.zeros(5, 16, 2, 64))])
    assert LayerPointers([a, a]).num_layers == 2


# ---- the selection probe's scores (triton_probe.py) against the torch selectors ----------------------
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_and_mul_matches_eager(cuda, dtype):
    from sparsex.layers.triton_fused import silu_and_mul
    gate_up = (3 * torch.randn(29, 2 * 1536)).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = silu_and_mul(gate_up.to(cuda))
    assert rel_err(out.cpu(), ref) < (1e-5 if dtype == torch.float32 else 1e-2)


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