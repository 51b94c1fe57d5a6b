"""Confidence intervals for the workload benchmark's per-request metrics: a percentile bootstrap
over requests.

The resampling unit is the request, not the teacher-forced position: the positions of one request
share its prompt and its reused KV, so their errors are correlated, and the rag runs show it (two of
sixteen requests carry most of the KL). Comparisons of two policies on the same requests are paired
(the difference of each request's metric is resampled), which removes the spread that comes from
which requests were drawn and keeps the one that comes from the policies.

numpy only: one percentile bootstrap does not justify a scipy dependency.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float


def bootstrap_mean(values: Sequence[float], confidence: float = 0.95, num_resamples: int = 10_000,
                   seed: int = 0, weights: Sequence[float] | None = None) -> Interval:
    """The mean of `values` and its percentile-bootstrap interval (resampling the values, each
    resample as large as the sample). Deterministic given `seed`. `weights` (one per value, > 0):
    the weighted mean, each resample's too (a request's metric weighted by its positions)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if num_resamples < 1:
        raise ValueError(f"num_resamples must be >= 1, got {num_resamples}")
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"need a non-empty 1-d sample, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("the sample has a non-finite value")
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != x.shape or not (np.isfinite(w).all() and (w > 0).all()):
        raise ValueError(f"need one finite weight > 0 per value, got {w.shape[0] if w.ndim else w} for {x.size}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(num_resamples, x.size))                    # [num_resamples, n]
    means = (x[idx] * w[idx]).sum(axis=1) / w[idx].sum(axis=1)                     # [num_resamples]
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(means, [tail, 100.0 - tail])
    return Interval(float((x * w).sum() / w.sum()), float(low), float(high))


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95,
                      num_resamples: int = 10_000, seed: int = 0,
                      weights: Sequence[float] | None = None) -> Interval:
    """mean(a - b) over paired samples (a[i] and b[i] measured on the same request) and its interval
    (`weights`: as in bootstrap_mean)."""
    if len(a) != len(b):
        raise ValueError(f"paired samples must have the same length, got {len(a)} and {len(b)}")
    return bootstrap_mean(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64),
                          confidence, num_resamples, seed, weights)
