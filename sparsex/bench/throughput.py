"""Offline throughput: N random-token prompts generated together, the engine vs transformers.

Like vLLM's `benchmark_throughput --dataset-name random`: seeded random token ids, `ignore_eos`,
fixed input/output lengths, so both sides do exactly the same amount of work. Reported:
output tokens/s (generated / wall) and total tokens/s ((prompt + generated) / wall).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from sparsex.bench.hf_reference import hf_generate_seconds, load_hf_reference, model_dir_of
from sparsex.config import EngineConfig
from sparsex.entrypoints.llm import LLM
from sparsex.sampling_params import SamplingParams


@dataclass
class ThroughputConfig:
    model: str = EngineConfig.model
    num_prompts: int = 8
    input_len: int = 256
    output_len: int = 128
    dtype: str = EngineConfig.dtype
    seed: int = 0
    repeats: int = 1                  # median of this many alternating runs per backend
    warmup: bool = True
    hf: bool = True                   # also run the transformers baseline

    def verify(self) -> None:
        for name in ("num_prompts", "input_len", "output_len", "repeats"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name.replace('_', '-')} must be an integer >= 1, got {v!r}")


@dataclass
class ThroughputResult:
    backend: str                      # "sparsex" | "transformers"
    seconds: float
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def random_prompts(vocab_size: int, special_ids: list[int], num: int, length: int, seed: int) -> list[list[int]]:
    """Seeded uniform token ids, avoiding special tokens (an EOS or chat marker in the prompt would
    make the workload depend on how each side treats them)."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(special_ids, dtype=np.int64))
    return [rng.choice(allowed, size=length).tolist() for _ in range(num)]


def run_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> ThroughputResult:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return ThroughputResult("sparsex", elapsed, sum(map(len, prompts)), generated)


def run_throughput(cfg: ThroughputConfig, log=print) -> list[ThroughputResult]:
    """Both backends loaded side by side; with repeats > 1 their runs alternate (engine, transformers,
    engine, ...) and each reports its median, so a burst of outside load hits both alike."""
    cfg.verify()
    # cache="none": random prompts share nothing, and prefix hashing would only add bookkeeping.
    llm = LLM(model=cfg.model, dtype=cfg.dtype, cache="none", seed=cfg.seed)
    tok = llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = random_prompts(vocab, list(tok.all_special_ids) if tok is not None else [],
                             cfg.num_prompts, cfg.input_len, cfg.seed)
    ref = load_hf_reference(model_dir_of(cfg.model), cfg.dtype) if cfg.hf else None
    if cfg.warmup:
        # first-call allocations and kernel selection off the clock
        warm = random_prompts(vocab, [], min(cfg.num_prompts, 2), min(cfg.input_len, 32), cfg.seed + 1)
        run_engine(llm, warm, 4)
        if ref is not None:
            hf_generate_seconds(ref, warm, 4)
    runs: dict[str, list[ThroughputResult]] = {"sparsex": [], "transformers": []}
    for r in range(cfg.repeats):
        log(f"[{r + 1}/{cfg.repeats}] sparsex: {cfg.num_prompts} x {cfg.input_len} -> {cfg.output_len} tokens ...")
        runs["sparsex"].append(run_engine(llm, prompts, cfg.output_len))
        if ref is not None:
            log(f"[{r + 1}/{cfg.repeats}] transformers ...")
            secs, generated = hf_generate_seconds(ref, prompts, cfg.output_len)
            runs["transformers"].append(ThroughputResult("transformers", secs, sum(map(len, prompts)), generated))
    return [sorted(rs, key=lambda x: x.seconds)[len(rs) // 2] for rs in runs.values() if rs]


def format_table(results: list[ThroughputResult]) -> str:
    lines = [f"{'backend':<14}{'seconds':>10}{'output tok/s':>15}{'total tok/s':>14}{'vs transformers':>17}"]
    base = next((r for r in results if r.backend == "transformers"), None)
    for r in results:
        rel = f"{r.output_tps / base.output_tps:.2f}x" if base is not None else "-"
        lines.append(f"{r.backend:<14}{r.seconds:>10.2f}{r.output_tps:>15.1f}{r.total_tps:>14.1f}{rel:>17}")
    return "\n".join(lines)
