"""Start-up warm-up: run a few small requests through every path the engine's cache mode uses, so
the first real request does not pay for compilation.

On the GPU the first blended request of a process compiled the blend's Triton kernels (the
re-rotating copy, the probe, the sparse-row attention: 2-3 s), and the first decode step captured
the decode CUDA graphs. `LLMEngine.warm_up` runs the requests planned here at engine start-up. What it leaves behind is dropped
by the caller, which rebuilds the cache state (block pool, segment index, scheduler, counters)
afterwards, so a warmed engine starts from the same empty caches as a cold one; only compiled
kernels and captured graphs remain.

This module only plans the requests (`warmup_waves`); the engine runs them. The prompts are fixed
pseudo-random token ids (no text, no tokenizer round trip):

    r1  [head, A, B, C, q1]          plain prefill, batched with a short r1b (two sequences in a
                                     step), then a decode step (captures the decode graphs)
    r2  r1's prompt + a new tail     an exact prefix hit, then a short extend step  (prefix, sparsex)
    r3  [head, C, A, B, q2]          A, B and C reused at new positions: a blended prefill  (sparsex)
    r4  [head, B, C, A, long tail]   blended again, with enough new rows (LONG_TAIL_TOKENS) for the
                                     sparse layers' gathered-keys attention that long blended
                                     prompts take (skipped where the pool or context is too small)

The kernels do not specialise on per-request sizes (lengths, block-table widths), so these
compilations serve every later request; `benchmarks/gpu_startup.py` counts what is still compiled
by the first requests after it.
"""
from __future__ import annotations

import numpy as np

from sparsex.config import EngineConfig
from sparsex.sampling_params import SamplingParams

HEAD_TOKENS = 32
QUESTION_TOKENS = 16
MAX_SEGMENT_TOKENS = 256
MIN_SEGMENT_TOKENS = 32
# the Triton attention reads a gathered copy of the keys from 512 rows a step on
# (triton_attention.GATHER_MIN_ROWS); its kernel variant compiles only when a step has that many
LONG_TAIL_TOKENS = 640

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

# A wave: (prompt, per-request reuse overrides) pairs queued together, so one step runs them all.
Wave = list[tuple[dict, dict | None]]


def warmup_waves(config: EngineConfig, num_blocks: int, max_model_len: int, vocab_size: int) -> list[Wave]:
    """The warm-up requests for an engine of this config and size, in waves; [] when even the
    smallest warm-up prompt does not fit the pool or the context."""
    capacity = num_blocks * config.block_size
    # r3 holds its own blocks while the segment entries it copies from hold theirs: keep a prompt
    # under a third of the pool
    longest = min(capacity // 3, max_model_len - 8)
    # a segment shorter than the engine's min_segment_tokens is never indexed, so nothing would blend
    min_seg = max(MIN_SEGMENT_TOKENS, config.reuse.min_segment_tokens)
    seg = min(max(MAX_SEGMENT_TOKENS, min_seg), (longest - HEAD_TOKENS - 2 * QUESTION_TOKENS) // 3)
    if seg < min_seg:
        return []
    rng = np.random.default_rng(0)
    ids = lambda n: rng.integers(min(256, vocab_size // 2), vocab_size, size=n).tolist()
    head, a, b, c = ids(HEAD_TOKENS), ids(seg), ids(seg), ids(seg)
    q1, q1b, q2, tail = (ids(QUESTION_TOKENS) for _ in range(4))
    long_tail = ids(LONG_TAIL_TOKENS)
    # blend whatever hits, wherever it was first encoded: the point is to run the kernels
    blend = {"min_blend_tokens": 0, "min_context_tokens": 0}
    waves: list[Wave] = [[({"segments": [head, a, b, c, q1]}, None), ({"prompt_token_ids": q1b + tail}, None)]]
    if config.enable_prefix_caching:
        waves.append([({"prompt_token_ids": head + a + b + c + q1 + tail}, None)])
    if config.enable_segment_reuse:
        waves.append([({"segments": [head, c, a, b, q2]}, blend)])
        if HEAD_TOKENS + 3 * seg + LONG_TAIL_TOKENS <= longest:
            waves.append([({"segments": [head, b, c, a, long_tail]}, blend)])
    return waves
