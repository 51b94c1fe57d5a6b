"""Cold prefill latency (TTFT) vs prompt length, the engine vs a transformers forward of the same ids.

Each point is the median of `repeats` runs; the engine and transformers runs alternate so that a
burst of load from other processes hits both sides alike. The engine runs with `cache="none"`, so
every prompt is computed from scratch; its TTFT is the request's own arrival -> first token time.
The transformers side is one forward with the KV cache on (the first step of `generate`), with
`logits_to_keep=1` (only the last row through the LM head, as the engine does) and, optionally,
without it (all rows: what an unaware caller pays).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from sparsex.bench.hf_reference import hf_prefill_seconds, load_hf_reference, model_dir_of
from sparsex.bench.throughput import random_prompts
from sparsex.config import EngineConfig
from sparsex.entrypoints.llm import LLM
from sparsex.sampling_params import SamplingParams

DEFAULT_LENGTHS = (512, 1024, 2048, 4096)


@dataclass
class PrefillConfig:
    model: str = EngineConfig.model
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    repeats: int = 3
    dtype: str = EngineConfig.dtype
    seed: int = 0
    hf: bool = True
    hf_full_logits: bool = True       # also time transformers without logits_to_keep

    def verify(self) -> None:
        if not self.lengths or any(not isinstance(n, int) or n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be integers >= 1, got {list(self.lengths)!r}")
        if not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {self.repeats!r}")


@dataclass
class PrefillPoint:
    length: int
    sparsex_s: list[float] = field(default_factory=list)
    hf_s: list[float] = field(default_factory=list)              # logits_to_keep=1
    hf_full_s: list[float] = field(default_factory=list)         # every row's logits

    @staticmethod
    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    @property
    def speedup(self) -> float | None:
        """transformers (logits_to_keep=1) time / engine time: > 1 means the engine is faster."""
        a, b = self.median(self.sparsex_s), self.median(self.hf_s)
        return None if a is None or b is None else b / a


def engine_ttft(llm: LLM, ids: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    return out.metrics.ttft


def run_prefill(cfg: PrefillConfig, log=print) -> list[PrefillPoint]:
    cfg.verify()
    llm = LLM(model=cfg.model, dtype=cfg.dtype, cache="none", seed=cfg.seed)
    limit = llm.llm_engine.max_model_len
    if max(cfg.lengths) >= limit:
        raise ValueError(f"prompt length {max(cfg.lengths)} does not fit max_model_len {limit}")
    tok = llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.vocab_size
    special = list(tok.all_special_ids) if tok is not None else []
    ref = load_hf_reference(model_dir_of(cfg.model), cfg.dtype) if cfg.hf else None
    warm = random_prompts(vocab, special, 1, min(cfg.lengths), cfg.seed + 1)[0]
    engine_ttft(llm, warm)            # first-call allocations off the clock, for both sides
    if ref is not None:
        hf_prefill_seconds(ref, warm)
    points = []
    for n in cfg.lengths:
        ids = random_prompts(vocab, special, 1, n, cfg.seed + n)[0]
        pt = PrefillPoint(n)
        for _ in range(cfg.repeats):
            pt.sparsex_s.append(engine_ttft(llm, ids))
            if ref is not None:
                pt.hf_s.append(hf_prefill_seconds(ref, ids, logits_to_keep=True))
                if cfg.hf_full_logits:
                    pt.hf_full_s.append(hf_prefill_seconds(ref, ids, logits_to_keep=False))
        log(f"  {n} tokens done")
        points.append(pt)
    return points


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def format_table(points: list[PrefillPoint]) -> str:
    lines = [f"{'tokens':>7}{'sparsex ms':>12}{'HF keep=1 ms':>14}{'HF all ms':>11}{'speedup':>9}{'sparsex tok/s':>15}"]
    for p in points:
        sp = "-" if p.speedup is None else f"{p.speedup:.2f}x"
        tps = p.length / p.median(p.sparsex_s)
        lines.append(f"{p.length:>7}{_ms(p.median(p.sparsex_s)):>12}{_ms(p.median(p.hf_s)):>14}"
                     f"{_ms(p.median(p.hf_full_s)):>11}{sp:>9}{tps:>15.0f}")
    return "\n".join(lines)


def save_plot(points: list[PrefillPoint], path: str, title: str) -> None:
    import os

    from sparsex.bench.pyplot import pyplot
    plt = pyplot()

    xs = [p.length for p in points]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    series = [("sparsex (cache=none)", "sparsex_s", "o-"), ("transformers, logits_to_keep=1", "hf_s", "s--"),
              ("transformers, all logits", "hf_full_s", "^:")]
    for label, attr, style in series:
        ys = [PrefillPoint.median(getattr(p, attr)) for p in points]
        if all(y is not None for y in ys):
            ax.plot(xs, [y * 1e3 for y in ys], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, ms (median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
