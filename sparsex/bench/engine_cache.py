"""The workload bench's engines: one per (cache mode, role, eviction), reset between policies."""
from __future__ import annotations

import gc
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sparsex.engine.llm_engine import LLMEngine


class EngineCache:
    """Engines by (cache mode, role, eviction policy), built on first use; `release` drops them.

    Policies with the same cache mode share an engine: `take` clears its caches first. Roles:
    "timed" (the measured replay, and for cache="none" the reference) and "twin" (fidelity). One
    engine per key: asking for another pool size replaces it (each engine holds its own copy of the
    weights, and a test module that kept one per size reached 18 GB of CI's 24)."""

    def __init__(self, model: str, dtype: str, seed: int = 0, device: str = "cpu"):
        self.model, self.dtype, self.seed, self.device = model, dtype, seed, device
        self._engines: dict[tuple[str, str, str], LLMEngine] = {}

    def take(self, cache: str, role: str, num_blocks: int, eviction: str = "frequency",
             warm: bool = True) -> LLMEngine:
        from sparsex.config import EngineConfig, ReuseConfig
        from sparsex.engine.llm_engine import LLMEngine

        key = (cache, role, eviction)
        if key in self._engines and self._engines[key].config.num_blocks != num_blocks:
            self._drop([key])
        if key not in self._engines:
            engine = LLMEngine(EngineConfig(model=self.model, dtype=self.dtype, device=self.device, cache=cache, seed=self.seed,
                                            num_blocks=num_blocks, segment_eviction=eviction,
                                            reuse=ReuseConfig()))
            if warm:
                _warm_up(engine)
            self._engines[key] = engine
        engine = self._engines[key]
        engine.reset_cache()
        engine.check_integrity()
        return engine

    def release(self, cache: str | None = None) -> None:
        self._drop([k for k in self._engines if cache is None or k[0] == cache])

    def _drop(self, keys: list[tuple[str, str, str]]) -> None:
        for key in keys:
            del self._engines[key]
        gc.collect()        # an engine holds GBs of KV pool: free it before the next one is built


def _warm_up(engine: LLMEngine) -> None:
    """One short request so the first measured TTFT does not pay one-time allocations."""
    from sparsex.bench.fidelity import run_to_completion
    from sparsex.sampling_params import SamplingParams
    text = "Warm-up: the quick brown fox jumps over the lazy dog. " * 4
    run_to_completion(engine, {"segments": [text, "Say hi."]}, SamplingParams(temperature=0, max_tokens=2))
    engine.reset_cache()
