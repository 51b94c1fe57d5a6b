"""Segment-reuse benchmark on RAG prompts of real text: fidelity and TTFT of each selector.

Setup (mirrors how RAG traffic reuses passages): every query's passages were seen before in
another order (a priming prompt that stands them at other positions, with another question), so
all of them are segment hits at new positions; the system prompt is an exact prefix hit. The
question (and the teacher-forced continuation) is new content.

    .venv/bin/python benchmarks/segment_reuse.py --queries 12 --passages 6 --dtype float32
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from dataclasses import asdict, dataclass

import torch

from sparsex.bench import add_engine_flag
from sparsex.bench.fidelity import FidelityResult, pieces_prompt, reference, run_to_completion, teacher_forced
from sparsex.bench.flop_model import FlopModel
from sparsex.bench.report import resolved_dtype
from sparsex.bench.workloads import rag_workload
from sparsex.config import EngineConfig, ReuseConfig
from sparsex.engine.llm_engine import LLMEngine
from sparsex.sampling_params import SamplingParams

DEFAULT_VARIANTS = [
    ("none", 2, 0.15), ("random", 2, 0.15), ("boundary", 2, 0.15), ("kv_deviation", 2, 0.15), ("sparse_q", 2, 0.15),
    ("all", 2, 1.0),
]


@dataclass
class Row:
    selector: str
    full_layers: int
    recompute_ratio: float
    top1: float
    kl: float
    kl_p90: float
    match_len: float
    compute_share: float       # token-layers computed / full prefill
    selection_ms: float


def _engine(model: str, dtype: str, cache: str, seed: int = 0, device: str = "cpu") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, cache=cache, seed=seed, device=device, reuse=ReuseConfig()))


def build_queries(engine: LLMEngine, num_queries: int, k: int, seed: int):
    """(eval prompt, priming prompt) pairs: both TokenizedPrompts; only passages are reusable."""
    reqs = rag_workload(engine.tokenizer, num_queries=num_queries, k=k, num_passages=max(60, 4 * k), seed=seed)
    pairs = []
    for i, r in enumerate(reqs):
        head, passages, question = r.segments[0], r.segments[1:-1], r.segments[-1]
        reusable = [True] + [True] * len(passages) + [False]
        ev = pieces_prompt(engine, [head, *passages, question], reusable)
        # priming: a derangement (rotate by one) under another query's question
        other_q = reqs[(i + 1) % len(reqs)].segments[-1]
        primed = passages[1:] + passages[:1]
        pr = pieces_prompt(engine, [head, *primed, other_q], reusable)
        pairs.append((ev, pr))
    return pairs


def compute_share(res: FidelityResult, flops: FlopModel, full_layers: int) -> float:
    """Token-layers computed / full prefill (`FlopModel.token_layers`)."""
    n = res.num_prompt_tokens - res.num_cached_tokens
    kept = n - res.num_reused_tokens + res.num_recomputed_tokens
    return flops.token_layers(n, kept, full_layers) / (res.num_prompt_tokens * flops.num_layers)


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flag(ap, "model")
    add_engine_flag(ap, "dtype")
    add_engine_flag(ap, "device")
    ap.add_argument("--queries", type=int, default=12)
    ap.add_argument("--passages", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=24, help="teacher-forced continuation length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=None, help="selector:F:ratio,... (default: the standard set)")
    ap.add_argument("--boundary-share", type=float, default=None, help="sparse_q: budget share for segment starts")
    ap.add_argument("--ttft", action="store_true", help="time TTFT of none / prefix / sparsex instead of fidelity")
    ap.add_argument("--out", default=None, help="write per-query JSON here")
    args = ap.parse_args(argv)
    variants = DEFAULT_VARIANTS if not args.variants else [
        (v.split(":")[0], int(v.split(":")[1]), float(v.split(":")[2])) for v in args.variants.split(",")]

    if args.ttft:
        return ttft_table(args)
    ref = _engine(args.model, args.dtype, "none", device=args.device)
    pol = _engine(args.model, args.dtype, "sparsex", device=args.device)
    if args.boundary_share is not None:
        pol.config.reuse = dataclasses.replace(pol.config.reuse, boundary_share=args.boundary_share)
    pairs = build_queries(ref, args.queries, args.passages, args.seed)
    refs = [reference(ref, ev, args.tokens) for ev, _ in pairs]
    for _, pr in pairs:
        run_to_completion(pol, pr, SamplingParams(temperature=0, max_tokens=1))
    flops = FlopModel.from_config(ref.model_config)
    rows, per_query = [], {}
    for sel, F, ratio in variants:
        reuse = {"selector": sel, "full_layers": F, "recompute_ratio": ratio, "rescore_layers": 0}   # one-stage rules
        sel0 = pol.runner.timings.selection_s
        results = [teacher_forced(pol, ev, cont, lps, reuse=reuse) for (ev, _), (cont, lps) in zip(pairs, refs)]
        sel_s = pol.runner.timings.selection_s - sel0
        kls = sorted(r.kl for r in results)
        row = Row(sel, F, ratio, statistics.mean(r.top1 for r in results), statistics.mean(kls),
                  kls[int(0.9 * (len(kls) - 1))], statistics.mean(r.match_len for r in results),
                  statistics.mean(compute_share(r, flops, F) for r in results), 1000 * sel_s / len(results))
        rows.append(row)
        per_query[f"{sel}:{F}:{ratio}"] = [asdict(r) for r in results]
        print(f"{sel:>14} F={F} r={ratio:<5} top1={100*row.top1:5.1f}%  KL={row.kl:.4f}  KLp90={row.kl_p90:.4f}  "
              f"match={row.match_len:4.1f}  compute={100*row.compute_share:4.1f}%  select={row.selection_ms:6.1f} ms", flush=True)
        pol.check_integrity()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": [asdict(r) for r in rows], "per_query": per_query}, f, indent=1)
    return rows


def ttft_table(args) -> list:
    """TTFT of the same eval prompts under none / prefix / sparsex (each engine primed alike)."""
    one = SamplingParams(temperature=0, max_tokens=1)
    engines = {c: _engine(args.model, args.dtype, c, device=args.device) for c in ("none", "prefix", "sparsex")}
    pairs = build_queries(engines["none"], args.queries, args.passages, args.seed)
    flops = FlopModel.from_config(engines["none"].model_config)
    for eng in engines.values():                      # warm-up + priming (registers passages for sparsex)
        for _, pr in pairs:
            run_to_completion(eng, pr, one)
    rows = []
    sx = engines["sparsex"]
    sel0, copy0 = sx.runner.timings.selection_s, sx.runner.timings.blend_copy_s
    # interleaved per query, so a change in machine load hits every policy alike
    res = {c: [] for c in engines}
    for ev, _ in pairs:
        for c, eng in engines.items():
            res[c].append(run_to_completion(eng, ev, one)[0])
    sel = (sx.runner.timings.selection_s - sel0) / len(pairs)          # host seconds
    copy = (sx.runner.timings.blend_copy_s - copy0) / len(pairs)
    base = statistics.mean(o.metrics.ttft for o in res["none"])
    print(f"prompts: {statistics.mean(len(o.prompt_token_ids) for o in res['none']):.0f} tokens on average, "
          f"{args.passages} passages, {args.queries} queries, {resolved_dtype(args.dtype, args.device)}, "
          f"torch threads {torch.get_num_threads()}")
    print("| policy | TTFT mean | vs none | prefix-hit tokens | segment-reused | recomputed | compute share |")
    print("|---|---|---|---|---|---|---|")
    F = engines["sparsex"].config.reuse.full_layers
    for c, outs in res.items():
        t = statistics.mean(o.metrics.ttft for o in outs)
        n = statistics.mean(len(o.prompt_token_ids) for o in outs)
        cached = statistics.mean(o.num_cached_tokens for o in outs)
        reused = statistics.mean(o.num_reused_tokens for o in outs)
        rec = statistics.mean(o.num_recomputed_tokens for o in outs)
        if c == "sparsex":
            share = flops.token_layers(n - cached, n - cached - reused + rec, F) / (n * flops.num_layers)
        else:
            share = (n - cached) / n
        rows.append((c, t, t / base, cached, reused, rec, share))
        print(f"| {c} | {1000*t:.0f} ms | {t/base:.3f}x | {cached:.0f} | {reused:.0f} | {rec:.0f} | {100*share:.1f}% |")
    print(f"sparsex breakdown per request: KV copy + re-rotate {1000*copy:.1f} ms, selection {1000*sel:.1f} ms "
          f"({100*sel/statistics.mean(o.metrics.ttft for o in res['sparsex']):.2f}% of its TTFT)")
    return rows


if __name__ == "__main__":
    main()
