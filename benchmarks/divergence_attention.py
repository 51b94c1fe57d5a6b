"""Which passages the step where a reuse policy's rag answer leaves full prefill's attends to.

Reads the `requests.json` of a `sparsex bench workload --workload rag` run with the policies `none` and
POLICY, rebuilds its prompts (as `answer_divergence.py` does) and, for every request whose two answers
differ, runs full prefill (fp32) of prompt + full prefill's answer up to the first differing token, with
a probe on every layer that records the attention of that last position (the step whose greedy choice
the policy changed) over the prompt, averaged over heads. The mass is split into the passage the
question is about (`answer_divergence.target_passage`), the other passages (every passage is served
from cache under reuse in these runs), and the rest (system head, question, glue, answer so far).
As a control, the same split at the same answer position for requests whose answers agree.

    .venv/bin/python benchmarks/divergence_attention.py RUN/requests.json --policy sparsex [--threads 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from answer_divergence import load_run, target_passage  # noqa: E402

from sparsex.bench.prompt_forms import form_prompt, unit_mask  # noqa: E402
from sparsex.bench.workload_prompts import build_workload  # noqa: E402
from sparsex.config import EngineConfig  # noqa: E402
from sparsex.engine import model_runner  # noqa: E402
from sparsex.engine.llm_engine import LLMEngine  # noqa: E402
from sparsex.engine.teacher_forcing import run_alone  # noqa: E402
from sparsex.inputs import TokenizedPrompt  # noqa: E402
from sparsex.layers.forward_context import ForwardContext  # noqa: E402
from sparsex.sampling_params import SamplingParams  # noqa: E402
from sparsex.segment.selectors import query_attention_mass  # noqa: E402

LAYER_GROUPS = ((0, 4), (4, 16), (16, None))      # the full layers of the default, the middle, the deep end


class LastRowAttention:
    """A probe on every layer: the last row's attention over all keys of a one-step full prefill,
    mean over heads. `per_layer[l]`: [num_tokens] float32."""

    def __init__(self, num_layers: int):
        self.layers = frozenset(range(num_layers))
        self.per_layer: dict[int, torch.Tensor] = {}

    def __call__(self, layer_idx, q, k, v, k_cache, v_cache, ctx) -> None:
        pos = ctx.attn_metadata.positions
        self.per_layer[layer_idx] = query_attention_mass(q[-1:], k, pos[-1:], q.shape[-1] ** -0.5)


def attention_split(engine: LLMEngine, ids: list[int], masks: list[np.ndarray], question: np.ndarray,
                    target: int) -> dict[str, list[float]]:
    """Per layer group: mass on the target passage, on the other passages, on the question, elsewhere
    (the system head, where the attention sink is, the template glue and the answer so far)."""
    probe = LastRowAttention(engine.model_config.num_hidden_layers)
    make = model_runner.ForwardContext

    def with_probe(*args, **kwargs):
        ctx = ForwardContext(*args, **kwargs)
        ctx.probe, ctx.probe_layers = probe, probe.layers
        return ctx
    model_runner.ForwardContext = with_probe
    try:
        run_alone(engine, f"att-{len(ids)}-{target}", TokenizedPrompt(list(ids)), SamplingParams(temperature=0, max_tokens=1))
    finally:
        model_runner.ForwardContext = make
    n = len(ids)
    out: dict[str, list[float]] = {}
    for lo, hi in LAYER_GROUPS:
        layers = sorted(probe.per_layer)[lo:hi]
        m = torch.stack([probe.per_layer[l] for l in layers]).mean(0).numpy()            # [n]
        pad = [np.pad(x, (0, n - len(x))) for x in masks]
        on_target = float(m[pad[target]].sum())
        on_others = float(sum(m[x].sum() for i, x in enumerate(pad) if i != target))
        on_question = float(m[np.pad(question, (0, n - len(question)))].sum())
        out[f"{lo}-{(hi or len(probe.per_layer)) - 1}"] = [on_target, on_others, on_question,
                                                            1.0 - on_target - on_others - on_question]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("requests_json")
    ap.add_argument("--policy", required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None, help="at most this many requests of each kind")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg, records = load_run(args.requests_json)
    engine = LLMEngine(EngineConfig(model=cfg.model, cache="none", dtype="float32", max_num_batched_tokens=16384))
    requests = build_workload(cfg, engine.tokenizer)
    by = {(r["policy"], r["index"]): r for r in records}
    tok = engine.tokenizer
    diverged, agreed = [], []
    for i, req in enumerate(requests):
        if ("none", i) not in by or (args.policy, i) not in by:
            continue
        a = tok.encode(by["none", i]["answer"] or "", add_special_tokens=False)
        b = tok.encode(by[args.policy, i]["answer"] or "", add_special_tokens=False)
        t = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        (agreed if a == b else diverged).append((i, a, t))
    # the control: agreeing requests at the diverging steps' answer positions, in turn
    offsets = [t for _, _, t in diverged] or [0]
    agreed = [(i, a, min(offsets[j % len(offsets)], len(a))) for j, (i, a, _) in enumerate(agreed)]
    rows = {}
    for kind, items in (("diverging step", diverged), ("agreeing, same position", agreed)):
        items = items[: args.limit]
        acc: dict[str, list[list[float]]] = {}
        for i, answer, t in items:
            prompt, offs, text = form_prompt(tok, engine.model_config.vocab_size, requests[i])
            masks = [unit_mask(text, offs, [p]) for p in requests[i].passages]
            question = unit_mask(text, offs, [requests[i].question])
            split = attention_split(engine, prompt.token_ids + answer[:t], masks, question, target_passage(requests[i]))
            for g, v in split.items():
                acc.setdefault(g, []).append(v)
        rows[kind] = (len(items), {g: [statistics.mean(x[j] for x in v) for j in range(4)] for g, v in acc.items()})
    print(f"{args.requests_json}: policy {args.policy}, prompt form {cfg.prompt_form}; attention of the step, "
          "mean over heads and the layers of each group, full prefill (fp32)")
    print("| step | requests | layers | on the question's passage | on the other passages | on the question | elsewhere |")
    print("|---|---|---|---|---|---|---|")
    for kind, (n, groups) in rows.items():
        for g, (on_t, on_o, on_q, rest) in groups.items():
            print(f"| {kind} | {n} | {g} | {on_t:.3f} | {on_o:.3f} | {on_q:.3f} | {rest:.3f} |")
    engine.check_integrity()


if __name__ == "__main__":
    main()
