"""A blended step's row selection without a device sync: the number of kept rows is computed on the
host from the rule and the segment lengths (`StepBlend._keep_count`), so it must equal what the
device-side mask keeps, for every selector and knob combination; and the sync-free index
extraction must equal torch.nonzero. The query selectors (query_fused, chunk_anchor): their fused
query mass against a plain per-head softmax, chunk_anchor's per-chunk quotas against relevance."""
import itertools

import pytest
import torch

from sparsex.config import ReuseConfig
from sparsex.segment import selectors
from sparsex.segment.step_blend import StepBlend, _SeqBlend, _true_indices, query_layers

pytestmark = pytest.mark.unit


def _blend(seg_lens: list[int], reuse: ReuseConfig, seed: int) -> _SeqBlend:
    g = torch.Generator().manual_seed(seed)
    offsets = torch.cat([torch.arange(n) for n in seg_lens])
    seg_lo = torch.cat([torch.full((n,), sum(seg_lens[:i])) for i, n in enumerate(seg_lens)])
    n = len(offsets)
    b = _SeqBlend(request=None, reuse=reuse, reused_rows=torch.arange(n) + 5, reused_pos=seg_lo + offsets + 7,
                  offsets=offsets, seq_index=0, seg_lens=seg_lens,
                  query_rows=torch.arange(0))
    # ties included: scores drawn from few values, as bf16 deviations often are
    b.scores = torch.randint(0, 7, (n,), generator=g).float()
    b.query_mass = torch.rand(n, generator=g) ** 4 / n          # query_fused / chunk_anchor: a skewed mass
    return b


def _step_blend() -> StepBlend:
    bl = StepBlend.__new__(StepBlend)      # the selection needs no forward context, model or pool
    bl._gen = torch.Generator().manual_seed(0)
    bl._reduce, bl._same_rows = (lambda deviation, mass: (deviation, mass)), None     # one rank
    return bl


SEGMENTS = [[40], [17, 300, 5, 64], [16] * 12, [500, 500]]


@pytest.mark.parametrize("selector,ratio,boundary_tokens,share", [
    *itertools.product(["sparse_q"], [0.0, 0.02, 0.15, 0.5, 1.0], [0, 8, 40], [0.0, 0.5, 1.0]),
    *itertools.product(["kv_deviation", "boundary", "random"], [0.0, 0.15, 0.3, 1.0], [0, 16], [0.5]),
    *itertools.product(["query_fused", "chunk_anchor"], [0.0, 0.02, 0.15, 0.5, 1.0], [0, 16], [0.5]),
    ("none", 0.15, 0, 0.5), ("none", 0.0, 16, 0.5), ("all", 0.15, 0, 0.5),
])
def test_host_count_matches_device_mask(selector, ratio, boundary_tokens, share):
    full_layers = 0 if selector in ("boundary", "random", "none", "all") else 2
    reuse = ReuseConfig(full_layers=full_layers, recompute_ratio=ratio, selector=selector,
                        boundary_tokens=boundary_tokens, boundary_share=share)
    bl = _step_blend()
    for i, seg_lens in enumerate(SEGMENTS):
        b = _blend(seg_lens, reuse, seed=i)
        keep = bl._keep_mask(b)
        n = b.reused_rows.numel()
        assert keep.shape == (n,) and keep.dtype == torch.bool
        assert int(keep.sum()) == bl._keep_count(b), (seg_lens, selector, ratio, boundary_tokens, share)
        # the leading tokens are always kept, whatever their scores
        if selector != "none" or boundary_tokens:
            assert bool(keep[b.offsets < boundary_tokens].all())
        if selector == "none":
            assert int(keep.sum()) == sum(min(boundary_tokens, s) for s in seg_lens)
        if selector == "all":
            assert bool(keep.all())


def test_sparse_q_keeps_budget_and_top_scores():
    """sparse_q at r=0.15 keeps round(0.15 n) rows: half of them as segment starts, the rest the
    highest-scored of the others."""
    reuse = ReuseConfig(full_layers=2, recompute_ratio=0.15, selector="sparse_q", boundary_share=0.5)
    bl = _step_blend()
    b = _blend([200, 200], reuse, seed=3)
    b.scores = torch.arange(400, dtype=torch.float32)         # later rows score higher
    keep = bl._keep_mask(b)
    assert int(keep.sum()) == round(0.15 * 400) == bl._keep_count(b)
    per_segment = round(0.5 * 60) // 2                         # 15 leading tokens of each segment
    assert bool(keep[b.offsets < per_segment].all())
    assert torch.equal(torch.nonzero(keep).flatten()[-30:], torch.arange(370, 400))


