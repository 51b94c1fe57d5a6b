"""A blended step's row selection without a device sync: the number of kept rows is computed on the
host from the rule and the segment lengths (`StepBlend._keep_count`), so it must equal what the
device-side mask keeps, for every selector and knob combination; and the sync-free index
extraction must equal torch.nonzero."""
import itertools

import pytest
import torch

from sparsex.config import ReuseConfig
from sparsex.segment.step_blend import StepBlend, _SeqBlend, _true_indices

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
    return b


def _step_blend() -> StepBlend:
    bl = StepBlend.__new__(StepBlend)      # the selection needs no forward context, model or pool
    bl._gen = torch.Generator().manual_seed(0)
    return bl


SEGMENTS = [[40], [17, 300, 5, 64], [16] * 12, [500, 500]]


@pytest.mark.parametrize("selector,ratio,boundary_tokens,share", [
    *itertools.product(["sparse_q"], [0.0, 0.02, 0.15, 0.5, 1.0], [0, 8, 40], [0.0, 0.5, 1.0]),
    *itertools.product(["kv_deviation", "boundary", "random"], [0.0, 0.15, 0.3, 1.0], [0, 16], [0.5]),
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
