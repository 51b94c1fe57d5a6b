"""Segment index: lookup cost at 10^5 entries, memory per entry, the span index's memory per cached
token and search time (transparent segments), and eviction under a stream of novel content (LRU vs
GreedyDual-Size-Frequency), without a model.

The span-index run indexes real passages (the wiki rag corpus, tokenized) as the exact KV of earlier
requests, then searches one-message prompts of 8k and 32k tokens made of those passages in a new
order: bytes of index per cached token (Python-side: anchors, token copies for verification, block
references; not KV), registration cost per token, and search time per prompt.

The eviction run replays a RAG stream at the index level: each query brings k passages; a share of
them are drawn by Zipf popularity from a reusable corpus (real passage lengths from the wiki rag
workload), the rest are one-off novel passages (never seen again). A miss allocates the passage's
blocks from a pool that holds only a fraction of the corpus, which may evict entries. Reported: the
segment hit rate (tokens) of the reusable passages over time, per policy.

    .venv/bin/python benchmarks/segment_index_bench.py [--sections index,spans,stream]
"""
from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np

from sparsex.cache.block_pool import BlockPool
from sparsex.cache.kv_cache_manager import cdiv
from sparsex.segment.segment_index import SegmentIndex
from sparsex.segment.span_index import SpanIndex


def lookup_cost(num_entries: int = 100_000, seg_len: int = 400, block_size: int = 16) -> dict:
    rng = np.random.default_rng(0)
    pool = BlockPool(4096, enable_caching=False)
    blocks = pool.get_new_blocks(4096)                 # entries share blocks: refcounts allow it
    index = SegmentIndex(pool, block_size, "lru")
    segs = [rng.integers(0, 49152, seg_len).tolist() for _ in range(2000)]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(num_entries):
        toks = segs[i % 2000][:-1] + [i]              # distinct entries
        nb = cdiv(seg_len, block_size)
        start = (i * nb) % (4096 - nb)
        index.insert(toks, None, blocks[start:start + nb], 0)
    mem = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    probes = [segs[i % 2000][:-1] + [i] for i in rng.integers(0, num_entries, 2000).tolist()]
    misses = [segs[i % 2000][:-1] + [num_entries + i] for i in range(2000)]
    t0 = time.perf_counter()
    hits = sum(index.lookup(p, None) is not None for p in probes)
    t_hit = (time.perf_counter() - t0) / len(probes)
    t0 = time.perf_counter()
    miss = sum(index.lookup(p, None) is None for p in misses)
    t_miss = (time.perf_counter() - t0) / len(misses)
    index.check_integrity()
    return {"entries": num_entries, "segment_tokens": seg_len, "bytes_per_entry": mem / num_entries,
            "lookup_hit_us": 1e6 * t_hit, "lookup_miss_us": 1e6 * t_miss, "hits": hits, "misses": miss}


