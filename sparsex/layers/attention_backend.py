"""Attention over the paged KV cache: the torch (CPU) backend, which is also the reference.

A backend provides two functions, both reading `AttentionMetadata`:
  store_kv(key, value, k_cache, v_cache, slot_mapping)
  attention(query, k_cache, v_cache, metadata, scale) -> output
Caches are per layer: `[num_blocks, block_size, num_kv_heads, head_dim]`.
The GPU backend (Triton) implements the same two functions.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsex.layers.attention_metadata import AttentionMetadata


class TorchAttentionBackend:
    """Exact attention with torch SDPA; one call per sequence (gathers that sequence's blocks)."""

    name = "torch"

    @staticmethod
    def store_kv(
        key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens]
    ) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))

    @staticmethod
    def attention(
        query: torch.Tensor,        # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        md: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:              # [num_tokens, num_heads, head_dim]
        block_size = k_cache.shape[1]
        out = torch.empty_like(query)
        cu, lens = md.cu_seqlens_q_cpu, md.seq_lens_cpu
        for s in range(md.num_seqs):
            q0, q1 = cu[s], cu[s + 1]
            if q0 == q1:
                continue
            n = lens[s]
            nb = (n + block_size - 1) // block_size
            blocks = md.block_tables[s, :nb]
            k = k_cache[blocks].flatten(0, 1)[:n]          # [n, num_kv_heads, head_dim]
            v = v_cache[blocks].flatten(0, 1)[:n]
            q = query[q0:q1]                                # [q_len, num_heads, head_dim]
            q_len = q1 - q0
            if q_len == 1 and md.contiguous:
                mask = None                                  # decode: the row sees every key
                causal = False
            elif md.contiguous and q_len == n:
                mask, causal = None, True                    # plain prefill: top-left == bottom-right
            else:
                key_pos = torch.arange(n, device=q.device)
                mask = key_pos[None, :] <= md.positions[q0:q1, None]   # [q_len, n], exact per-row causal
                causal = False
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),             # [1, num_heads, q_len, head_dim]
                k.transpose(0, 1).unsqueeze(0).to(q.dtype),
                v.transpose(0, 1).unsqueeze(0).to(q.dtype),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
                enable_gqa=True,
            )
            out[q0:q1] = o[0].transpose(0, 1)
        return out
