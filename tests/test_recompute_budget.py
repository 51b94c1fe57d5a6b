"""recompute_ratio="auto": the rule (segment/recompute_budget.py) and its bounds."""
from __future__ import annotations

import pytest

from sparsex.config import AUTO_RATIO_MAX, AUTO_RATIO_MIN
from sparsex.segment.recompute_budget import AUTO_SHARE_HIGH, AUTO_SHARE_LOW, auto_recompute_ratio, new_share

pytestmark = pytest.mark.unit


def test_nearly_fully_reused_prompts_get_the_most_and_mostly_new_ones_the_least():
    assert auto_recompute_ratio(12, 3600) == AUTO_RATIO_MAX            # share 0.33%
    assert auto_recompute_ratio(40, 3600) == AUTO_RATIO_MIN            # share 1.1%
    assert auto_recompute_ratio(3000, 500) == AUTO_RATIO_MIN
    assert auto_recompute_ratio(0, 100) == AUTO_RATIO_MAX              # nothing new at all


def test_the_ratio_is_continuous_and_non_increasing_in_the_new_share():
    reused = 100_000
    ratios = [auto_recompute_ratio(n, reused) for n in range(0, 1200, 7)]
    assert all(a >= b for a, b in zip(ratios, ratios[1:]))
    assert all(AUTO_RATIO_MIN <= r <= AUTO_RATIO_MAX for r in ratios)
    # at the breakpoints, the bounds; between them, strictly between (no step)
    lo, hi = int(AUTO_SHARE_LOW * reused), int(AUTO_SHARE_HIGH * reused) + 1
    assert auto_recompute_ratio(lo, reused - lo) == pytest.approx(AUTO_RATIO_MAX)
    assert auto_recompute_ratio(hi, reused - hi) == AUTO_RATIO_MIN
    mid = auto_recompute_ratio((lo + hi) // 2, reused - (lo + hi) // 2)
    assert AUTO_RATIO_MIN < mid < AUTO_RATIO_MAX
    # log-linear: the geometric mean of the bounds at the geometric mean of the breakpoints
    g = (AUTO_SHARE_LOW * AUTO_SHARE_HIGH) ** 0.5
    assert auto_recompute_ratio(round(g * 1e7), round((1 - g) * 1e7)) == \
        pytest.approx((AUTO_RATIO_MIN * AUTO_RATIO_MAX) ** 0.5, rel=1e-4)


def test_new_share_counts_and_refuses_negative_counts():
    assert new_share(1, 3) == 0.25 and new_share(0, 0) == 1.0
    with pytest.raises(ValueError, match="num_new=-1"):
        new_share(-1, 10)