def span_index_cost(passages: list[list[int]], prompt_tokens: tuple[int, ...] = (8192, 32768), block_size: int = 16,
                    min_tokens: int = 16, repeats: int = 20) -> dict:
    """Index `passages` (token ids) as request runs, `block_size`-token blocks each, then time `find`
    on prompts of each length in `prompt_tokens` made of indexed passages in a shuffled order."""
    rng = np.random.default_rng(0)

    def build(pool: BlockPool) -> tuple[SpanIndex, int]:
        index, cached = SpanIndex(block_size), 0
        for p in passages:
            n = len(p) // block_size * block_size        # whole blocks only, as the prefix chain registers them
            if n:
                index.add_request_run(p, None, 0, pool.get_new_blocks(n // block_size))
                cached += n
        return index, cached

    pools = [BlockPool(sum(cdiv(len(p), block_size) for p in passages), enable_caching=False) for _ in range(2)]
    t0 = time.perf_counter()
    index, cached = build(pools[0])                      # timed without tracemalloc (it slows allocation)
    register_s = time.perf_counter() - t0
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    traced, _ = build(pools[1])                          # the pool's own block objects are not counted
    mem = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del traced
    searches = {}
    for length in prompt_tokens:
        prompt: list[int] = []
        for i in rng.permutation(len(passages)).tolist() * (1 + length // max(1, cached)):
            prompt += passages[i] + [198, 198]           # a blank line between passages
            if len(prompt) >= length:
                break
        arr = np.asarray(prompt[:length], dtype=np.int32)
        found = index.find(arr, 0, len(arr), None, min_tokens)
        t0 = time.perf_counter()
        for _ in range(repeats):
            index.find(arr, 0, len(arr), None, min_tokens)
        searches[length] = ((time.perf_counter() - t0) / repeats, sum(m.num_tokens for m in found) / len(arr))
    return {"cached_tokens": cached, "anchors": index.num_anchors(), "bytes_per_token": mem / max(1, cached),
            "register_us_per_token": 1e6 * register_s / max(1, cached), "searches": searches}


def eviction_stream(policy: str, lengths: list[int], num_queries: int, k: int, novel_share: float,
                    pool_fraction: float, zipf_a: float, seed: int, block_size: int = 16, window: int = 50):
    rng = np.random.default_rng(seed)
    corpus_blocks = sum(cdiv(n, block_size) for n in lengths)
    pool = BlockPool(max(64, int(pool_fraction * corpus_blocks)), enable_caching=False)
    index = SegmentIndex(pool, block_size, policy=policy)
    ranks = np.arange(1, len(lengths) + 1, dtype=np.float64)
    pop = ranks ** -zipf_a
    pop /= pop.sum()
    novel_id = 10**6
    curve, win_q, win_h = [], 0, 0
    for q in range(num_queries):
        n_novel = int(round(novel_share * k))
        picks = [("c", int(i)) for i in rng.choice(len(lengths), size=k - n_novel, replace=False, p=pop)]
        picks += [("n", novel_id + j) for j in range(n_novel)]
        novel_id += n_novel
        for kind, pid in picks:
            n = lengths[pid] if kind == "c" else int(rng.integers(300, 500))
            toks = [pid, n] + [0] * (n - 2)                 # identity of the passage is what matters here
            hit = index.lookup(toks, None) is not None
            if kind == "c":
                win_q += n
                win_h += n if hit else 0
            if not hit:
                need = cdiv(n, block_size)
                if need > pool.num_free_blocks:
                    index.evict_blocks(need - pool.num_free_blocks)
                if need > pool.num_free_blocks:
                    continue
                blocks = pool.get_new_blocks(need)
                index.insert(toks, None, blocks, 0)
                pool.free_blocks(blocks)                    # the request ends; the entry keeps its pin
        if (q + 1) % window == 0:
            curve.append(win_h / max(1, win_q))
            win_q = win_h = 0
    index.check_integrity()
    return curve


def _print_lookup_cost(r: dict) -> None:
    print(f"| entries | tokens/entry | index memory per entry | lookup (hit) | lookup (miss) |\n|---|---|---|---|---|\n"
          f"| {r['entries']:,} | {r['segment_tokens']} | {r['bytes_per_entry']:.0f} B | {r['lookup_hit_us']:.1f} µs | "
          f"{r['lookup_miss_us']:.1f} µs |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--corpus", type=int, default=500)
    ap.add_argument("--novel-share", type=float, default=0.5)
    ap.add_argument("--pool-fraction", type=float, default=0.25)
    ap.add_argument("--plot", default=None, help="save the hit-rate-over-time plot here (PNG)")
    ap.add_argument("--sections", default="index,spans,stream",
                    help="comma-separated: index (lookup cost), spans (span index), stream (eviction)")
    args = ap.parse_args(argv)
    sections = {x.strip() for x in args.sections.split(",") if x.strip()}
    if not sections or sections - {"index", "spans", "stream"}:
        ap.error(f"--sections: choose from index, spans, stream; got {args.sections!r}")
    if args.plot:
        from sparsex.bench.pyplot import require_matplotlib
        try:
            require_matplotlib()
        except ValueError as e:
            ap.error(str(e))

    if "index" in sections:
        _print_lookup_cost(lookup_cost(args.entries))
    if not sections & {"spans", "stream"}:
        return

    from sparsex.bench.workloads import build_passages
    from sparsex.models.loader import load_model
    tok = load_model("smollm2-135m-instruct").tokenizer
    corpus = build_passages(tok, args.corpus)
    lengths = [p.num_tokens for p in corpus]

    if "spans" in sections:
        sp = span_index_cost([tok.encode(p.text, add_special_tokens=False) for p in corpus])
        print(f"\nspan index: {len(corpus)} real passages as request runs, {sp['cached_tokens']:,} cached tokens, "
              f"{sp['anchors']:,} anchors")
        print("| index bytes per cached token | registration per token | prompt | search | prompt found |\n"
              "|---|---|---|---|---|")
        for length, (sec, share) in sp["searches"].items():
            print(f"| {sp['bytes_per_token']:.1f} B | {sp['register_us_per_token']:.2f} µs | {length:,} tokens | "
                  f"{1000 * sec:.2f} ms | {100 * share:.1f}% |")
    if "stream" not in sections:
        return
    print(f"\nstream: {args.queries} queries x {args.k} passages, {100*args.novel_share:.0f}% novel one-off passages, "
          f"corpus {len(lengths)} real passages ({sum(lengths):,} tokens), pool = {100*args.pool_fraction:.0f}% of the corpus")
    curves = {}
    for policy in ("lru", "frequency"):
        curves[policy] = eviction_stream(policy, lengths, args.queries, args.k, args.novel_share,
                                         args.pool_fraction, 1.1, seed=0)
    print("| policy | hit rate, first window | last window | mean |\n|---|---|---|---|")
    for policy, c in curves.items():
        print(f"| {policy} | {100*c[0]:.1f}% | {100*c[-1]:.1f}% | {100*sum(c)/len(c):.1f}% |")
    if args.plot:
        from sparsex.bench.pyplot import pyplot
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for policy, c in curves.items():
            ax.plot([50 * (i + 1) for i in range(len(c))], [100 * x for x in c], label=policy)
        ax.set_xlabel("queries"); ax.set_ylabel("segment hit rate of reusable passages (%)")
        ax.set_title(f"{100*args.novel_share:.0f}% novel content, pool = {100*args.pool_fraction:.0f}% of corpus")
        ax.legend(); fig.tight_layout(); fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    main()
