"""Two replicas sharing spans found by content (segment_store_spans) on one-message (LangChain-style) rag.

Two engines in one process, requests round-robin, one at a time (uncontended TTFTs), each prompt one user
message holding k = 4 of 12 Wikipedia passages (700 characters, Zipf 1.1) and a question; max_tokens=1.
Settings: `one` (a single replica serves every request), `islands` (two replicas, no store), `spans` (two
replicas on one local redis-server with segment_store_spans). Prints, per setting, the passage tokens that came
back (tokens of a passage another request already carried, on any replica, counted in the prompt as the engine
tokenized it) and those of them served from cache (the exact prefix hit or a reused span), TTFT, and the span
counters; then the Redis index's size (MEMORY USAGE of the anchor keys). `workload` and `recurring_served` are
shared with benchmarks/cluster_nginx.py (the same workload on replica processes behind nginx).

    .venv/bin/python benchmarks/cluster_spans.py --requests 32
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))     # this checkout's sparsex
from sparsex import LLM, SamplingParams
from sparsex.bench import redis_server as rs
from sparsex.bench.datasets import load_wiki_entries
from sparsex.bench.prompt_forms import token_offsets, unit_mask
from sparsex.inputs import chat_pieces

K, POOL = 4, 12
ONE = SamplingParams(temperature=0.0, max_tokens=1)


def workload(n: int) -> tuple[list[str], list[tuple[list[int], str]]]:
    """(the POOL passages, n requests: (the passages' indices in prompt order, the user message))."""
    texts = [e.extract[:700] for e in load_wiki_entries() if len(e.extract) > 900][:POOL]
    w = np.array([1 / (i + 1) ** 1.1 for i in range(POOL)])
    w /= w.sum()
    reqs = []
    for i in range(n):
        idx = [int(j) for j in np.random.default_rng(i).choice(POOL, K, replace=False, p=w)]
        reqs.append((idx, "Use the following context to answer the question.\n\n" + "\n\n".join(texts[j] for j in idx)
                     + f"\n\nQuestion {i}: what do these passages have in common?"))
    return texts, reqs


def recurring_served(tokenizer, message: str, recurring: list[str], num_cached: int,
                     spans: list[tuple[int, int]], num_prompt_tokens: int | None = None) -> tuple[int, int]:
    """(tokens of the `recurring` passages (in prompt order) in the chat prompt of the user `message`, how
    many of them were served from cache: the exact prefix hit (`num_cached`) or a reused span [start, end)).
    The prompt is tokenized as the engine does (chat_pieces, one piece at a time), so a passage's tokens are
    counted where they sit in context, not as the passage tokenized alone; an exact prefix hit counts, as in
    the workload bench's recurring-served share (the engine reports it apart from the reused spans).
    `num_prompt_tokens`: the prompt length the server reported, checked against this tokenization."""
    pieces, _ = chat_pieces(tokenizer, [{"role": "user", "content": message}])
    ids, offsets = token_offsets(tokenizer, pieces)
    if num_prompt_tokens is not None and num_prompt_tokens != len(ids):
        raise RuntimeError(f"the server counted {num_prompt_tokens} prompt tokens, this tokenizer {len(ids)}")
    mask = unit_mask("".join(pieces), offsets, recurring)
    served = np.zeros(len(ids), dtype=bool)
    served[:num_cached] = True
    for a, b in spans:
        served[a:b] = True
    return int(mask.sum()), int((mask & served).sum())


def run(setting: str, texts, reqs, url: str | None = None) -> None:
    kw = dict(cache="sparsex", dtype="float32", num_blocks=2000)
    if url:
        kw.update(segment_store=url, segment_store_spans=True)
    reps = [LLM(**kw)] if setting == "one" else [LLM(**kw), LLM(**kw)]
    tok = reps[0].llm_engine.tokenizer
    seen, recurring, reused, ttft = set(), 0, 0, []
    for i, (idx, msg) in enumerate(reqs):
        llm = reps[i % len(reps)]
        t0 = time.perf_counter()
        out = llm.chat([{"role": "user", "content": msg}], ONE, use_tqdm=False)[0]
        ttft.append(time.perf_counter() - t0)
        came_back, served = recurring_served(tok, msg, [texts[j] for j in idx if j in seen], out.num_cached_tokens,
                                             [(s.start, s.end) for s in out.reused_spans])
        recurring += came_back
        reused += served
        seen.update(idx)
        if url:
            llm.llm_engine.store.flush()
    line = (f"{setting}: {len(reqs)} requests, passage tokens that came back {recurring}, served from cache "
            f"{reused} ({reused / max(recurring, 1):.1%}), TTFT mean {np.mean(ttft) * 1e3:.0f} ms, "
            f"p50 {np.median(ttft) * 1e3:.0f} ms")
    if url:
        line += "".join(f"; replica {'AB'[n]}: installed {s.span_installed} ({s.span_installed_tokens} tokens), "
                        f"rejected {s.span_rejected}, published {s.span_records_published} records / "
                        f"{s.span_anchors_published} anchors"
                        for n, s in enumerate(r.llm_engine.stats().store for r in reps))
    print(line, flush=True)
    for r in reps:
        r.llm_engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    args = ap.parse_args()
    texts, reqs = workload(args.requests)
    with rs.RedisServer() as srv:
        run("spans", texts, reqs, srv.url())
        run("islands", texts, reqs)
        run("one", texts, reqs)
        c = srv.client()
        keys = c.keys("*:a:*")
        print(f"index: {len(keys)} anchor keys, {sum(c.memory_usage(k) for k in keys)} bytes (MEMORY USAGE); "
              f"{len(c.keys('*')) - len(keys)} records", flush=True)


if __name__ == "__main__":
    main()
