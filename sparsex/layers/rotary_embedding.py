"""Rotary position embedding (HF "rotate_half" layout): Llama-3, linear and LongRoPE frequency
scaling, partial rotary (only the first `rotary_dim` dims of a head rotate: Phi-4-mini).

RoPE is a rotation per frequency pair, so R(a)·R(b) = R(a+b): a key computed at position p
moves to position p+Δ by one more rotation by Δ (`rotate`), which is what segment reuse does.
That holds per layer: a model whose layers use different bases (Gemma 3's sliding and global
layers) has one `RotaryEmbedding` per base, and a moved key is re-rotated with its layer's
frequencies (`DecoderForCausalLM.layer_inv_freqs`).

LongRoPE (Phi-3/4 long-context checkpoints) switches between two frequency sets at the pretraining
length: transformers picks the long set for a whole sequence once it outgrows that length, which
would change the keys already cached for its earlier positions. Here the set is fixed per engine:
short while `max_model_len` fits the pretraining length (then equal to transformers on every
prompt), long otherwise (equal to transformers on prompts past that length).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from sparsex.layers import cpu_kernels


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  max_position: int | None = None) -> torch.Tensor:
    """[head_dim / 2] float32 frequencies; `head_dim` is the rotary dim (partial rotary: less than
    the head). `max_position` (the engine's max_model_len) picks LongRoPE's set."""
    # float32 like transformers, so positions ~1e4 give bit-comparable angles
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim   # [head_dim/2]
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type")
    if kind == "longrope":
        original = scaling["original_max_position_embeddings"]
        use_long = max_position is not None and max_position > original
        ext = torch.tensor(scaling["long_factor" if use_long else "short_factor"], dtype=torch.float32, device="cpu")
        if ext.numel() != head_dim // 2:
            raise ValueError(f"longrope factors have {ext.numel()} entries, expected {head_dim // 2}")
        return (1.0 / (ext * theta ** exponents)).float()
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled).float()
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float()
    raise ValueError(f"unsupported rope scaling {kind!r}")


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """LongRoPE's scale on cos/sin (so on q·k twice): sqrt(1 + ln(factor) / ln(original length))."""
    if scaling is None or scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, rotary_dim/2]. Dims past
    rotary_dim (partial rotary) pass through."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
    c, s = cos[:, None, :], sin[:, None, :]
    rotated = (x1 * c - x2 * s, x2 * c + x1 * s)
    if 2 * half < x.shape[-1]:
        rotated += (x[..., 2 * half:].float(),)
    return torch.cat(rotated, dim=-1).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int,
                 rotary_dim: int | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling, self.max_position = head_dim, theta, scaling, max_position
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {self.rotary_dim}")
        self.build(torch.device("cpu"))

    def build(self, device: torch.device) -> None:
        """(Re)compute the float32 tables on `device` (also after the module was moved or cast)."""
        inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling, self.max_position).to(device)
        freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float32, device=device), inv_freq)
        mscale = rope_attention_factor(self.scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)                # [rotary_dim/2]
        self.register_buffer("cos_cache", freqs.cos() * mscale, persistent=False)   # [max_position, rotary_dim/2]
        self.register_buffer("sin_cache", freqs.sin() * mscale, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_cache[positions], self.sin_cache[positions]

    @property
    def _full(self) -> bool:
        """Every dim rotates: the fused kernels (written for that) apply."""
        return self.rotary_dim == self.head_dim

    def _uses_triton(self, q: torch.Tensor) -> bool:
        half = self.head_dim // 2
        return q.is_cuda and self._full and half & (half - 1) == 0

    def forward_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          store_kv) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, then the layer's K/V store (`store_kv`, the backend's): on the GPU both in one
        Triton launch (triton_fused.rope_qk_store), for the layers that read nothing in between."""
        if self._uses_triton(q):
            from sparsex.layers.triton_fused import rope_qk_store
            return rope_qk_store(q, k, v, positions, self.cos_cache, self.sin_cache, k_cache, v_cache, slot_mapping)
        q, k = self(positions, q, k)
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q, k

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._uses_triton(q):
            from sparsex.layers.triton_fused import rope_qk             # one kernel instead of ~16
            return rope_qk(q, k, positions, self.cos_cache, self.sin_cache)
        if (self._full and cpu_kernels.supports(q, k) and q.dtype == k.dtype and positions.dtype == torch.int64
                and self.cos_cache.dtype == torch.float32):
            return cpu_kernels.rope(q, k, positions, self.cos_cache, self.sin_cache)   # `rotate` in one call
        cos, sin = self.cos_sin(positions)
        return rotate(q, cos, sin), rotate(k, cos, sin)
