"""Native CPU kernels (sparsex/layers/cpu_kernels.py) against their torch references, and the fallback.

The references are the torch code the kernels replace: RMSNorm._norm and the residual add,
rotary_embedding.rotate, F.silu(gate) * up, index_copy_ into the cache, and for attention an
exact float64 softmax per row (with the sliding window and logit softcapping of Mistral / Gemma
layers where given: the full score matrix capped and masked, as transformers computes it).
Inputs are random and never zero. Elementwise kernels round like the torch code does: RoPE is
bit-identical; RMSNorm and SiLU may differ by one bfloat16 ulp on a few elements (the float32 sum
of squares is accumulated in another order; exp is a different polynomial).
"""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.nn.functional as F

import sparsex.layers.attention_backend as ab
from sparsex.layers import cpu_kernels
from sparsex.layers.attention_metadata import AttentionMetadata
from sparsex.layers.layernorm import RMSNorm
from sparsex.layers.rotary_embedding import RotaryEmbedding, rotate

pytestmark = pytest.mark.unit

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    """The compiled extension; a build failure fails these tests (only an explicit opt-out skips)."""
    if os.environ.get(cpu_kernels.ENV) == "0":
        pytest.skip(f"{cpu_kernels.ENV}=0")
    assert cpu_kernels.native() is not None, "the native CPU kernels failed to build (see the log)"
    return cpu_kernels


@pytest.fixture
def native_off(monkeypatch):
    """SPARSEX_NATIVE_KERNELS=0 for one test; the cached decision is restored afterwards."""
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    cpu_kernels.native.cache_clear()
    yield
    monkeypatch.delenv(cpu_kernels.ENV)
    cpu_kernels.native.cache_clear()


def nonzero_randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(*shape, generator=gen)
    return torch.where(x.abs() < 1e-3, torch.full_like(x, 0.5), x).to(dtype)


def ulp_close(out: torch.Tensor, ref: torch.Tensor, max_ulps: int = 1, min_equal: float = 0.99) -> None:
    """bf16: within `max_ulps` ulps everywhere and identical on at least `min_equal` of the elements."""
    assert out.dtype == ref.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=max_ulps * 2.0 ** -7, atol=1e-30)
    assert (out == ref).float().mean().item() >= min_equal


# ---------------------------------------------------------------------------------- decode attention


def capped_and_masked(att: torch.Tensor, key_pos: torch.Tensor, row_pos: torch.Tensor, window, cap) -> torch.Tensor:
    """Scaled scores [..., keys] softcapped (cap * tanh(att / cap)), then -inf at keys past the row's
    position or, with a window, at or before position - window (transformers' sliding_window_causal)."""
    if cap is not None:
        att = cap * torch.tanh(att / cap)
    hidden = key_pos > row_pos
    if window is not None:
        hidden |= key_pos <= row_pos - window
    return att.masked_fill(hidden, float("-inf"))


