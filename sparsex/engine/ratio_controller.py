"""`quality_target`: the recompute_ratio moved, within bounds, so the quality monitor's KL holds a target.

The quality monitor (engine/quality_monitor.py) scores a sample of served blended answers against full
prefill in idle capacity. Each score updates an exponentially weighted mean of their KL; while that
mean is above the target the ratio rises by `STEP`, while it is below `LOWER_BELOW` x the target the
ratio falls by `STEP` (the band between holds it still, so one noisy score does not make it swing),
always within [QUALITY_TARGET_RATIO_MIN, QUALITY_TARGET_RATIO_MAX]. The ratio applies to requests that
set neither `recompute_ratio` nor `reuse_profile` themselves (explicit knobs win, as everywhere).

The engine owns the controller and is its only writer: it feeds the scores it produced
(`LLMEngine.run_quality_checks`) and reads `ratio` when it resolves a request's knobs.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparsex.config import QUALITY_TARGET_RATIO_MAX, QUALITY_TARGET_RATIO_MIN

STEP = 1.25            # the ratio's multiplicative move per score outside the band
LOWER_BELOW = 0.5      # the ratio falls only while the mean KL is below this share of the target
EWMA_WEIGHT = 0.25     # the newest score's weight in the mean


@dataclass
class RatioController:
    target: float                      # KL(full prefill || reuse), nats, mean over an answer's tokens
    ratio: float                       # the ratio in force for requests without their own
    lo: float = QUALITY_TARGET_RATIO_MIN
    hi: float = QUALITY_TARGET_RATIO_MAX
    kl_mean: float | None = None       # the weighted mean of the scores so far (None before the first)
    num_raised: int = 0
    num_lowered: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.target, bool) or not isinstance(self.target, (int, float)) or not self.target > 0:
            raise ValueError(f"quality_target must be a KL > 0 (nats), got {self.target!r}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)):
            raise ValueError(f"quality_target moves a numeric recompute_ratio, got {self.ratio!r}")
        self.ratio = min(self.hi, max(self.lo, float(self.ratio)))

    def observe(self, kl: float) -> float:
        """One monitored score; returns the ratio now in force."""
        if not kl >= 0:                                 # nan or negative: not a score
            raise ValueError(f"a monitored KL must be >= 0, got {kl!r}")
        self.kl_mean = kl if self.kl_mean is None else (1 - EWMA_WEIGHT) * self.kl_mean + EWMA_WEIGHT * kl
        if self.kl_mean > self.target and self.ratio < self.hi:
            self.ratio = min(self.hi, self.ratio * STEP)
            self.num_raised += 1
        elif self.kl_mean < LOWER_BELOW * self.target and self.ratio > self.lo:
            self.ratio = max(self.lo, self.ratio / STEP)
            self.num_lowered += 1
        return self.ratio