@pytest.mark.parametrize("ratio,candidates,boundary_tokens,share", [
    p for p in itertools.product([0.0, 0.15, 0.5], [0.15, 0.5, 1.0], [0, 8], [0.0, 0.5]) if p[1] >= p[0]
])
def test_two_stage_counts_match_masks_and_nest(ratio, candidates, boundary_tokens, share):
    """Two-stage selection: the first stage keeps exactly its host count of candidates, at least the
    final budget, the leading tokens among them; the second keeps exactly the final count, a subset
    of the candidates, as many as one stage keeps."""
    reuse = ReuseConfig(full_layers=2, recompute_ratio=ratio, selector="sparse_q", boundary_tokens=boundary_tokens,
                        boundary_share=share, rescore_layers=2, candidate_ratio=candidates)
    one = ReuseConfig(full_layers=2, recompute_ratio=ratio, selector="sparse_q", boundary_tokens=boundary_tokens,
                      boundary_share=share)
    bl = _step_blend()
    for i, seg_lens in enumerate(SEGMENTS):
        b = _blend(seg_lens, reuse, seed=i)
        n = b.reused_rows.numel()
        first = bl._keep_mask(b)
        c = bl._keep_count(b)
        assert int(first.sum()) == c
        assert c == min(n, max(bl._keep_count(_blend(seg_lens, one, seed=i)),
                               round(candidates * n)))
        assert bool(first[b.offsets < boundary_tokens].all())
        rows = b.reused_rows[first]
        b.stage, b.selected = 1, c
        b.narrow(_true_indices(first, c))
        assert torch.equal(b.reused_rows, rows) and b.num_reused == n
        b.scores = torch.randint(0, 7, (c,), generator=torch.Generator().manual_seed(i)).float()
        second = bl._keep_mask(b)
        assert second.shape == (c,) and int(second.sum()) == bl._keep_count(b)
        assert bl._keep_count(b) == bl._keep_count(_blend(seg_lens, one, seed=i))
        assert bool(second[b.offsets < boundary_tokens].all())


@pytest.mark.parametrize("n,p", [(1, 1.0), (7, 0.0), (100, 0.3), (4096, 0.15), (4096, 1.0)])
def test_true_indices_equals_nonzero(n, p):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=g) < p
    got = _true_indices(mask, int(mask.sum()))
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.nonzero(mask).flatten())


def test_default_boundary_share_is_a_quarter_of_the_budget():
    """The engine default spends 25% of sparse_q's budget on segment starts (docs/benchmarks/defaults.md)."""
    reuse = ReuseConfig(full_layers=2, recompute_ratio=0.15, selector="sparse_q")
    assert reuse.boundary_share == 0.25
    b = _blend([200, 200], reuse, seed=3)
    b.scores = torch.arange(400, dtype=torch.float32)
    keep = _step_blend()._keep_mask(b)
    per_segment = round(0.25 * 60) // 2                        # 7 leading tokens of each segment
    assert bool(keep[b.offsets < per_segment].all()) and not bool(keep[b.offsets == per_segment][0])
    assert int(keep.sum()) == 60
    with pytest.raises(ValueError, match="boundary_share"):
        ReuseConfig(boundary_share=1.5).verify()


def _chunk_counts(keep: torch.Tensor, b: _SeqBlend) -> list[int]:
    chunk = selectors.chunk_of_rows(b.offsets)
    return torch.zeros(b.num_segments, dtype=torch.int64).scatter_add_(0, chunk, keep.long()).tolist()


