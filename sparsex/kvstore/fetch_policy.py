"""Fetch a span's KV from a store tier only when that is cheaper than recomputing it.

    est_fetch     = latency + bytes / bandwidth            (the tier's measured estimates)
                  + bytes / load_bytes_per_s               (decode + install, measured here)
    est_recompute = tokens / prefill_tokens_per_s          (the engine's measured prefill throughput)

A small model on a fast GPU recomputes a short span faster than a remote store returns it; a large
model on a CPU does the opposite. Before both sides are measured the policy fetches (optimistic: the
first fetches are what measure the store); until a fetched record was decoded and installed, the
load term is left out.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

from sparsex.config import STORE_FETCH_MODES

_EWMA_ALPHA = 0.2


def ewma(old: float | None, sample: float) -> float:
    """Exponentially weighted moving average (None: no sample yet); the tiers' estimates use it too."""
    return sample if old is None else (1 - _EWMA_ALPHA) * old + _EWMA_ALPHA * sample


# a read that moved less than this is a latency sample (its transfer time is negligible)
SMALL_READ_BYTES = 16 << 10


@dataclass
class TransferEstimate:
    """A tier's measured read cost: latency per round trip and bandwidth, as EWMAs of its reads.
    Not locked: each tier updates and reads it under its own lock."""
    latency: float | None = None          # seconds per round trip with next to no payload
    _bytes: float | None = None           # EWMAs of bytes and transfer seconds: their ratio is the
    _seconds: float | None = None         # size-weighted bandwidth

    def observe(self, seconds: float, nbytes: int) -> None:
        """One read of `nbytes` that took `seconds`. The first read seeds the latency even when large
        (an overestimate the next small read corrects; a store's first reads are mostly misses anyway)."""
        if nbytes < SMALL_READ_BYTES or self.latency is None:
            self.latency = ewma(self.latency, seconds if nbytes < SMALL_READ_BYTES else seconds / 2)
        if nbytes > 0:
            self._bytes = ewma(self._bytes, float(nbytes))
            self._seconds = ewma(self._seconds, max(seconds - self.latency, seconds / 2))

    @property
    def bandwidth(self) -> float | None:
        """Bytes/s of reads that returned data (latency excluded); None before any."""
        return None if self._bytes is None or not self._seconds else self._bytes / self._seconds


@dataclass
class FetchDecision:
    fetch: bool
    est_fetch_s: float | None
    est_recompute_s: float | None
    reason: str


class FetchPolicy:
    """Fetch a span from a tier only when it is cheaper than recomputing it: est_fetch = latency +
    bytes / bandwidth + bytes / load rate vs est_recompute = tokens / prefill_tokens_per_s."""

    def __init__(self, mode: str):
        """`mode`: one of STORE_FETCH_MODES (EngineConfig.segment_store_fetch)."""
        if mode not in STORE_FETCH_MODES:
            raise ValueError(f"fetch mode must be one of {STORE_FETCH_MODES}, got {mode!r}")
        self.mode = mode
        self.fetched = 0          # decisions to fetch
        self.recomputed = 0       # decisions to recompute
        self._lock = threading.Lock()
        self._tokens: float | None = None      # EWMAs of tokens and seconds per prefill: their ratio is
        self._seconds: float | None = None     # the size-weighted throughput
        self._load_bytes: float | None = None  # the same for decode + install of fetched records
        self._load_seconds: float | None = None

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """Feed one prefill's tokens and seconds (EWMA of the engine's prefill throughput)."""
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            self._tokens, self._seconds = ewma(self._tokens, tokens), ewma(self._seconds, seconds)

    def observe_load(self, nbytes: int, seconds: float) -> None:
        """Feed one fetched record's bytes and the seconds its decode (checksum) + install took."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            self._load_bytes, self._load_seconds = ewma(self._load_bytes, nbytes), ewma(self._load_seconds, seconds)

    def load_bytes_per_s(self) -> float | None:
        with self._lock:
            return None if self._load_bytes is None else self._load_bytes / self._load_seconds

    def prefill_tokens_per_s(self) -> float | None:
        with self._lock:
            return None if self._tokens is None else self._tokens / self._seconds

    def decide(self, num_tokens: int, nbytes: int, bandwidth: float | None,
               latency: float | None) -> FetchDecision:
        tps = self.prefill_tokens_per_s()
        est_fetch = None if not bandwidth or bandwidth <= 0 else (latency or 0.0) + nbytes / bandwidth
        load = self.load_bytes_per_s()
        if est_fetch is not None and load:
            est_fetch += nbytes / load
        est_recompute = None if tps is None else num_tokens / tps
        if self.mode == "always":
            fetch, reason = True, "mode=always"
        elif self.mode == "never":
            fetch, reason = False, "mode=never"
        elif est_fetch is None or est_recompute is None:
            fetch = True
            reason = "unmeasured " + ("store bandwidth" if est_fetch is None else "prefill throughput")
        else:
            fetch = est_fetch < est_recompute
            reason = (f"fetch {est_fetch * 1e3:.2f}ms {'<' if fetch else '>='} "
                      f"recompute {est_recompute * 1e3:.2f}ms")
        with self._lock:
            if fetch:
                self.fetched += 1
            else:
                self.recomputed += 1
        return FetchDecision(fetch, est_fetch, est_recompute, reason)
