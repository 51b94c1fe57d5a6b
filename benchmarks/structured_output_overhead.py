"""What a JSON schema costs at decode: tokens/s with and without structured outputs, batch 1 and 16.

    .venv/bin/python benchmarks/structured_output_overhead.py [--device cpu|cuda] [--dtype auto]
                                                              [--batch 1 16] [--tokens 32] [--reps 2]

Every row decodes `--tokens` tokens per sequence (ignore_eos; the schema cannot end sooner: it asks
for an array of at least 64 strings), greedy, on SmolLM2-135M-Instruct by default, cache "none" so
no request reuses another's KV. Decode tokens/s counts the tokens after each sequence's first
(prefill is timed apart) over the time from the first token of the batch to the last; the best of
`--reps` runs is kept (the machine may be shared). The "json_schema" rows fill each constrained row's
token bitmask on the host (xgrammar), upload it (pinned, non_blocking on CUDA) and mask the logits on
the device; the grammar is compiled once, before the timed runs. "mask ms/step" times that work
alone (fill, upload, mask, argmax of random logits), which a shared machine disturbs far less than
the end-to-end rates.

xgrammar must be importable: on a machine without it, put its wheel's contents on PYTHONPATH
(`pip install --target DIR xgrammar --no-deps` plus its `apache-tvm-ffi` dependency, then
PYTHONPATH=DIR).
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time

import torch

from sparsex import LLM, SamplingParams
from sparsex.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 40},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 64}},
    "required": ["title", "tags"],
}
PROMPT = "Write a JSON object with a title and a long list of tags for an article about rivers."


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()} ({cpu_name()}, {os.cpu_count()} cores)"
    return f"{cpu_name()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def run(llm: LLM, batch: int, tokens: int, structured: bool) -> tuple[float, float]:
    """(prefill seconds, decode tokens/s) of one batch."""
    eng = llm.llm_engine
    so = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
    prompt = eng.tokenize(PROMPT)
    sync = torch.cuda.synchronize if eng.runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i in range(batch):
        eng.add_request(f"r{i}-{time.perf_counter_ns()}", prompt, params)
    first = None
    generated = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                generated += len(out.outputs[0].token_ids)
    end = time.perf_counter()
    assert generated == batch * tokens, (generated, batch * tokens)
    return first - t0, batch * (tokens - 1) / (end - first)


@torch.inference_mode()                  # as the model runner calls it
def mask_ms(llm: LLM, batch: int, iters: int = 50) -> float:
    """Milliseconds per step of the structured-output work alone, on a machine-noise-free scale: fill
    `batch` rows' bitmasks (matchers a few tokens into the document), upload, mask [batch, vocab] logits."""
    from sparsex.layers.sampler import _biased_and_masked, SamplingBatch
    eng = llm.llm_engine
    mgr = eng.structured_output
    grammars = [mgr.grammar_for(StructuredOutputsParams(json=SCHEMA)) for _ in range(batch)]
    for g in grammars:
        for t in eng.tokenizer.encode('{"title": "Rivers", "tags": ["water", "'):
            assert g.accept(t)
    dev = eng.runner.device
    logits = torch.randn(batch, eng.model_config.vocab_size, device=dev)
    sb = SamplingBatch.from_params([SamplingParams(temperature=0.0)] * batch, [None] * batch, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        sb.token_bitmask = mgr.grammar_bitmask(grammars)
        _biased_and_masked(logits, sb).argmax(-1)
    sync()
    return 1000 * (time.perf_counter() - t0) / iters


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    import xgrammar                                    # fail early, with the import error, when missing

    llm = LLM(args.model, device=args.device, dtype=args.dtype, cache="none", seed=0,
              max_model_len=1024, max_num_seqs=max(args.batch))
    eng = llm.llm_engine
    eng.structured_output.compile(StructuredOutputsParams(json=SCHEMA))     # compiled once, outside the timing
    run(llm, 1, 4, True)                                                     # first-call costs, untimed
    rows = []
    for batch in args.batch:
        best = {}
        for _ in range(args.reps):
            for structured in (False, True):
                prefill, tps = run(llm, batch, args.tokens, structured)
                if tps > best.get(structured, (0.0, 0.0))[1]:
                    best[structured] = (prefill, tps)
        rows.append((batch, best[False], best[True], mask_ms(llm, batch)))

    from importlib.metadata import version
    print(f"machine: {machine(args.device)}")
    print(f"model:   {eng.model_name}, dtype {eng.runner.dtype}".replace("torch.", ""))
    print(f"xgrammar {version('xgrammar')}, torch {torch.__version__}, {args.tokens} tokens per sequence, "
          f"best of {args.reps}")
    print(f"command: {shlex.join([os.path.basename(sys.executable), *sys.argv])}")
    print()
    print("| batch | free tok/s | json_schema tok/s | overhead | free prefill s | json_schema prefill s "
          "| mask ms/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for batch, (pf, free), (ps, so), ms in rows:
        print(f"| {batch} | {free:.1f} | {so:.1f} | {100 * (free / so - 1):+.1f}% | {pf:.3f} | {ps:.3f} | {ms:.2f} |")
    print()
    print("overhead: decode time with the schema over without, minus 1. mask ms/step: filling the rows' "
          "bitmasks, uploading and masking the logits, timed alone (not affected by the model's step time).")


if __name__ == "__main__":
    main()
