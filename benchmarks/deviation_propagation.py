"""Can the deviation a probe layer measures be carried to the deeper layers instead of recomputing?

A reused token's K/V at layer l differ from a full prefill's because its hidden state h_l does.
The probe layer F sees the residual-stream deviation dh_F = h_F(fresh) - h_F(cached) of every reused
token. If that deviation simply rode the residual stream down, the stale K/V of a token that is not
recomputed could be corrected at every deeper layer by one projection of dh_F through the layer's
(linearised) RMSNorm: dK_l ~ W_k (g_l * dh_F / rms(h_l(cached))), the same for V, at ~4-6% of a
layer's FLOPs per token. This script measures how much of the true dK_l, dV_l that explains on real
rag prompts (SmolLM2-135M-Instruct, transformers, no engine involved):

  explained = 1 - ||d - d_hat||^2 / ||d||^2, summed over the reused tokens of every prompt,

with d_hat the linear correction, the same through the exact RMSNorm of h_l(cached) + dh_F (needs
h_l(cached), which an engine does not keep), and the linear one scaled by its best scalar per
layer (an upper bound for any rescaled version). Keys are compared before RoPE (re-rotation is
exact). Each passage's cached encoding is computed after the system head and another passage of the
same prompt, as a warm corpus would have it. Prints a markdown table, one row per layer.

    .venv/bin/python benchmarks/deviation_propagation.py --queries 3 --threads 2
"""
from __future__ import annotations

import argparse

import torch

from sparsex.bench.hf_reference import load_hf_reference, model_dir_of
from sparsex.bench.workloads import rag_workload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--queries", type=int, default=3)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--probes", default="2,4", help="probe layers F (the first F layers run in full)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer
    model_dir = model_dir_of(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_hf_reference(model_dir, "float32").model
    layers = model.model.layers
    num_layers, eps = len(layers), model.config.rms_norm_eps
    probes = [int(p) for p in args.probes.split(",")]

    captured: dict[tuple[str, int], torch.Tensor] = {}
    for i, layer in enumerate(layers):
        for name in ("k", "v"):
            proj = getattr(layer.self_attn, f"{name}_proj")
            proj.register_forward_hook(lambda m, inp, out, key=(name, i): captured.__setitem__(key, out[0]))

    @torch.inference_mode()
    def run(ids: list[int]):
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        return dict(captured), [h[0] for h in out.hidden_states]   # [T, d] input of every layer

    # sums[(F, l, proj)] = [||d||^2, ||d - linear||^2, ||d - through RMSNorm||^2, <d, linear>, ||linear||^2]
    sums: dict[tuple[int, int, str], list[float]] = {}
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]
    for req in rag_workload(tok, num_queries=args.queries, k=args.k):
        pieces = [encode(s) for s in req.segments]
        head, bodies, tail = pieces[0], pieces[1:-1], pieces[-1]
        fresh_kv, fresh_h = run(head + sum(bodies, []) + tail)
        start = len(head)
        for b, body in enumerate(bodies):
            before = bodies[(b + 3) % len(bodies)]           # another passage precedes it when cached
            cached_kv, cached_h = run(head + before + body)
            f_rows, c_rows = slice(start, start + len(body)), slice(len(head) + len(before), None)
            start += len(body)
            with torch.inference_mode():
                for F in probes:
                    dh = fresh_h[F][f_rows] - cached_h[F][c_rows]                    # [n, d]
                    for l in range(F, num_layers):
                        norm = layers[l].input_layernorm
                        h_l = cached_h[l][c_rows]
                        linear_in = norm.weight * dh * torch.rsqrt(h_l.pow(2).mean(-1, keepdim=True) + eps)
                        exact_in = norm(h_l + dh) - norm(h_l)
                        for name in ("k", "v"):
                            w = getattr(layers[l].self_attn, f"{name}_proj").weight
                            d = fresh_kv[(name, l)][f_rows] - cached_kv[(name, l)][c_rows]   # [n, d_kv]
                            lin, exact = linear_in @ w.T, exact_in @ w.T
                            acc = sums.setdefault((F, l, name), [0.0] * 5)
                            acc[0] += d.pow(2).sum().item()
                            acc[1] += (d - lin).pow(2).sum().item()
                            acc[2] += (d - exact).pow(2).sum().item()
                            acc[3] += (d * lin).sum().item()
                            acc[4] += lin.pow(2).sum().item()

    def explained(acc: list[float]) -> str:
        total, lin, exact, cross, norm2 = acc
        best = total - cross * cross / max(norm2, 1e-30)      # the linear one times its best scalar
        return f"{1 - lin / total:+.3f} / {1 - exact / total:+.3f} / {1 - best / total:+.3f}"

    print(f"{args.model}, float32, {args.queries} rag prompts x {args.k} passages; share of ||dK||^2 and "
          "||dV||^2 explained (linear / through RMSNorm / linear, best scalar)")
    for F in probes:
        print(f"\nprobe layer F = {F}\n\n| layer | K | V | ||dK||^2 | ||dV||^2 |\n|---|---|---|---|---|")
        for l in range(F, num_layers):
            k, v = sums[(F, l, "k")], sums[(F, l, "v")]
            print(f"| {l} | {explained(k)} | {explained(v)} | {k[0]:,.0f} | {v[0]:,.0f} |")


if __name__ == "__main__":
    main()
