"""What the first requests of a new process cost, with and without the start-up warm-up
(sparsex/engine/warmup.py). GPU machine; `--dry-run` is a CPU smoke run of the script.

    python3 benchmarks/gpu_startup.py [--passages 16] [--out DIR]

Each row is a fresh process (this script run with --child), so nothing compiled by an earlier row
is in memory. Triton's on-disk kernel cache is what a restarted server would find: rows marked
"empty" point TRITON_CACHE_DIR at a new empty folder (the first start on a machine), "kept" at the
folder the row before it filled (a restart). Every child, random weights of the Llama-3-8B shape,
bf16, cache="sparsex":

  1. builds the engine (the warm-up runs here when on), timed;
  2. a plain prompt (head + k passages x 512 tokens + question), which caches the passages; TTFT
     and the 16 decode steps after it (the first decode step captures the CUDA graphs when they
     were not captured at start-up);
  3. three blended prompts: the same passages in new orders after new heads; TTFT of each.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

PASSAGE_LEN = 512
DECODE_TOKENS = 16


def child(args) -> dict:
    import torch

    from gpu_engine import _dry_run_setup, _patch_dummy_tokenizer
    import gpu_engine as ge
    from sparsex import LLM, SamplingParams

    if args.dry_run:
        _dry_run_setup()
    _patch_dummy_tokenizer()
    compiled: dict[str, list[str]] = {}          # phase -> Triton kernels compiled (or loaded from disk) in it
    phase = ["start"]
    try:
        import triton

        def on_compile(*, repr: str, **kw) -> None:
            compiled.setdefault(phase[0], []).append(repr)
        triton.knobs.runtime.jit_post_compile_hook = on_compile
    except (ImportError, AttributeError):
        pass
    dev = ge.DEV.type
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    ids = ge.rand_ids
    k = args.passages
    plen = PASSAGE_LEN if not args.dry_run else 64
    passages = [ids(plen) for _ in range(k)]
    t0 = time.perf_counter()
    llm = LLM(ge.MODEL, device=dev, dtype="bfloat16" if dev == "cuda" else "float32", cache="sparsex",
              kv_cache_memory=(10 << 30) if dev == "cuda" else (64 << 20), max_model_len=ge.MAX_LEN,
              max_num_batched_tokens=ge.MAX_LEN, warmup=args.child == "on")
    sync()
    init_s = time.perf_counter() - t0
    eng = llm.llm_engine

    def run(prompt: dict, tag: str, max_tokens: int) -> tuple[float, float, object]:
        """(TTFT s, seconds from the first token to the last, output)"""
        phase[0] = tag
        tp = eng.tokenize(prompt)
        sync()
        t = time.perf_counter()
        eng.add_request(tag, tp, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        first, done = None, None
        while done is None:
            for o in eng.step():
                if first is None and o.outputs[0].token_ids:
                    first = time.perf_counter()
                if o.finished:
                    done = o
        sync()
        return first - t, time.perf_counter() - first, done

    # a filler after the head, so no passage is encoded right after the short head (min_context_tokens)
    prime_ttft, decode_s, _ = run({"segments": [ids(40), ids(plen)] + passages + [ids(48)]}, "prime",
                                  DECODE_TOKENS + 1)
    blended = []
    for r in range(3):
        order = np.random.default_rng(100 + r).permutation(k)
        ttft, _, o = run({"segments": [ids(40)] + [passages[i] for i in order] + [ids(48)]}, f"b{r}", 1)
        blended.append({"ttft_s": ttft, "reused": o.num_reused_tokens, "recomputed": o.num_recomputed_tokens})
    return {"warmup": args.child, "init_s": init_s, "warmup_s": eng.warmup_seconds, "prime_ttft_s": prime_ttft,
            "decode_s": decode_s, "blended": blended, "tokens": 40 + plen * k + 48,
            "compiled": compiled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passages", type=int, default=16)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return
    base = tempfile.mkdtemp(prefix="sparsex-triton-")
    plan = [("off", "empty", "a"), ("on", "empty", "b"), ("on", "kept", "b"), ("off", "kept", "a")]
    rows, results = [], []
    for warm, cache, folder in plan:
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(base, folder), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, __file__, "--child", warm, "--passages", str(args.passages)] + \
            (["--dry-run"] if args.dry_run else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            raise SystemExit(f"child {warm}/{cache} failed ({proc.returncode})")
        r = json.loads(proc.stdout.strip().splitlines()[-1]) | {"triton_cache": cache}
        results.append(r)
        b = r["blended"]
        rows.append([warm, cache, f"{r['init_s']:.1f}", f"{r['warmup_s']:.2f}", f"{1e3 * r['prime_ttft_s']:.0f}",
                     f"{1e3 * r['decode_s'] / DECODE_TOKENS:.1f}",
                     " / ".join(f"{1e3 * x['ttft_s']:.0f}" for x in b),
                     f"{b[0]['reused']:,} / {b[0]['recomputed']:,}",
                     " / ".join(str(len(r["compiled"].get(p, []))) for p in ("start", "prime", "b0", "b1", "b2"))])
        print(f"{warm}/{cache}: {r}", flush=True)
    print(f"\n### First requests of a new process ({results[0]['tokens']:,}-token prompts; random weights, "
          "Llama-3-8B shape, bf16, cache=sparsex)\n")
    header = ["warm-up", "Triton disk cache", "engine start s", "of which warm-up s", "plain prompt TTFT ms",
              f"decode ms/token (first {DECODE_TOKENS})", "blended TTFT ms: 1st / 2nd / 3rd", "reused / recomputed",
              "Triton kernels compiled: start / plain / blended 1st / 2nd / 3rd"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for r in results:          # what the warm-up did not cover, next to the warm-up's own compilations of it
        if r["warmup"] != "on":
            continue
        for p in ("prime", "b0", "b1", "b2"):
            for sig in r["compiled"].get(p, []):
                name = sig.split("[", 1)[0]
                print(f"  {r['triton_cache']}: first compiled in {p}: {sig}")
                for w in r["compiled"].get("start", []):
                    if w.split("[", 1)[0] == name:
                        print(f"      warm-up had: {w}")
    if args.out:
        with open(os.path.join(args.out, "gpu_startup.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