def attention_reference(query, k_cache, v_cache, block_tables, positions, scale, window=None, cap=None) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v per row over keys 0..positions[s] (the last `window` of them;
    scores softcapped at `cap`): [S, H, D]."""
    S, H, D = query.shape
    _, bs, kvh, _ = k_cache.shape
    out = torch.empty(S, H, D, dtype=torch.float64)
    for s in range(S):
        p = torch.arange(int(positions[s]) + 1)
        slots = block_tables[s, p // bs].long() * bs + p % bs
        k = k_cache.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, dim=1)   # [n, H, D]
        v = v_cache.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, dim=1)
        att = torch.einsum("hd,nhd->hn", query[s].double(), k) * scale
        att = capped_and_masked(att, p[None, :], positions[s], window, cap)
        out[s] = torch.einsum("hn,nhd->hd", att.softmax(-1), v)
    return out


def paged_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, gen):
    """Random queries and caches; each sequence's blocks scattered over a shuffled pool, table padded with 0."""
    nblocks = [(n + block_size - 1) // block_size for n in seq_lens]
    pool = torch.randperm(sum(nblocks) + 5, generator=gen)
    tables = torch.zeros(len(seq_lens), max(nblocks) + 2, dtype=torch.int32)
    used = 0
    for s, nb in enumerate(nblocks):
        tables[s, :nb] = pool[used:used + nb].int()
        used += nb
    shape = (pool.numel(), block_size, num_kv_heads, head_dim)
    k_cache = nonzero_randn(*shape, gen=gen, dtype=dtype)
    v_cache = nonzero_randn(*shape, gen=gen, dtype=dtype)
    query = nonzero_randn(len(seq_lens), num_heads, head_dim, gen=gen, dtype=dtype)
    return query, k_cache, v_cache, tables


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 8])
def test_decode_attention_matches_reference(kernels, dtype, num_heads, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim + num_heads + block_size)
    seq_lens = [1, 15, 16, 17, 333, 40]
    query, k_cache, v_cache, tables = paged_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                                                   dtype, gen)
    positions = torch.tensor(seq_lens) - 1
    positions[-1] = 22                       # a row that sees only a prefix of its sequence's keys
    scale = head_dim ** -0.5
    out = kernels.decode_attention(query, k_cache, v_cache, tables, positions, scale)
    ref = attention_reference(query, k_cache, v_cache, tables, positions, scale)
    assert out.dtype == dtype and out.shape == query.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    else:                                    # float32 inside, one rounding of the output
        torch.testing.assert_close(out.double(), ref, rtol=2.0 ** -8, atol=1e-5)


