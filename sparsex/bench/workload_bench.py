"""End-to-end workload benchmark: cache policies replayed over a RAG, chat or agent workload.

    sparsex bench workload --workload rag --policies none,sparsex --dtype float32 --out runs/rag
    sparsex bench workload --workload rag --prompt-form stuffed --policies none,prefix,sparsex --out runs/rag_stuffed
    sparsex bench workload --workload rag --no-prewarm --queries 16 --k 4 --policies none,prefix,naive,sparsex \\
        --out runs/rag_cold --plot-dir runs/rag_cold/img --threads 1
    sparsex bench workload --workload rag --stream --queries 500 --k 2 --out runs/stream

(also `python -m sparsex.bench.workload_bench ...`). Policies: `sparsex.bench.policies`. The rag
defaults are the headline configuration of docs/benchmarks.md (96 queries of k = 8 passages, the
corpus ingested first in three passes, a pool of at most `MAX_AUTO_BLOCKS` blocks), so the first
command above (float32, as the headline ran) reproduces it. The engine flags (`--model`, `--dtype`, `--device`) are
EngineConfig's, with its defaults (dtype `auto`: bfloat16 on a GPU and on a CPU with native bf16).

**Prompt forms** (`--prompt-form`, rag and agent; `prompt_forms`): `explicit` sends each unit (passage,
search result) as a segment; `stuffed`, `question-first` and `llamaindex` send the same units joined
into one message through the chat path, as unchanged LangChain and LlamaIndex clients do, so only
transparent segment reuse can find them. The rag ingestion (`--prewarm`) is the same in every form.
Every form reports the share of recurring unit tokens (held by the ingestion or an earlier request)
served from cache, with a bootstrap interval over requests.

Modules: `workload_config` (options), `prompt_forms` (layouts, recurring tokens), `workload_prompts`
(requests as token ids, corpus ingestion),
`engine_cache` (engines per cache mode and role), `replay` (per-request records), `flop_model`
(prefill work), `answer_scoring` (RAG F1/EM), `policy_summary` (per-policy summaries, intervals),
`report` (tables and files), `plots`, `stream` (`--stream`), `peer` (`--peer vllm`).

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
continuation past EOS (template tokens no user sees, nearly always agreed on: they dilute the
misses).
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
with --plot-dir, PNG plots there (`sparsex.bench.plots`; matplotlib, the `bench` extra: `pip install
sparsex[bench]`): fidelity-vs-TTFT Pareto front, TTFT CDF, stream hit rate.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from sparsex.arg_types import int_pair
from sparsex.bench import add_engine_flag, add_threads_arg, set_threads
from sparsex.bench.engine_cache import EngineCache
from sparsex.bench.peer import run_peer
from sparsex.bench.plots import plot_pareto, plot_ttft_cdf
from sparsex.bench.policy_summary import PolicySummary, compare_to_default, summarize
from sparsex.bench.prompt_forms import PROMPT_FORMS
from sparsex.bench.replay import replay_policy, replay_reference
from sparsex.bench.report import environment, fidelity_markdown, loadavg, summary_markdown, write_outputs
from sparsex.bench.stream import run_stream, stream_markdown
from sparsex.bench.workload_config import (EVICTIONS, MAX_AUTO_BLOCKS, WORKLOADS, StreamConfig,
                                           WorkloadBenchConfig, WorkloadParams)
from sparsex.bench.workload_prompts import (build_workload, ingest_corpus, ingestion_preamble, pool_blocks,
                                            tokenized_workload)


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
    w = tokenized_workload(engines, lambda tok: build_workload(cfg, tok), prewarm=cfg.prewarm,
                            make_preamble=lambda tok, used: ingestion_preamble(cfg, tok, used),
                            prewarm_passes=cfg.prewarm_passes, seed=cfg.params.seed)
    env = environment(cfg.model, cfg.dtype, cfg.device)     # after the first engine: it checks the device
    requests, prompts, flops, bs = w.requests, w.prompts, w.flops, w.block_size
    if own:
        engines.release("none")
    every = cfg.fidelity_every
    fid = [every > 0 and i % every == 0 for i in range(len(requests))]
    extra = cfg.fidelity_tokens + cfg.answer_tokens + 1
    ref_blocks = pool_blocks(prompts, extra, bs, whole=False)
    need_ref = any(fid) or cfg.workload == "rag" or any(p.name == "none" for p in policies)
    refs, records = None, []
    if need_ref:
        ref_engine = engines.take("none", "timed", max(ref_blocks, cfg.num_blocks or 0))
        refs, none_records = replay_reference(cfg, ref_engine, requests, prompts, fid, flops,
                                              keep=any(p.name == "none" for p in policies), recurring=w.recurring)
        records += none_records
        del ref_engine               # no reference may outlive `release`, or the engine stays in memory
    if own:
        engines.release("none")

    whole = pool_blocks(prompts + w.warm_prompts + w.rewarm_prompts, extra, bs, whole=True)
    num_blocks = cfg.num_blocks or min(whole, MAX_AUTO_BLOCKS)
    if num_blocks < whole:
        # then cached blocks get evicted, and the twin (which holds a few more blocks per request)
        # may evict different ones: its counters can then differ (`twin_match`)
        print(f"note: KV pool of {num_blocks} blocks < the {whole} the whole workload would occupy: "
              f"caches will evict", file=sys.stderr)
    merged = 0            # encodings the prewarm merged into segment entries (one engine's count)
    for cache in ("prefix", "sparsex"):
        group = [p for p in policies if p.cache == cache]
        for policy in group:
            timed = engines.take(cache, "timed", num_blocks)
            twin = engines.take(cache, "twin", num_blocks) if any(fid) else None
            for engine in (timed, twin) if cfg.prewarm else ():
                if engine is not None:
                    ingest_corpus(engine, w)          # into a freshly reset engine: every merge is in its index
                    if engine.segment_index is not None:
                        merged = sum(e.num_encodings - 1 for e in engine.segment_index.entries.values())
            records += replay_policy(cfg, policy, timed, twin, requests, prompts, refs, fid, flops, w.recurring)
            del timed, twin
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
    env.update(wall_seconds=round(time.time() - t_start, 1), load_avg_end=loadavg(), num_blocks=num_blocks,
               workload_blocks=whole, num_requests=len(requests), fidelity_requests=sum(fid),
               prewarm_prompts=len(w.warm_prompts), prewarm_passes=cfg.prewarm_passes if cfg.prewarm else 0,
               merged_encodings=merged)
    write_outputs(cfg.out, cfg, policies, records, summaries, env)
    if cfg.plot_dir is not None:
        stem = os.path.join(cfg.plot_dir, f"workload_{cfg.workload}{'_sweep' if cfg.sweep else ''}")
        plot_pareto(summaries, stem + "_pareto.png", cfg, env)
        plot_ttft_cdf(records, policies, stem + "_ttft_cdf.png", cfg, env)
    return summaries


# ============================================================================ CLI

class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help text already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if "default" in (action.help or "") else super()._get_help_string(action)


def add_workload_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `workload` under `sparsex bench`; the handler is `run_workload_bench_cli`."""
    p = subparsers.add_parser(
        "workload", help="replay a RAG/chat/agent workload under cache policies: TTFT, hits, FLOPs, fidelity",
        description="Replay a workload under each cache policy (sequential, caches warming up): TTFT, prefix/"
                    "segment hit rates, prefill FLOPs, fidelity vs full prefill (teacher forced), RAG F1/EM. "
                    "--stream: segment hit rate over a long RAG stream on a small KV pool, lru vs frequency.",
        formatter_class=_HelpFormatter)
    p.add_argument("--workload", default="rag", help=f"one of {', '.join(WORKLOADS)}")
    p.add_argument("--prompt-form", default="explicit", choices=PROMPT_FORMS,
                   help="rag/agent: how the client lays out its units: explicit (one segment each), or in one "
                        "message as unchanged apps do: stuffed (LangChain), question-first, llamaindex")
    p.add_argument("--policies", default=WorkloadBenchConfig.policies,
                   help="comma-separated: none, prefix, naive, epic16, epic32, cacheblend, sparsex, "
                        "or SELECTOR:F:RATIO[:BOUNDARY]")
    p.add_argument("--sweep", action="store_true",
                   help="also run recompute_ratio {0..1} x full_layers {0,1,2,4} (Pareto front)")
    add_engine_flag(p, "model")
    add_engine_flag(p, "dtype")
    add_engine_flag(p, "device", help="cpu | cuda: where the engines run (rag/chat/agent replays)")
    add_threads_arg(p, help="torch intra-op threads (default: torch's, one per core; on a busy shared CPU, 1 "
                            "is often much faster)")
    p.add_argument("--out", default="workload_bench_out", help="directory for JSON/CSV/markdown")
    p.add_argument("--plot-dir", default=None,
                   help="directory for PNG plots; none without it (matplotlib: pip install sparsex[bench])")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("fidelity")
    g.add_argument("--fidelity-tokens", type=int, default=WorkloadBenchConfig.fidelity_tokens,
                   help="teacher-forced continuation: the reference's greedy tokens through its EOS, at most this many")
    g.add_argument("--fidelity-past-eos", action="store_true",
                   help="score a fixed-length continuation past the reference's EOS too (template tokens no "
                        "user sees, nearly always agreed on)")
    g.add_argument("--fidelity-every", type=int, default=1, help="fidelity on every Nth request (0: none)")
    g.add_argument("--answer-tokens", type=int, default=32, help="rag: greedy answer cap (EOS stops earlier)")
    g.add_argument("--num-blocks", type=int, default=None,
                   help=f"KV pool per engine (default: the whole workload, at most {MAX_AUTO_BLOCKS} blocks)")
    g.add_argument("--prewarm-passes", type=int, default=WorkloadBenchConfig.prewarm_passes,
                   help="rag prewarm: ingest the corpus this many times (later passes in other orders, computed "
                        "exactly): the engine merges each passage's encodings (ReuseConfig.merge_encodings)")
    g.add_argument("--prewarm", action=argparse.BooleanOptionalAction, default=None,
                   help="rag: ingest every passage, k to a prompt after a preamble passage (untimed), before "
                        "each policy's replay: the steady state (default: on for rag; --no-prewarm: cold caches)")
    g = p.add_argument_group("workload size")
    d = WorkloadParams()
    g.add_argument("--queries", type=int, default=None,
                   help=f"rag queries (default {d.queries}, with --k {d.k}, prewarm and float32: the rag headline "
                        f"of docs/benchmarks.md; with --stream {StreamConfig.queries})")
    g.add_argument("--k", type=int, default=None, help=f"rag passages per query (default {d.k}; stream {StreamConfig.k})")
    g.add_argument("--num-passages", type=int, default=None,
                   help=f"rag corpus (default {d.num_passages}; stream {StreamConfig.num_passages})")
    g.add_argument("--passage-tokens", type=int_pair, default=None,
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


def config_from_args(args: argparse.Namespace) -> WorkloadBenchConfig | StreamConfig:
    """The run the command line asks for: a `StreamConfig` with --stream, else a `WorkloadBenchConfig`
    (size flags left out take the chosen kind's defaults)."""
    if args.stream:
        if args.workload != "rag":
            raise ValueError(f"--stream replays the rag workload; got --workload {args.workload!r}")
        if args.device != "cpu":
            raise ValueError(f"--stream runs on the CPU only; got --device {args.device!r}")
        return StreamConfig(model=args.model, dtype=args.dtype, queries=_pick(args.queries, StreamConfig.queries),
                            k=_pick(args.k, StreamConfig.k), num_passages=_pick(args.num_passages, StreamConfig.num_passages),
                            passage_tokens=_pick(args.passage_tokens, StreamConfig.passage_tokens), zipf_a=args.zipf_a,
                            seed=args.seed, kv_fraction=args.kv_fraction, window=args.window,
                            evictions=tuple(e.strip() for e in args.evictions.split(",") if e.strip()),
                            max_tokens=args.max_tokens, out=args.out, plot_dir=args.plot_dir,
                            progress=not args.no_progress)
    d = WorkloadParams()
    params = WorkloadParams(
        queries=_pick(args.queries, d.queries), k=_pick(args.k, d.k), num_passages=_pick(args.num_passages, d.num_passages),
        passage_tokens=_pick(args.passage_tokens, d.passage_tokens), users=args.users, turns=args.turns,
        context_budget=args.context_budget, num_topics=args.num_topics, sessions=args.sessions,
        results_per_call=args.results_per_call, num_docs=args.num_docs,
        tool_apis=tuple(a.strip() for a in args.tool_apis.split(",") if a.strip()), zipf_a=args.zipf_a, seed=args.seed)
    return WorkloadBenchConfig(workload=args.workload, prompt_form=args.prompt_form, policies=args.policies, sweep=args.sweep, model=args.model,
                               dtype=args.dtype, device=args.device, params=params,
                               fidelity_tokens=args.fidelity_tokens, fidelity_past_eos=args.fidelity_past_eos,
                               fidelity_every=args.fidelity_every, answer_tokens=args.answer_tokens,
                               num_blocks=args.num_blocks, prewarm=args.prewarm, prewarm_passes=args.prewarm_passes,
                               out=args.out, plot_dir=args.plot_dir, progress=not args.no_progress)


def run_workload_bench_cli(args: argparse.Namespace) -> int:
    if args.peer is not None and args.peer != "vllm":
        raise ValueError(f"--peer: only 'vllm' is known, got {args.peer!r}")
    cfg = config_from_args(args)
    cfg.verify()                     # before torch's threads are set or anything loads
    set_threads(args.threads)
    if isinstance(cfg, StreamConfig):
        print(stream_markdown(run_stream(cfg), cfg))
        return 0
    if args.peer is not None:
        return run_peer(cfg, args.peer_python)
    summaries = run_workload_bench(cfg)
    print(summary_markdown(summaries, cfg.fidelity_tokens), end="")
    print(fidelity_markdown(summaries), end="")
    plots = f"; plots: {cfg.plot_dir}/" if cfg.plot_dir is not None else ""
    print(f"outputs: {cfg.out}/ (requests.json/.csv, summary.json/.csv/.md){plots}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sparsex.bench.workload_bench ...` (same options as `sparsex bench workload`)."""
    from sparsex.bench import module_main
    return module_main("workload_bench", "workload", add_workload_bench_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