def test_chunk_anchor_quotas_follow_relevance():
    """chunk_anchor splits the budget k across chunks in proportion to the query's mass on each
    (every quota within one row of k * rel_c / sum(rel), summing to exactly k), and fills each
    chunk with its highest-deviation rows."""
    reuse = ReuseConfig(full_layers=2, recompute_ratio=0.2, selector="chunk_anchor")
    bl = _step_blend()
    b = _blend([100, 100, 100, 100], reuse, seed=0)
    relevance = torch.tensor([0.1, 0.5, 0.3, 0.1])
    b.query_mass = (relevance / 100).repeat_interleave(100)
    b.scores = torch.rand(400, generator=torch.Generator().manual_seed(1))       # deviation: no ties
    keep = bl._keep_mask(b)
    k = bl._keep_count(b)
    counts = _chunk_counts(keep, b)
    assert k == 80 and sum(counts) == k == int(keep.sum())
    assert counts.index(max(counts)) == 1 and counts[2] > counts[0]
    for c, share in enumerate((k * relevance / relevance.sum()).tolist()):
        assert abs(counts[c] - share) <= 1, (counts, c)
        rows = keep[c * 100:(c + 1) * 100]
        dev = b.scores[c * 100:(c + 1) * 100]
        assert torch.equal(torch.nonzero(rows).flatten().sort().values,
                           torch.topk(dev, counts[c]).indices.sort().values)      # the chunk's anchors


