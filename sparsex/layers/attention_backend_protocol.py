"""What a model layer needs from an attention backend: store this step's K/V in the paged cache, and
attend over it. `ForwardContext.backend` holds one. Implementations: `TorchAttentionBackend` (CPU;
attention_backend.py), `TritonAttentionBackend` (GPU; triton_attention.py) and the decode backend of
the captured CUDA graphs (`FixedSplitDecodeBackend`, engine/cuda_graph.py). The torch and Triton
backends are used as classes (static methods), the graph one as an instance: either fits.

tests/test_attention_backend_protocol.py checks every implementation's signatures against this one."""
from __future__ import annotations

from typing import Protocol

import torch

from sparsex.layers.attention_metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str                       # for logs and benchmark tables: "torch", "triton", ...

    def store_kv(
        self,
        key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64: row i goes to slot slot_mapping[i]
    ) -> None:
        """Write this step's K/V rows into their cache slots."""

    def attention(
        self,
        query: torch.Tensor,        # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
        key: torch.Tensor | None = None,     # this step's K/V, already stored (None in a selection layer)
        value: torch.Tensor | None = None,
        *,
        sliding_window: int | None = None,   # a row at position i sees keys i - sliding_window + 1 .. i
        logits_soft_cap: float | None = None,   # scaled scores s -> logits_soft_cap * tanh(s / logits_soft_cap)
    ) -> torch.Tensor:              # [num_tokens, num_heads, head_dim]
        """Each query row attends causally over its sequence's cached keys (block_table, positions and
        rows from `md`); exact, whatever rows the step holds."""
