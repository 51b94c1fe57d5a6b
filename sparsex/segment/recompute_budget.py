"""recompute_ratio="auto": each blended request's share of reused tokens to recompute, set at
admission from what the host already knows about it.

The signal is the request's **new share**: new tokens / (new + reused tokens after the exact
prefix), reused counting the approximate prefix it continues. On one-message rag (SmolLM2-135M,
96 requests, fp32, one H100) the reuse error sits in the nearly fully reused prompts: requests
with 12-25 new tokens of ~3.5k (new share below ~0.7%) carry most of the KL at a fixed 12.5%, and
recomputing 25% of their reused tokens removes most of it, while the requests with 35-55 new
tokens lose almost nothing at 6.25% (docs/benchmarks/reuse-quality.md, "Per-request budget").
So the ratio falls from AUTO_RATIO_MAX at a new share of AUTO_SHARE_LOW or less to AUTO_RATIO_MIN
at AUTO_SHARE_HIGH or more, log-linearly in between.

Only host signals: a signal read from the device inside the pass (the probe's deviation mass,
the query rows' attention on reused rows) would cost a device->host sync before the sparse
layers' metadata could be built, and a blended forward has none (step_blend.py). Those device
signals still choose *which* rows are recomputed; this rule sets *how many*.
"""
from __future__ import annotations

import math

from sparsex.config import AUTO_RATIO_MAX, AUTO_RATIO_MIN

AUTO_SHARE_LOW = 0.004     # new share at or below which a request recomputes AUTO_RATIO_MAX
AUTO_SHARE_HIGH = 0.006    # ... at or above which it recomputes AUTO_RATIO_MIN


def new_share(num_new: int, num_reused: int) -> float:
    """The share of a request's prompt after its exact prefix that is new (computed, not reused)."""
    if num_new < 0 or num_reused < 0:
        raise ValueError(f"token counts must be >= 0, got num_new={num_new}, num_reused={num_reused}")
    total = num_new + num_reused
    return num_new / total if total else 1.0


def auto_recompute_ratio(num_new: int, num_reused: int) -> float:
    """The recompute_ratio "auto" gives a request with `num_new` new and `num_reused` reused
    tokens (approximate prefix included): in [AUTO_RATIO_MIN, AUTO_RATIO_MAX], non-increasing in
    the new share."""
    s = new_share(num_new, num_reused)
    if s <= AUTO_SHARE_LOW:
        return AUTO_RATIO_MAX
    if s >= AUTO_SHARE_HIGH:
        return AUTO_RATIO_MIN
    t = math.log(s / AUTO_SHARE_LOW) / math.log(AUTO_SHARE_HIGH / AUTO_SHARE_LOW)     # 0..1
    return AUTO_RATIO_MAX * (AUTO_RATIO_MIN / AUTO_RATIO_MAX) ** t
