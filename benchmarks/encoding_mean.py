"""Is a segment's mean encoding over several contexts nearer a new context's than one encoding?

A passage's K/V depend on the text before it when it was computed. The segment index can keep the
mean of several encodings (ReuseConfig.merge_encodings). This script measures, on real rag prompts
(SmolLM2-135M-Instruct, transformers, fp32, no engine involved), the squared deviation of the
reused K/V from the K/V the passage gets inside the query prompt, per layer:

  ratio(N) = sum ||KV_query - mean of N encodings||^2 / sum ||KV_query - one encoding||^2,

each encoding computed after the system head and two random passages from outside the query's
prompts. Keys are compared before RoPE (re-rotation is exact). Prints a markdown table.

    .venv/bin/python benchmarks/encoding_mean.py --queries 2 --encodings 4 --threads 2
"""
from __future__ import annotations

import argparse
import random

import torch

from sparsex.bench.hf_reference import load_hf_reference, model_dir_of
from sparsex.bench.workloads import rag_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--queries", type=int, default=2)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--encodings", type=int, default=4, help="N: encodings averaged (2 is also reported)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.encodings < 2:
        raise ValueError(f"--encodings must be >= 2, got {args.encodings}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    model_dir = model_dir_of(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_hf_reference(model_dir, "float32").model
    num_layers = len(model.model.layers)

    captured: dict[tuple[str, int], torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        for name in ("k", "v"):
            proj = getattr(layer.self_attn, f"{name}_proj")
            proj.register_forward_hook(lambda m, inp, out, key=(name, i): captured.__setitem__(key, out[0]))

    @torch.inference_mode()
    def run(ids: list[int]) -> dict[tuple[str, int], torch.Tensor]:
        model(input_ids=torch.tensor([ids]))
        return dict(captured)                            # (k|v, layer) -> [T, d_kv], before RoPE

    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    requests = list(rag_workload(tok, num_queries=args.queries + 20, k=args.k))
    # contexts for the encodings: passages of other queries' prompts
    pool = [encode(s) for r in requests[args.queries:] for s in r.segments[1:-1]]
    rng = random.Random(args.seed)
    sums = {(name, l): [0.0, 0.0, 0.0] for name in ("k", "v") for l in range(num_layers)}  # one, mean of 2, of N
    for req in requests[:args.queries]:
        pieces = [encode(s) for s in req.segments]
        head, bodies, tail = pieces[0], pieces[1:-1], pieces[-1]
        query = run(head + sum(bodies, []) + tail)
        start = len(head)
        for body in bodies:
            rows = slice(start, start + len(body))
            start += len(body)
            encodings = []
            for _ in range(args.encodings):
                before = rng.choice(pool) + rng.choice(pool)
                kv = run(head + before + body)
                encodings.append({key: x[len(head) + len(before):] for key, x in kv.items()})
            with torch.inference_mode():
                for (name, l), acc in sums.items():
                    true = query[(name, l)][rows]
                    stack = torch.stack([e[(name, l)] for e in encodings])     # [N, n, d_kv]
                    acc[0] += (true - stack[0]).pow(2).sum().item()
                    acc[1] += (true - stack[:2].mean(0)).pow(2).sum().item()
                    acc[2] += (true - stack.mean(0)).pow(2).sum().item()

    n = args.encodings
    print(f"{args.model}, float32, {args.queries} rag prompts x {args.k} passages; squared K/V deviation "
          f"from the query's own encoding, mean of 2 / of {n} encodings against one\n")
    print(f"| layer | K: 2 | K: {n} | V: 2 | V: {n} | one encoding: ||dK||^2 | ||dV||^2 |\n|---|---|---|---|---|---|---|")
    for l in range(1, num_layers):                       # layer 0's K/V depend on token and position only
        k, v = sums[("k", l)], sums[("v", l)]
        print(f"| {l} | {k[1] / k[0]:.2f} | {k[2] / k[0]:.2f} | {v[1] / v[0]:.2f} | {v[2] / v[0]:.2f} "
              f"| {k[0]:,.0f} | {v[0]:,.0f} |")


if __name__ == "__main__":
    main()
