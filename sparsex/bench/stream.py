"""`--stream`: a long RAG stream on a KV pool smaller than the corpus, once per segment-eviction
policy: the segment hit rate per window of queries, as tables and (`--plot-dir`) a plot."""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from sparsex.bench.engine_cache import EngineCache
from sparsex.bench.policy_summary import mean, percentile
from sparsex.bench.pyplot import Series, pyplot
from sparsex.bench.replay import progress_bar
from sparsex.bench.report import environment, jsonable, loadavg, write_csv
from sparsex.bench.workload_config import StreamConfig
from sparsex.bench.workload_prompts import tokenized_workload


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
    w = tokenized_workload(engines, lambda tok: rag_workload(
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
        engine = engines.take("sparsex", "timed", num_blocks, eviction=ev)
        ins0, evi0 = engine.segment_index.num_inserted, engine.segment_index.num_evicted
        pre0 = engine.stats().num_preemptions
        recs = []
        for i in progress_bar(range(len(prompts)), f"stream/{ev}", cfg.progress):
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
    env.update(load_avg_end=loadavg(), num_blocks=num_blocks, corpus_tokens=corpus)
    os.makedirs(cfg.out, exist_ok=True)
    meta = {"config": jsonable(asdict(cfg)), "environment": env}
    with open(os.path.join(cfg.out, "stream.json"), "w") as f:
        json.dump({**meta, "summary": [asdict(s) for s in summaries], "requests": [asdict(r) for r in records]},
                  f, indent=1)
    write_csv(os.path.join(cfg.out, "stream_requests.csv"), [asdict(r) for r in records])
    write_csv(os.path.join(cfg.out, "stream_summary.csv"),
               [{k: v for k, v in asdict(s).items() if k != "window_hit_rates"} for s in summaries])
    with open(os.path.join(cfg.out, "stream_summary.md"), "w") as f:
        f.write(stream_markdown(summaries, cfg))
    if cfg.plot_dir is not None:
        plot_stream(summaries, os.path.join(cfg.plot_dir, "workload_stream_hit_rate.png"), cfg, env)
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
                         sum(r.cached_tokens for r in recs) / max(1, prompt), mean(ttft) or 0.0,
                         percentile(ttft, 50), inserted, evicted, preemptions, windows)


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


def stream_series(summaries: list[StreamSummary], window: int) -> dict[str, Series]:
    """Per eviction policy: queries served at the end of each window, and the window's segment hit
    rate in percent of looked-up tokens."""
    return {s.eviction: ([min((j + 1) * window, s.num_requests) for j in range(len(s.window_hit_rates))],
                         [100 * r for r in s.window_hit_rates]) for s in summaries}


def plot_stream(summaries: list[StreamSummary], path: str, cfg: StreamConfig, env: dict) -> dict[str, Series]:
    series = stream_series(summaries, cfg.window)
    plt = pyplot()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in summaries:
        xs, ys = series[s.eviction]
        ax.plot(xs, ys, marker="o", ms=3, label=f"{s.eviction} (overall {s.segment_lookup_hit_rate:.1%})")
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
    return series
