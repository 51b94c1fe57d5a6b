"""Native CPU kernels for the decode hot path (`sparsex/csrc/cpu_kernels.cpp`): paged single-row
attention, paged multi-row (flash-style) attention for prefill and sparse rows (used only on AVX-512
CPUs: `multi_row_preferred`), both with an optional sliding window and logit softcapping, the KV
store, RMSNorm (+ residual add), RoPE on q and k, SiLU·mul.

The extension is compiled at first use with `torch.utils.cpp_extension.load` (g++ -O3 -march=native
-fopenmp, through ninja) into torch's extension directory (`$TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions). Its name carries a hash of this CPU's model and feature flags, so a
cache shared between machines never loads code built for another instruction set; a changed source
or flag set is rebuilt by torch. Each function here mirrors a torch reference that stays in the
calling module (`layernorm.py`, `rotary_embedding.py`, `models/decoder.py`, `attention_backend.py`): the
reference is what the tests compare against and what runs when `native()` is None, i.e. with
`SPARSEX_NATIVE_KERNELS=0` (read once, at first use) or when the build failed (one warning).
Inputs must be CPU tensors in bfloat16 or float32 (`supports`).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

ENV = "SPARSEX_NATIVE_KERNELS"
DTYPES = (torch.bfloat16, torch.float32)
ATTENTION_HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)   # the attention kernels are compiled for these
_SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "cpu_kernels.cpp"
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


def _cpu_tag() -> str:
    """Short hash of what -march=native compiles for: the CPU model and its feature flags."""
    ident = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        ident += "".join(sorted(set(lines)))
    except OSError:
        pass
    return hashlib.sha256(ident.encode()).hexdigest()[:12]


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH: add the ninja package's binary (last), for a virtualenv used
    without activating it."""
    try:
        import ninja
    except ImportError:
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = path + os.pathsep + ninja.BIN_DIR if path else ninja.BIN_DIR


