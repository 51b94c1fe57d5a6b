"""Prometheus metrics of a running server, vLLM-style names under `sparsex:`.

Each `ServerMetrics` owns a CollectorRegistry (never the process-global one), so several servers
or apps can live in one process (tests) without name clashes. All `on_*` hooks are called from the
engine-loop thread only; prometheus_client's metric objects are thread-safe for the scrape.

Cumulative engine counters (EngineStats) are turned into Prometheus counters by adding the
delta since the previous snapshot, so a scrape never has to touch the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

if TYPE_CHECKING:
    from sparsex.config import ReuseConfig
    from sparsex.engine.llm_engine import EngineStats
    from sparsex.outputs import RequestOutput

_PREFIX = "sparsex:"
# Buckets (seconds) sized for CPU serving of small models up to GPU serving of larger ones.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_KL_BUCKETS = (0.0001, 0.0003, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3, 1.0)
_TOP1_BUCKETS = (0.5, 0.75, 0.9, 0.95, 0.97, 0.99, 1.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_SELECTION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

# EngineStats fields that are cumulative token/event counts -> the counter that mirrors each.
_COUNTER_FIELDS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens served by the prefix cache."),
    "approx_prefix_hits": ("approx_prefix_hits", "Prompt tokens served by blended KV blocks continuing a prefix hit."),
    "segment_cache_queries": ("segment_cache_queries", "Tokens of reusable segments looked up in the segment cache."),
    "segment_cache_hits": ("segment_cache_hits", "Tokens served by the segment cache."),
    "segment_reused_tokens": ("explicit_reused_tokens", "Reused prompt tokens found as explicit segments (whole)."),
    "transparent_reused_tokens": ("transparent_reused_tokens",
                                  "Reused prompt tokens found by content inside any prompt (transparent segments)."),
    "recomputed_tokens": ("sparse_kv_recomputed_tokens", "Reused tokens recomputed in the sparse layers."),
    "num_preemptions": ("num_preemptions", "Requests preempted (KV pool exhausted), recomputed later."),
    "quality_sampled": ("reuse_quality_sampled", "Blended requests the quality monitor chose to score (--quality-sample)."),
    "quality_compared": ("reuse_quality_compared", "Sampled requests scored against full prefill in idle capacity."),
    "quality_dropped": ("reuse_quality_dropped", "Sampled requests never scored: the queue overflowed under load, or "
                                                 "a request arrived while scoring."),
}


# StoreStats (kvstore/segment_store.py) counters -> (name, tier label, doc): per tier, one metric name; the
# shared store's label ("remote") is its kind, redis or mooncake (ServerMetrics' store_tier)
_STORE_COUNTERS = {
    "host_hits": ("segment_store_hits", "host", "Segments found in a tier below the device."),
    "host_misses": ("segment_store_misses", "host", "Segments looked up in a tier below the device and not found."),
    "host_bytes_out": ("segment_store_read_bytes", "host", "Bytes of KV loaded from a tier into the device pool."),
    "host_bytes_in": ("segment_store_written_bytes", "host", "Bytes of KV written to a tier."),
    "remote_hits": ("segment_store_hits", "remote", None),
    "remote_misses": ("segment_store_misses", "remote", None),
    "remote_bytes_read": ("segment_store_read_bytes", "remote", None),
    "remote_bytes_written": ("segment_store_written_bytes", "remote", None),
    "remote_errors": ("segment_store_errors", "remote", "Store operations that failed (server down, slow or full)."),
    "remote_corrupt": ("segment_store_corrupt_records", "remote", "Stored records dropped: checksum or format mismatch."),
    "remote_writes_dropped": ("segment_store_writes_dropped", "remote", "Writes dropped: the write-behind queue was full."),
    "remote_stale": ("segment_store_stale_records", "remote", "Index entries whose payload was gone at fetch (evicted "
                                                             "by the store, or lost with a restarted master)."),
}
_STORE_DECISIONS = {"fetch_decisions": "fetch", "recompute_decisions": "recompute"}
# spans found by content across replicas (segment_store_spans): records by outcome
_STORE_SPANS = {"span_records_published": "published", "span_installed": "installed", "span_rejected": "rejected",
                "span_missing": "missing"}


@dataclass
class _Track:
    """Per-request state needed for latency histograms."""
    arrival: float
    last_time: float
    num_tokens: int = 0          # of the first choice: the clock for TTFT / inter-token latency
    total_tokens: int = 0        # of all choices
    num_prompt_tokens: int = 0


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, reuse: ReuseConfig | None = None,
                 reuse_profile_source: str = "built-in", store_tier: str = "redis"):
        """`reuse`: the engine's segment-reuse knobs (None without segment reuse), published once as
        `sparsex:reuse_config_info` so a dashboard shows which profile and knobs the answers came from;
        `reuse_profile_source`: where the profile table came from ("built-in" or a calibrated file's
        path, sparsex/reuse_profiles.py), its `profile_source` label; `store_tier`: the `tier` label of
        the shared store's counters (its kind: redis or mooncake)."""
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, lbl = self.registry, ["model_name"]
        if reuse is not None:
            rescore = "auto" if reuse.rescore_layers is None else str(reuse.rescore_layers)
            Info(_PREFIX + "reuse_config", "The engine's segment-reuse profile, the knobs in force and where "
                                           "the profile table came from (built-in or a calibrated file).",
                 registry=r).info({"model_name": model_name, "reuse_profile": reuse.reuse_profile,
                                   "full_layers": str(reuse.full_layers),
                                   "recompute_ratio": str(reuse.recompute_ratio), "selector": reuse.selector,
                                   "rescore_layers": rescore, "profile_source": reuse_profile_source})

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(_PREFIX + name, doc, lbl, registry=r, buckets=buckets)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", _TTFT_BUCKETS).labels(model_name)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive generated tokens.", _ITL_BUCKETS).labels(model_name)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish (or abort).", _E2E_BUCKETS).labels(model_name)
        self.selection = hist("sparse_q_selection_seconds",
                              "Host time a blended step spent scoring and selecting tokens to recompute (segment reuse); "
                              "on a GPU this is kernel launch time, not device time.",
                              _SELECTION_BUCKETS).labels(model_name)
        self.reuse_kl = hist("reuse_kl", "Quality monitor: KL(full prefill || blended) per scored answer, mean over its "
                                         "tokens (nats).", _KL_BUCKETS).labels(model_name)
        self.reuse_top1 = hist("reuse_top1", "Quality monitor: share of a scored answer's tokens where the blend's "
                                             "top-1 is full prefill's.", _TOP1_BUCKETS).labels(model_name)
        self.running = Gauge(_PREFIX + "num_requests_running", "Requests in the running batch.", lbl, registry=r).labels(model_name)
        self.waiting = Gauge(_PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.", lbl, registry=r).labels(model_name)
        self.kv_usage = Gauge(_PREFIX + "kv_cache_usage_perc",
                              "Fraction (0-1) of KV blocks held by requests or segment entries.", lbl, registry=r).labels(model_name)
        self.controlled_ratio = Gauge(_PREFIX + "reuse_recompute_ratio",
                                      "The recompute_ratio --quality-target holds now for requests without their own.",
                                      lbl, registry=r).labels(model_name)
        self._counters = {field: Counter(_PREFIX + name, doc, lbl, registry=r).labels(model_name)
                          for field, (name, doc) in _COUNTER_FIELDS.items()}
        self.success = Counter(_PREFIX + "request_success", "Finished requests by finish reason.",
                               lbl + ["finished_reason"], registry=r)
        self.rejected = Counter(_PREFIX + "request_rejected", "Requests refused before queuing, by reason.",
                                lbl + ["reason"], registry=r)
        self.prompt_tokens = Counter(_PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", lbl, registry=r).labels(model_name)
        self.generation_tokens = Counter(_PREFIX + "generation_tokens", "Generated tokens.", lbl, registry=r).labels(model_name)
        counters: dict[str, Counter] = {}
        for name, _, doc in _STORE_COUNTERS.values():
            if doc is not None:
                counters[name] = Counter(_PREFIX + name, doc, lbl + ["tier"], registry=r)
        self._store_counters = {field: counters[name].labels(model_name, store_tier if tier == "remote" else tier)
                                for field, (name, tier, _) in _STORE_COUNTERS.items()}
        decisions = Counter(_PREFIX + "segment_store_decisions",
                            "Spans the shared store held, by choice: fetch (cheaper than recomputing) or recompute.",
                            lbl + ["decision"], registry=r)
        self._store_decisions = {field: decisions.labels(model_name, d) for field, d in _STORE_DECISIONS.items()}
        spans = Counter(_PREFIX + "segment_store_span_records",
                        "Records of spans found by content (segment_store_spans): published with their anchors, "
                        "installed after the token check, rejected by it, or missing from the store (evicted, "
                        "lost).", lbl + ["outcome"], registry=r)
        self._store_spans = {field: spans.labels(model_name, o) for field, o in _STORE_SPANS.items()}
        self._store_spans["span_refs_removed"] = Counter(
            _PREFIX + "segment_store_span_refs_removed", "Stale references removed from the anchor index "
            "(their record was evicted, lost or corrupt).", lbl, registry=r).labels(model_name)
        self.store_fetch = Counter(_PREFIX + "segment_store_fetch_seconds",
                                   "Seconds of shared-store round trips on the scheduling path.", lbl,
                                   registry=r).labels(model_name)
        self.store_up = Gauge(_PREFIX + "segment_store_up", "1 while the shared store answers, 0 while it is down.",
                              lbl, registry=r).labels(model_name)
        self._last: dict[str, float] = {}
        self._tracks: dict[str, _Track] = {}

    # ---- engine-loop hooks ----------------------------------------------------------------------
    def on_quality(self, results: list) -> None:
        """Scores from the quality monitor (engine/quality_monitor.QualityResult)."""
        for r in results:
            self.reuse_kl.observe(r.kl)
            self.reuse_top1.observe(r.top1)

    def on_added(self, request_id: str, arrival: float, num_prompt_tokens: int) -> None:
        self._tracks[request_id] = _Track(arrival, arrival, num_prompt_tokens=num_prompt_tokens)

    def on_output(self, out: RequestOutput, now: float) -> None:
        t = self._tracks.get(out.request_id)
        if t is None:
            return
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        t.total_tokens = sum(len(c.token_ids) for c in out.outputs)
        if n > t.num_tokens:
            if t.num_tokens == 0:
                self.ttft.observe(now - t.arrival)
            else:
                gap = (now - t.last_time) / (n - t.num_tokens)
                for _ in range(n - t.num_tokens):
                    self.itl.observe(gap)
            t.last_time = now
            t.num_tokens = n
        if out.finished:
            reason = (out.outputs[0].finish_reason if out.outputs else None) or "abort"
            self._finish(out.request_id, now, reason)

    def on_aborted(self, request_id: str, now: float) -> None:
        t = self._tracks.get(request_id)
        if t is not None:
            self._finish(request_id, now, "abort")

    def on_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def _finish(self, request_id: str, now: float, reason: str) -> None:
        t = self._tracks.pop(request_id)
        self.e2e.observe(now - t.arrival)
        self.success.labels(self.model_name, reason).inc()
        self.prompt_tokens.inc(t.num_prompt_tokens)
        self.generation_tokens.inc(t.total_tokens)

    def on_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        for field, counter in self._counters.items():
            self._add_delta(field, getattr(stats, field), counter.inc)
        self._add_delta("selection_seconds", stats.selection_seconds, self.selection.observe)
        if stats.controlled_ratio is not None:
            self.controlled_ratio.set(stats.controlled_ratio)
        store = stats.store
        if store is not None:
            for field, counter in {**self._store_counters, **self._store_decisions, **self._store_spans}.items():
                self._add_delta("store." + field, getattr(store, field), counter.inc)
            self._add_delta("store.fetch_seconds", store.fetch_seconds, self.store_fetch.inc)
            self.store_up.set(1 if store.remote_up else 0)

    def _add_delta(self, key: str, value: float, sink) -> None:
        delta = value - self._last.get(key, 0)
        self._last[key] = value
        if delta > 0:           # counters only go up (an engine counter reset just re-bases)
            sink(delta)

    # ---- exposition -------------------------------------------------------------------------
    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        return generate_latest(self.registry)