@pytest.mark.parametrize("head_dim", cpu_kernels.ATTENTION_HEAD_DIMS)
def test_decode_attention_every_head_dim_and_strided_query(kernels, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    query, k_cache, v_cache, tables = paged_inputs([5, 70], 6, 2, head_dim, 16, torch.float32, gen)
    wide = nonzero_randn(2, 6, 2 * head_dim, gen=gen)
    wide[..., :head_dim] = query
    strided = wide[..., :head_dim]           # head stride 2 * head_dim, as a view of a wider tensor
    positions = torch.tensor([4, 69])
    out = kernels.decode_attention(strided, k_cache, v_cache, tables, positions, 0.3)
    ref = attention_reference(query, k_cache, v_cache, tables, positions, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


# a single key, within a block (block sizes 16 and 8), exactly a block, across blocks, and longer than
# every sequence; alone, with a softcap, and a softcap alone
WINDOW_CAP = [(1, None), (7, None), (16, None), (40, None), (1000, None), (7, 2.0), (40, 2.0), (None, 2.0)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("block_size", [16, 8])
@pytest.mark.parametrize("window,cap", WINDOW_CAP)
def test_decode_attention_window_and_softcap_match_reference(kernels, dtype, num_heads, num_kv_heads, block_size,
                                                             window, cap):
    gen = torch.Generator().manual_seed(num_heads + block_size)
    seq_lens = [1, 15, 16, 17, 333, 40]
    query, k_cache, v_cache, tables = paged_inputs(seq_lens, num_heads, num_kv_heads, 64, block_size, dtype, gen)
    positions = torch.tensor(seq_lens) - 1
    positions[-1] = 22
    out = kernels.decode_attention(query, k_cache, v_cache, tables, positions, 0.125, window, cap)
    ref = attention_reference(query, k_cache, v_cache, tables, positions, 0.125, window, cap)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=2.0 ** -8, atol=1e-5)
    if window is not None and window >= max(seq_lens):    # hides nothing: the plain kernel, bit for bit
        assert torch.equal(out, kernels.decode_attention(query, k_cache, v_cache, tables, positions, 0.125,
                                                         logits_soft_cap=cap))


def test_softcap_tanh_is_accurate(kernels):
    """The kernels' vectorised tanh (a polynomial below |x| = 0.625, exp above) from 0 to saturation.
    Each row sees two keys, scoring 3x and 0, with values 1 and 0: the output is the softmax weight
    of the first, sigmoid(3 tanh(x)) with the cap at 3."""
    gen = torch.Generator().manual_seed(11)
    _, k_cache, v_cache, tables = paged_inputs([2], 1, 1, 16, 16, torch.float32, gen)
    k_cache[:, 1] = 0.0                                   # key 1 scores 0: softmax weight of key 0 = sigmoid(capped)
    v_cache[:, 0], v_cache[:, 1] = 1.0, 0.0
    k_cache[tables[0, 0], 0] = 0.0
    k_cache[tables[0, 0], 0, 0, 0] = 1.0
    x = torch.cat([torch.linspace(-12, 12, 241), torch.tensor([1e-6, -1e-4, 0.3, 0.6249, 0.6251, 8.99, 9.01])])
    query = torch.zeros(x.numel(), 1, 16)
    query[:, 0, 0] = x * 3.0                              # scores = 3x with the cap at 3: capped = 3 tanh(x)
    positions = torch.ones(x.numel(), dtype=torch.int64)
    out = kernels.decode_attention(query, k_cache, v_cache, tables.expand(x.numel(), -1).contiguous(), positions,
                                   1.0, logits_soft_cap=3.0)
    torch.testing.assert_close(out[:, 0, 0].double(), torch.sigmoid(3 * torch.tanh(x.double())), rtol=1e-6, atol=1e-7)


def _decode_metadata(seq_lens: list[int], tables: torch.Tensor) -> AttentionMetadata:
    S = len(seq_lens)
    return AttentionMetadata(
        positions=torch.tensor(seq_lens) - 1, slot_mapping=torch.zeros(S, dtype=torch.int64),
        cu_seqlens_q=torch.arange(S + 1, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, max_seqlen_q=1, max_seq_len=max(seq_lens),
        cu_seqlens_q_cpu=list(range(S + 1)), seq_lens_cpu=seq_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,cap", [(None, None), (50, None), (None, 30.0), (20, 5.0)])
def test_backend_decode_step_native_vs_gathered_sdpa(kernels, monkeypatch, dtype, window, cap):
    """The backend's two single-row paths (native kernel, gathered float32 SDPA or, softcapped,
    explicit scores) agree."""
    gen = torch.Generator().manual_seed(3)
    seq_lens = [300, 17, 1, 64]
    query, k_cache, v_cache, tables = paged_inputs(seq_lens, 9, 3, 64, 16, dtype, gen)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    plan_of = lambda m: (m.backend_plan if window is None and cap is None
                         else m.variant_plans[(window, cap is not None)])
    md = _decode_metadata(seq_lens, tables)
    out = ab.TorchAttentionBackend.attention(query, k_cache, v_cache, md, 0.125, **kw)
    assert isinstance(plan_of(md).single, ab._SingleRowBatch)
    monkeypatch.setattr(cpu_kernels, "native", lambda: None)
    md_ref = _decode_metadata(seq_lens, tables)
    ref = ab.TorchAttentionBackend.attention(query, k_cache, v_cache, md_ref, 0.125, **kw)
    assert isinstance(plan_of(md_ref).single, ab._GatheredSingleRowBatch)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        ulp_close(out, ref, min_equal=0.9)


def test_decode_attention_rejects_bad_inputs(kernels):
    gen = torch.Generator().manual_seed(4)
    query, k_cache, v_cache, tables = paged_inputs([20, 3], 4, 2, 64, 16, torch.float32, gen)
    pos = torch.tensor([19, 2])
    with pytest.raises(ValueError, match="head_dim"):
        kernels.decode_attention(query[..., :48], k_cache, v_cache, tables, pos, 1.0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        kernels.decode_attention(query[:, :3], k_cache, v_cache, tables, pos, 1.0)
    with pytest.raises(ValueError, match="k_cache"):
        kernels.decode_attention(query, k_cache.bfloat16(), v_cache, tables, pos, 1.0)
    with pytest.raises(ValueError, match="block_tables"):
        kernels.decode_attention(query, k_cache, v_cache, tables.long(), pos, 1.0)
    with pytest.raises(ValueError, match="positions"):
        kernels.decode_attention(query, k_cache, v_cache, tables, pos.int(), 1.0)
    with pytest.raises(ValueError, match="outside its block table"):
        kernels.decode_attention(query, k_cache, v_cache, tables, torch.tensor([19, 10_000]), 1.0)
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="not a block of the cache"):
        kernels.decode_attention(query, k_cache, v_cache, bad, pos, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        kernels.decode_attention(query, k_cache, v_cache, tables, pos, 1.0, sliding_window=-1)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        kernels.decode_attention(query, k_cache, v_cache, tables, pos, 1.0, logits_soft_cap=-2.0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        kernels.decode_attention(query, k_cache, v_cache, tables, pos, 1.0, logits_soft_cap=float("inf"))
    # with a window only the blocks it reads must be valid: keys 17..19 lie in block 1
    before = tables.clone()
    before[0, 0] = -1
    out = kernels.decode_attention(query, k_cache, v_cache, before, pos, 1.0, sliding_window=3)
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------- multi-row attention


def multi_row_reference(query, k_cache, v_cache, block_tables, query_start, positions, scale, window=None,
                        cap=None) -> torch.Tensor:
    """float64 softmax(q k^T * scale) v of row t of sequence s over keys 0..positions[t] (the last
    `window` of them; scores softcapped at `cap`), from the full score matrix: [T, H, D]."""
    T, H, D = query.shape
    _, bs, kvh, _ = k_cache.shape
    out = torch.empty(T, H, D, dtype=torch.float64)
    for s in range(block_tables.shape[0]):
        t0, t1 = int(query_start[s]), int(query_start[s + 1])
        if t0 == t1:
            continue
        pos = positions[t0:t1]
        p = torch.arange(int(pos.max()) + 1)
        slots = block_tables[s, p // bs].long() * bs + p % bs
        k = k_cache.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, dim=1)   # [n, H, D]
        v = v_cache.reshape(-1, kvh, D)[slots].double().repeat_interleave(H // kvh, dim=1)
        att = torch.einsum("thd,nhd->thn", query[t0:t1].double(), k) * scale                 # [rows, H, n]
        att = capped_and_masked(att, p[None, None, :], pos[:, None, None], window, cap)
        out[t0:t1] = torch.einsum("thn,nhd->thd", att.softmax(-1), v)
    return out


def multi_row_case(kind: str, gen: torch.Generator) -> tuple[list[int], list[torch.Tensor]]:
    """(sequence lengths, the row positions of each sequence) for one kind of multi-row step."""
    seq_lens = [150, 37, 2, 70]                                         # ragged, block-unaligned
    if kind == "prefill":
        return seq_lens, [torch.arange(n) for n in seq_lens]
    if kind == "cached_prefix":                                         # rows = the tail after a cached prefix
        return seq_lens, [torch.arange(n - q, n) for n, q in zip(seq_lens, [23, 5, 2, 64])]
    rows = []                                                           # sparse: a sorted subset + the tail
    for n in seq_lens:
        keep = torch.randperm(n - 1, generator=gen)[:max(1, n // 4)]
        rows.append(torch.cat([keep.sort().values, torch.tensor([n - 1])]).unique())
    return seq_lens, rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["prefill", "cached_prefix", "sparse"])
def test_multi_row_attention_matches_reference(kernels, dtype, num_heads, num_kv_heads, head_dim, kind):
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    seq_lens, rows = multi_row_case(kind, gen)
    _, k_cache, v_cache, tables = paged_inputs(seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype, gen)
    positions = torch.cat(rows)
    query_start = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    query = nonzero_randn(positions.numel(), num_heads, head_dim, gen=gen, dtype=dtype)
    scale = head_dim ** -0.5
    out = kernels.multi_row_attention(query, k_cache, v_cache, tables, query_start, positions, scale)
    ref = multi_row_reference(query, k_cache, v_cache, tables, query_start, positions, scale)
    assert out.dtype == dtype and out.shape == query.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    else:                                    # float32 scores, P rounded to bf16 before P·V
        torch.testing.assert_close(out.double(), ref, rtol=2.0 ** -7, atol=5e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3)])
@pytest.mark.parametrize("kind", ["prefill", "cached_prefix", "sparse"])
# windows of one key, within a 64-key block, one block, across blocks, as long as the longest
# sequence (150) and longer
@pytest.mark.parametrize("window,cap", [(1, None), (7, None), (64, None), (100, None), (150, None), (1000, None),
                                        (7, 2.0), (100, 2.0), (None, 2.0)])
def test_multi_row_attention_window_and_softcap_match_reference(kernels, dtype, num_heads, num_kv_heads, kind,
                                                                window, cap):
    gen = torch.Generator().manual_seed(num_heads + len(kind))
    seq_lens, rows = multi_row_case(kind, gen)
    _, k_cache, v_cache, tables = paged_inputs(seq_lens, num_heads, num_kv_heads, 64, 16, dtype, gen)
    positions = torch.cat(rows)
    query_start = torch.tensor([0] + [len(r) for r in rows]).cumsum(0)
    query = nonzero_randn(positions.numel(), num_heads, 64, gen=gen, dtype=dtype)
    out = kernels.multi_row_attention(query, k_cache, v_cache, tables, query_start, positions, 0.125, window, cap)
    ref = multi_row_reference(query, k_cache, v_cache, tables, query_start, positions, 0.125, window, cap)
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(out.double(), ref, rtol=2.0 ** -7, atol=5e-3)
    if window is not None and window >= max(seq_lens):    # hides nothing: the plain kernel, bit for bit
        assert torch.equal(out, kernels.multi_row_attention(query, k_cache, v_cache, tables, query_start, positions,
                                                            0.125, logits_soft_cap=cap))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cap", [None, 2.0])
def test_window_skips_the_keys_outside_it(kernels, dtype, cap):
    """Keys outside every row's window are not read, only masked keys near it (a long prompt on a
    sliding layer costs O(window) per row): NaN in them leaves the output exact. The decode kernel
    starts at the row's first key; the multi-row kernel at the 64-key block holding its tile's first
    key, and skips the blocks between sparse rows' windows."""
    gen = torch.Generator().manual_seed(12)
    seq_lens, window = [400, 300], 20
    query, k_cache, v_cache, tables = paged_inputs(seq_lens, 9, 3, 64, 16, dtype, gen)
    rows = [torch.arange(380, 400), torch.tensor([40, 100, 299])]   # one tile (32 rows) each
    positions = torch.cat(rows)
    query_start = torch.tensor([0, 20, 23])
    mq = nonzero_randn(23, 9, 64, gen=gen, dtype=dtype)
    decode_pos = torch.tensor([399, 299])
    ref_decode = attention_reference(query, k_cache, v_cache, tables, decode_pos, 0.125, window, cap)
    ref_multi = multi_row_reference(mq, k_cache, v_cache, tables, query_start, positions, 0.125, window, cap)

    def poison(unread: list[range]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the caches with NaN K and V at the key positions `unread[s]` of sequence s."""
        k, v = k_cache.clone(), v_cache.clone()
        for s, keys in enumerate(unread):
            p = torch.tensor(list(keys), dtype=torch.int64)
            k[tables[s, p // 16].long(), p % 16] = float("nan")
            v[tables[s, p // 16].long(), p % 16] = float("nan")
        return k, v

    k, v = poison([range(399 + 1 - window), range(299 + 1 - window)])
    out = kernels.decode_attention(query, k, v, tables, decode_pos, 0.125, window, cap)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2.0 ** -8, atol=1e-5)
    torch.testing.assert_close(out.double(), ref_decode, **tol)
    # sequence 0: from block 320 (holding key 361) on; sequence 1: blocks 0, 64 and 256 (its rows see
    # keys 21..40, 81..100, 280..299)
    k, v = poison([range(320), range(128, 256)])
    out = kernels.multi_row_attention(mq, k, v, tables, query_start, positions, 0.125, window, cap)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2.0 ** -7, atol=5e-3)
    torch.testing.assert_close(out.double(), ref_multi, **tol)


@pytest.mark.parametrize("head_dim", cpu_kernels.ATTENTION_HEAD_DIMS)
def test_multi_row_attention_every_head_dim_and_strided_query(kernels, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    _, k_cache, v_cache, tables = paged_inputs([5, 130], 6, 2, head_dim, 16, torch.float32, gen)
    positions = torch.cat([torch.arange(5), torch.arange(130)])
    wide = nonzero_randn(positions.numel(), 6, 2 * head_dim, gen=gen)
    strided = wide[..., :head_dim]           # head stride 2 * head_dim, as a view of a wider tensor
    query_start = torch.tensor([0, 5, 135])
    out = kernels.multi_row_attention(strided, k_cache, v_cache, tables, query_start, positions, 0.3)
    ref = multi_row_reference(strided, k_cache, v_cache, tables, query_start, positions, 0.3)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _multi_row_metadata(seq_lens: list[int], rows: list[torch.Tensor], tables: torch.Tensor) -> AttentionMetadata:
    cu = [0]
    for r in rows:
        cu.append(cu[-1] + len(r))
    return AttentionMetadata(
        positions=torch.cat(rows), slot_mapping=torch.zeros(cu[-1], dtype=torch.int64),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables, max_seqlen_q=max(len(r) for r in rows), max_seq_len=max(seq_lens),
        cu_seqlens_q_cpu=cu, seq_lens_cpu=seq_lens, contiguous=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,cap", [(None, None), (50, None), (None, 30.0), (20, 5.0)])
def test_backend_multi_row_native_vs_gemm(kernels, monkeypatch, dtype, window, cap):
    """The backend's multi-row paths (native kernel, GEMM row chunks) agree, with one-row sequences mixed in.
    The native kernel is forced: on a CPU without AVX-512 the backend would not choose it."""
    monkeypatch.setattr(cpu_kernels, "multi_row_preferred", lambda: True)
    gen = torch.Generator().manual_seed(6)
    seq_lens = [300, 17, 40, 64]
    _, k_cache, v_cache, tables = paged_inputs(seq_lens, 9, 3, 64, 16, dtype, gen)
    rows = [torch.arange(300), torch.tensor([16]), torch.tensor([3, 9, 20, 39]), torch.tensor([63])]
    query = nonzero_randn(sum(len(r) for r in rows), 9, 64, gen=gen, dtype=dtype)
    kw = dict(sliding_window=window, logits_soft_cap=cap)
    plan_of = lambda m: (m.backend_plan if window is None and cap is None
                         else m.variant_plans[(window, cap is not None)])
    md = _multi_row_metadata(seq_lens, rows, tables)
    out = ab.TorchAttentionBackend.attention(query, k_cache, v_cache, md, 0.125, **kw)
    assert isinstance(plan_of(md).multi, ab._NativeMultiRowBatch)
    monkeypatch.setattr(cpu_kernels, "native", lambda: None)
    md_ref = _multi_row_metadata(seq_lens, rows, tables)
    ref = ab.TorchAttentionBackend.attention(query, k_cache, v_cache, md_ref, 0.125, **kw)
    assert isinstance(plan_of(md_ref).multi, list)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:                                    # the GEMM path also rounds the scores to bf16
        torch.testing.assert_close(out.float(), ref.float(), rtol=2.0 ** -6, atol=2e-2)


def test_multi_row_attention_rejects_bad_inputs(kernels):
    gen = torch.Generator().manual_seed(7)
    query, k_cache, v_cache, tables = paged_inputs([20, 3, 1], 4, 2, 64, 16, torch.float32, gen)
    qs, pos = torch.tensor([0, 2, 3]), torch.tensor([18, 19, 2])
    with pytest.raises(ValueError, match="head_dim"):
        kernels.multi_row_attention(query[..., :48], k_cache, v_cache, tables[:2], qs, pos, 1.0)
    with pytest.raises(ValueError, match="query_start"):
        kernels.multi_row_attention(query, k_cache, v_cache, tables, qs, pos, 1.0)
    with pytest.raises(ValueError, match="query_start must run"):
        kernels.multi_row_attention(query, k_cache, v_cache, tables[:2], torch.tensor([0, 2, 2]), pos, 1.0)
    with pytest.raises(ValueError, match="outside its block table"):
        kernels.multi_row_attention(query, k_cache, v_cache, tables[:2], qs, torch.tensor([18, 19, 10_000]), 1.0)
    bad = tables.clone()
    bad[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="not a block of the cache"):
        kernels.multi_row_attention(query, k_cache, v_cache, bad[:2], qs, pos, 1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        kernels.multi_row_attention(query, k_cache, v_cache, tables[:2], qs, pos, 1.0, sliding_window=-3)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        kernels.multi_row_attention(query, k_cache, v_cache, tables[:2], qs, pos, 1.0, logits_soft_cap=-1.0)


# ---------------------------------------------------------------------------------- KV store


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_index_copy(kernels, dtype):
    gen = torch.Generator().manual_seed(6)
    T, KVH, D, H = 13, 3, 64, 9
    qkv = nonzero_randn(T, (H + 2 * KVH) * D, gen=gen, dtype=dtype)
    _, key, value = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    key, value = key.view(T, KVH, D), value.view(T, KVH, D)        # strided views, as in the model
    slots = torch.randperm(10 * 16, generator=gen)[:T]
    k_cache, v_cache = nonzero_randn(2, 10, 16, KVH, D, gen=gen, dtype=dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref.view(-1, KVH, D).index_copy_(0, slots, key)
    v_ref.view(-1, KVH, D).index_copy_(0, slots, value)
    kernels.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    with pytest.raises(ValueError, match="not in the cache"):
        kernels.store_kv(key, value, k_cache, v_cache, torch.full((T,), 160))
    with pytest.raises(ValueError, match="key"):
        kernels.store_kv(key.double(), value, k_cache, v_cache, slots)


# ---------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (37, 960), (5, 100), (2, 3, 64)])
def test_rms_norm_matches_reference(kernels, dtype, shape):
    gen = torch.Generator().manual_seed(shape[-1] + len(shape))
    norm = RMSNorm(shape[-1], 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(nonzero_randn(shape[-1], gen=gen, dtype=dtype))
    x = nonzero_randn(*shape, gen=gen, dtype=dtype) * 3
    residual = nonzero_randn(*shape, gen=gen, dtype=dtype)

    out = kernels.rms_norm(x, norm.weight.detach(), norm.eps)
    out_res, new_res = kernels.rms_norm(x, norm.weight.detach(), norm.eps, residual)
    with torch.no_grad():
        ref = norm._norm(x)                               # the torch code RMSNorm.forward runs without the kernel
        ref_res = x + residual
        ref_out_res = norm._norm(ref_res)
    assert torch.equal(new_res, ref_res)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out_res, ref_out_res, rtol=1e-5, atol=1e-6)
    else:
        ulp_close(out, ref)
        ulp_close(out_res, ref_out_res)
    # the module routes CPU tensors to the kernel
    module_out, module_res = norm(x, residual)
    assert torch.equal(module_out, out_res) and torch.equal(module_res, new_res)


def test_rms_norm_rejects_bad_inputs(kernels):
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(x, torch.randn(32), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        kernels.rms_norm(x, torch.randn(64), 1e-5, torch.randn(4, 32))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        kernels.rms_norm(x.half(), torch.randn(64).half(), 1e-5)


# ---------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 4, 2), (40, 2, 1)])
def test_rope_bit_identical_to_reference(kernels, dtype, head_dim, num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(head_dim)
    rope = RotaryEmbedding(head_dim, 10000.0, None, 40_000)
    T = 11
    qkv = nonzero_randn(T, (num_heads + 2 * num_kv_heads) * head_dim, gen=gen, dtype=dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(T, num_heads, head_dim)                    # strided views of the fused output, as in the model
    k = k.view(T, num_kv_heads, head_dim)
    positions = torch.cat([torch.tensor([0, 1, 39_999]), torch.randint(0, 40_000, (T - 3,), generator=gen)])
    q_out, k_out = kernels.rope(q, k, positions, rope.cos_cache, rope.sin_cache)
    cos, sin = rope.cos_sin(positions)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, rotate(q, cos, sin)) and torch.equal(k_out, rotate(k, cos, sin))
    module_q, module_k = rope(positions, q, k)            # the module routes CPU tensors to the kernel
    assert torch.equal(module_q, q_out) and torch.equal(module_k, k_out)


def test_rope_rejects_positions_outside_the_tables(kernels):
    rope = RotaryEmbedding(64, 10000.0, None, 100)
    q, k = torch.randn(2, 4, 64), torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match="outside the rope tables"):
        kernels.rope(q, k, torch.tensor([3, 100]), rope.cos_cache, rope.sin_cache)
    with pytest.raises(ValueError, match="positions"):
        kernels.rope(q, k, torch.tensor([3]), rope.cos_cache, rope.sin_cache)


# ---------------------------------------------------------------------------------- SiLU * mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (8, 1536), (3, 100)])
def test_silu_and_mul_matches_reference(kernels, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = nonzero_randn(rows, 2 * inter, gen=gen, dtype=dtype) * 4
    out = kernels.silu_and_mul(gate_up)
    gate, up = gate_up.split(inter, dim=-1)
    ref = F.silu(gate) * up
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    else:
        ulp_close(out, ref, max_ulps=2)


# ---------------------------------------------------------------------------------- fallback


def test_env_off_uses_the_torch_code(native_off):
    assert cpu_kernels.native() is None
    x = torch.randn(4, 64)
    assert not cpu_kernels.supports(x)
    with pytest.raises(RuntimeError, match="not available"):
        cpu_kernels.rms_norm(x, torch.ones(64), 1e-5)
    gen = torch.Generator().manual_seed(5)
    seq_lens = [20, 7]
    query, k_cache, v_cache, tables = paged_inputs(seq_lens, 4, 2, 64, 16, torch.float32, gen)
    md = _decode_metadata(seq_lens, tables)
    ab.TorchAttentionBackend.attention(query, k_cache, v_cache, md, 0.125)
    assert isinstance(md.backend_plan.single, ab._GatheredSingleRowBatch)


def test_build_failure_warns_once_and_falls_back(monkeypatch, caplog):
    import torch.utils.cpp_extension

    def broken_load(*args, **kwargs):
        raise RuntimeError("Error building extension 'sparsex_cpu_kernels'")

    monkeypatch.delenv(cpu_kernels.ENV, raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", broken_load)
    cpu_kernels.native.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
            assert cpu_kernels.native() is None
            assert not cpu_kernels.supports(torch.randn(2))
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert "Error building extension" in caplog.records[0].getMessage()
    finally:
        cpu_kernels.native.cache_clear()