@functools.cache
def native() -> ModuleType | None:
    """The compiled extension, or None when disabled (`SPARSEX_NATIVE_KERNELS=0`) or unbuildable."""
    if os.environ.get(ENV, "1") == "0":
        logger.info("%s=0: native CPU kernels disabled, using the torch implementations", ENV)
        return None
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        return load(name=f"sparsex_cpu_kernels_{_cpu_tag()}", sources=[str(_SOURCE)],
                    extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"])
    except Exception as e:          # no compiler, no ninja, a compile error: the torch code still works
        lines = str(e).strip().splitlines() or [""]
        summary = next((ln for ln in lines if "error" in ln), lines[0])[:300]     # a compiler error if any
        logger.warning("native CPU kernels unavailable, using the torch implementations (%s: %s)",
                       type(e).__name__, summary)
        logger.debug("native CPU kernel build failure", exc_info=True)
        return None


@functools.cache
def multi_row_preferred() -> bool:
    """Whether the flash-style multi-row kernel beats the GEMM row chunks here. It is written for
    512-bit vectors (16 floats each, up to 24 accumulators per tile): on a CPU without AVX-512 every
    vector becomes two 256-bit halves and the accumulators spill. Measured on a 2-core AMD EPYC (Zen 3,
    AVX2 only, SmolLM2, float32): 2.2x slower than the GEMM path at 512 tokens, 4.5x at 2,048 (24.3
    against 5.4 s); on the AVX-512 machines it was 1.3-2x faster. So multi-row sequences use it only
    where torch reports AVX-512; the decode kernel (one row) is faster than SDPA on both."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def supports(*tensors: torch.Tensor) -> bool:
    """True when every tensor is a CPU tensor the kernels take (bf16 / fp32) and the extension is
    loaded (checked last: GPU tensors never trigger the build)."""
    for t in tensors:               # a loop, not all(<genexpr>): this runs ~150 times a decode step
        if not t.is_cpu or t.dtype not in DTYPES:
            return False
    return native() is not None


def _module() -> ModuleType:
    mod = native()
    if mod is None:
        raise RuntimeError(f"native CPU kernels are not available (disabled by {ENV}=0 or the build failed)")
    return mod


# The wrappers below only pick the extension function: it validates its arguments itself and raises
# ValueError for bad ones (dtypes, shapes, positions or block ids out of range). The same checks in
# Python cost ~10 us a call, ~1.5 ms of a 30-layer decode step.

def decode_attention(
    query: torch.Tensor,          # [S, num_heads, head_dim], one row per sequence
    k_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,   # [S, max_blocks] int32
    positions: torch.Tensor,      # [S] int64: row s attends to keys 0..positions[s] of sequence s
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:                # [S, num_heads, head_dim], query dtype
    """Softmax attention of each row over its sequence's keys, read straight from the paged cache.
    `sliding_window` W: only keys positions[s]-W+1..positions[s] (the others are not read);
    `logits_soft_cap` C: scores s = q·k * scale become C * tanh(s / C) before the softmax.
    head_dim must be one of ATTENTION_HEAD_DIMS; num_heads a multiple of num_kv_heads (GQA)."""
    # the extension takes 0 for "none" (a plain int / float argument is cheaper to pass than an optional)
    return _module().decode_attention(query, k_cache, v_cache, block_tables, positions, scale,
                                      sliding_window or 0, logits_soft_cap or 0.0)


def multi_row_attention(
    query: torch.Tensor,          # [T, num_heads, head_dim], the rows of all sequences
    k_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,   # [S, max_blocks] int32
    query_start: torch.Tensor,    # [S + 1] int64: rows of sequence s are query_start[s]:query_start[s+1]
    positions: torch.Tensor,      # [T] int64: row t attends to keys 0..positions[t] of its sequence
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:                # [T, num_heads, head_dim], query dtype
    """Softmax attention of every row over its sequence's keys in flash-style tiles (online softmax,
    float32; scores are never materialised). Rows of a sequence may have any positions (sparse rows).
    `sliding_window` W: row t sees only keys positions[t]-W+1..positions[t], and a tile of rows
    starts at the key block holding its first row's first key (a long prompt costs O(W) per row);
    `logits_soft_cap` C: scores s = q·k * scale become C * tanh(s / C) before the softmax.
    head_dim must be one of ATTENTION_HEAD_DIMS; num_heads a multiple of num_kv_heads (GQA)."""
    return _module().multi_row_attention(query, k_cache, v_cache, block_tables, query_start, positions, scale,
                                         sliding_window or 0, logits_soft_cap or 0.0)


def store_kv(
    key: torch.Tensor,            # [T, num_kv_heads, head_dim] (a strided view of a fused qkv is fine)
    value: torch.Tensor,
    k_cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim], the dtype of key/value
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,   # [T] int64, the cache slot of each row
) -> None:
    """Writes each row's K and V into its cache slot."""
    _module().store_kv(key, value, k_cache, v_cache, slot_mapping)


def rms_norm(
    x: torch.Tensor,                          # [..., hidden]
    weight: torch.Tensor,                     # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,     # [..., hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
    if residual is None:
        return _module().rms_norm(x, weight, eps)
    return _module().add_rms_norm(x, residual, weight, eps)


def rope(
    q: torch.Tensor,              # [T, num_heads, head_dim] (a strided view of a fused qkv is fine)
    k: torch.Tensor,              # [T, num_kv_heads, head_dim]
    positions: torch.Tensor,      # [T] int64
    cos_cache: torch.Tensor,      # [max_position, head_dim / 2] float32
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q and k (HF rotate_half layout), contiguous, in the input dtype."""
    return _module().rope(q, k, positions, cos_cache, sin_cache)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [rows, 2 * inter] (gate first) -> silu(gate) * up: [rows, inter]."""
    return _module().silu_and_mul(gate_up)