@pytest.mark.parametrize("seed", range(6))
def test_chunk_anchor_quotas_on_random_chunks(seed):
    """Random chunk lengths, masses and leading tokens: the count is exact, leading rows use no
    quota, and a more relevant chunk never gets fewer scored rows than a less relevant one while
    it had rows left to give."""
    g = torch.Generator().manual_seed(seed)
    seg_lens = torch.randint(1, 120, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
    ratio = float(torch.rand(1, generator=g))
    lead = int(torch.randint(0, 4, (1,), generator=g))
    reuse = ReuseConfig(full_layers=2, recompute_ratio=ratio, selector="chunk_anchor", boundary_tokens=lead)
    bl = _step_blend()
    b = _blend(seg_lens, reuse, seed=seed)
    keep = bl._keep_mask(b)
    assert int(keep.sum()) == bl._keep_count(b)
    assert bool(keep[b.offsets < lead].all())
    scored = keep & (b.offsets >= lead)
    got = _chunk_counts(scored, b)
    _, _, k = bl._keep_plan(b)
    assert sum(got) == k
    rel = selectors.chunk_relevance(b.query_mass, selectors.chunk_of_rows(b.offsets), len(seg_lens))
    cap = [max(n - lead, 0) for n in seg_lens]
    for a in range(len(seg_lens)):
        for c in range(len(seg_lens)):
            if rel[a] > rel[c] and got[a] < cap[a]:
                assert got[a] >= got[c], (a, c, got, rel.tolist(), cap)


def _probe_case(selector: str, full_layers: int = 4, seed: int = 0):
    """One blended sequence inside a step, on synthetic tensors: 6 prefix tokens already cached,
    then 14 step rows (positions 6..19): 2 new, two reused segments of 4 (positions 8..15), the
    query (16..19). Returns (StepBlend, _SeqBlend, context, per-layer (q, k, v, k_cache, v_cache))."""
    from sparsex.layers.attention_metadata import AttentionMetadata
    from sparsex.layers.forward_context import ForwardContext
    g = torch.Generator().manual_seed(seed)
    bs, nb, heads, kv_heads, dim = 4, 6, 4, 2, 8
    n, pos0, t = 20, 6, 14
    table = torch.tensor([[2, 0, 5, 1, 3]], dtype=torch.int32)              # blocks out of order
    positions = torch.arange(pos0, n)
    slots = table[0, positions // bs].long() * bs + positions % bs
    md = AttentionMetadata(positions=positions, slot_mapping=slots,
                           cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32),
                           seq_lens=torch.tensor([n], dtype=torch.int32), block_tables=table,
                           max_seqlen_q=t, max_seq_len=n, cu_seqlens_q_cpu=[0, t], seq_lens_cpu=[n])
    layers = [(torch.randn(t, heads, dim, generator=g), torch.randn(t, kv_heads, dim, generator=g),
               torch.randn(t, kv_heads, dim, generator=g), torch.randn(nb, bs, kv_heads, dim, generator=g),
               torch.randn(nb, bs, kv_heads, dim, generator=g)) for _ in range(full_layers)]
    ctx = ForwardContext(attn_metadata=md, kv_caches=[(x[3], x[4]) for x in layers], backend=None)
    reuse = ReuseConfig(full_layers=full_layers, recompute_ratio=0.25, selector=selector, rescore_layers=0)
    b = _SeqBlend(request=None, reuse=reuse, reused_rows=torch.arange(2, 10), reused_pos=torch.arange(8, 16),
                  offsets=torch.arange(8) % 4, seq_index=0, seg_lens=[4, 4], query_rows=torch.arange(10, 14))
    bl = _step_blend()
    bl._seqs, bl.selection_seconds = [b], 0.0
    return bl, b, ctx, layers, table, bs


def _reference_mass(q, k, k_cache, table, bs, scale):
    """Plain per-head softmax of the query rows (step rows 10..13, positions 16..19) over the keys
    of positions 0..19: the prefix's from the cache, the step's fresh -> [20] mean over rows, heads."""
    prefix = torch.stack([k_cache[table[0, p // bs], p % bs] for p in range(6)])
    keys = torch.cat([prefix, k])                                        # [20, KVH, D] by position
    heads = q.shape[1]
    group = heads // keys.shape[1]
    mass = torch.zeros(20)
    for r in range(10, 14):
        pos = r + 6
        for h in range(heads):
            p = torch.softmax(keys[:pos + 1, h // group] @ q[r, h] * scale, dim=0)
            mass[:pos + 1] += p / (4 * heads)
    return mass


def test_query_fused_mass_equals_plain_per_head_softmax_fused_over_layers():
    """query_fused's score: the query rows' attention probability on each reused token, averaged
    over rows, heads and the fused layers 1..F-1 (layer 0 probed but not counted), against a plain
    per-head softmax; the selection keeps the top of it."""
    bl, b, ctx, layers, table, bs = _probe_case("query_fused", full_layers=4)
    assert query_layers(b.reuse) == (1, 2, 3) and selectors.fused_layers(1) == (0,)
    scale = 8 ** -0.5
    for layer, (q, k, v, kc, vc) in enumerate(layers):
        bl._probe(layer, q, k, v, kc, vc, ctx)
    want = sum(_reference_mass(q, k, kc, table, bs, scale)[8:16] for q, k, _, kc, _ in layers[1:]) / 3
    torch.testing.assert_close(b.query_mass, want, atol=1e-6, rtol=0)
    keep = bl._keep_mask(b)
    assert int(keep.sum()) == bl._keep_count(b) == 2
    assert torch.equal(torch.nonzero(keep).flatten(), torch.topk(want, 2).indices.sort().values)


def test_chunk_anchor_probe_reads_deviation_at_the_selection_layer():
    """chunk_anchor's probe: the same fused query mass as query_fused, and the K/V deviation against
    the cached copies at the selection layer (F-1) only."""
    bl, b, ctx, layers, table, bs = _probe_case("chunk_anchor", full_layers=3)
    for layer, (q, k, v, kc, vc) in enumerate(layers):
        bl._probe(layer, q, k, v, kc, vc, ctx)
    want = sum(_reference_mass(q, k, kc, table, bs, 8 ** -0.5)[8:16] for q, k, _, kc, _ in layers[1:]) / 2
    torch.testing.assert_close(b.query_mass, want, atol=1e-6, rtol=0)
    q, k, v, kc, vc = layers[2]
    slots = ctx.attn_metadata.slot_mapping[2:10]
    dev = selectors.kv_deviation_scores(k[2:10], v[2:10], kc.view(-1, 2, 8)[slots], vc.view(-1, 2, 8)[slots])
    torch.testing.assert_close(b.scores, dev)
    keep = bl._keep_mask(b)
    assert int(keep.sum()) == bl._keep_count(b) == 2


def test_query_selectors_are_one_stage():
    for selector in selectors.QUERY_SELECTORS:
        assert ReuseConfig(selector=selector).resolved(30).rescore_layers == 0
        with pytest.raises(ValueError, match="one stage"):
            ReuseConfig(selector=selector, rescore_layers=2).verify(30)
        with pytest.raises(ValueError, match="full_layers must be >= 1"):
            ReuseConfig(selector=selector, full_layers=0).verify(30)
