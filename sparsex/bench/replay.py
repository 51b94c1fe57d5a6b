"""Replay of a workload: full prefill (the `none` policy and the fidelity reference), then each
policy on a timed engine and its fidelity twin; one `RequestRecord` per request."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sparsex.bench.answer_scoring import exact_match, token_f1
from sparsex.bench.flop_model import FlopModel
from sparsex.bench.workload_config import WorkloadBenchConfig

if TYPE_CHECKING:
    from sparsex.bench.policies import Policy
    from sparsex.bench.workloads import Request
    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.inputs import TokenizedPrompt


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
    span_search_ms: float = 0.0    # host time finding transparent spans (on the TTFT path)
    reused_by_source: dict = field(default_factory=dict)   # ReusedSpan.source -> tokens
    recurring_tokens: int = 0      # tokens of units (passages, results) an earlier request or the ingestion held
    recurring_served: int = 0      # ... of them served from cache (exact prefix or a reused span)


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
    reference: the distributions are captured at each decode step, as `fidelity.reference` does."""
    from sparsex.bench.fidelity import run_to_completion
    from sparsex.sampling_params import SamplingParams
    n = len(prompt.token_ids)
    steps = max(fidelity_tokens or 1, answer_tokens or 1)
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=bool(fidelity_tokens) and past_eos)
    out, cap = run_to_completion(engine, prompt, params, distributions_from=n - 1 if fidelity_tokens else None)
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


def progress_bar(items, desc: str, enabled: bool):
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
                     keep: bool, recurring: list[Any] | None = None) -> tuple[list[Reference], list[RequestRecord]]:
    """The `none` policy: every request under full prefill, which is also the fidelity reference."""
    refs, records = [], []
    L = flops.num_layers
    for i in progress_bar(range(len(requests)), f"{cfg.workload}/none", cfg.progress):
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
        if recurring is not None:
            rec.recurring_tokens = int(recurring[i].sum())        # nothing served: full prefill
        if fid[i]:    # the reference itself: exact by definition
            rec.top1, rec.kl, rec.match_len, rec.miss_margins = 1.0, 0.0, len(ref.cont), []
            rec.position_kl, rec.miss_positions = [0.0] * len(ref.cont), []
        if req.workload == "rag":
            _score(rec, _decode(engine, ref.answer_ids), req)
        records.append(rec)
    engine.check_integrity()
    return refs, records


def replay_policy(cfg: WorkloadBenchConfig, policy: Policy, timed: LLMEngine,
                  twin: LLMEngine | None, requests: list[Request], prompts: list[TokenizedPrompt],
                  refs: list[Reference] | None, fid: list[bool], flops: FlopModel,
                  recurring: list[Any] | None = None) -> list[RequestRecord]:
    """`recurring`: per request, its recurring tokens (bool mask, `TokenizedWorkload.recurring`)."""
    from sparsex.bench.fidelity import run_to_completion, teacher_forced
    from sparsex.bench.prompt_forms import served_mask
    from sparsex.sampling_params import SamplingParams

    reuse = policy.overrides
    F = policy.full_layers(flops.num_layers)
    knobs = policy.knobs()
    rescore = knobs.resolved(flops.num_layers).rescore_layers if knobs is not None else 0
    records = []
    for i in progress_bar(range(len(requests)), f"{cfg.workload}/{policy.name}", cfg.progress):
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
        spans = [(s.start, s.end) for s in out.reused_spans if s.source != "approx_prefix"]
        approx = sum(s.num_tokens for s in out.reused_spans if s.source == "approx_prefix")
        if sum(e - s for s, e in spans) + approx != reused:
            raise RuntimeError(f"{policy.name}/{req.request_id}: recorded spans cover "
                               f"{sum(e - s for s, e in spans)} + {approx} tokens, the engine reused {reused}")
        tl, fl = flops.prefill(n, cached + approx, spans, rec_n, F, out.num_candidate_tokens, rescore)
        rec = RequestRecord(
            cfg.workload, policy.name, i, req.request_id, n, cached, reused, rec_n, n - cached - reused + rec_n,
            tl, fl / 1e9, out.metrics.ttft or 0.0, 1000 * (st1.selection_seconds - st0.selection_seconds),
            st1.segment_cache_queries - st0.segment_cache_queries, st1.segment_cache_hits - st0.segment_cache_hits,
            fid[i], approx_prefix_tokens=approx,
            span_search_ms=1000 * (st1.span_search_seconds - st0.span_search_seconds))
        for s in out.reused_spans:
            rec.reused_by_source[s.source] = rec.reused_by_source.get(s.source, 0) + s.num_tokens
        if recurring is not None:
            mask = recurring[i]
            served = served_mask(n, cached, out.reused_spans)
            rec.recurring_tokens, rec.recurring_served = int(mask.sum()), int((mask & served).sum())
        if rag:
            _score(rec, _decode(timed, list(out.outputs[0].token_ids)), req)
        # twin run: the same request teacher forced (fidelity subset) or plain (to keep in step)
        if twin is not None:
            if fid[i]:
                # as served: the policy's approx_prefix (a twin replaying in order may continue its chain)
                res = teacher_forced(twin, prompt, refs[i].cont, refs[i].lps,
                                     reuse=reuse, approx_prefix=knobs is not None and knobs.approx_prefix)
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

