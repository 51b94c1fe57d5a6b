"""The KV cache tensors, as the parts that write KV outside a forward see them (the segment
registrar's merged encodings, the segment store's spill, publish and install)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DeviceKV:
    # per layer (key cache, value cache), each [num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_size: int
    device: torch.device
    dtype: torch.dtype
    bytes_per_token: int          # one token's K and V over every layer
    # host arrays -> device tensors in one pinned, asynchronous copy (as the step's inputs: a pageable
    # copy would wait for the forward in flight)
    upload: Callable[[list[np.ndarray]], list[torch.Tensor]]
    # per layer [rotary_dim / 2] float32 RoPE frequencies; read at each use, so a benchmark that swaps
    # the runner's model is followed
    layer_inv_freqs: Callable[[], list[torch.Tensor]]
    # tensor parallelism: told of every merged-encoding write (host arrays src, mean, dst, delta and
    # the weight) after it is made here, so the other ranks make it on their shards too
    on_merge: Callable[[list[np.ndarray], float], None] | None = None
    # tensor parallelism: told of every host-tier move of rank 0's shard (op "spill" / "install" with the
    # record key and its slots, "take" / "evict" with the key, "clear"), so the other ranks move theirs
    on_host: Callable[[str, str | None, np.ndarray | None], None] | None = None

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """The K/V at `slots` of every layer: [layers, 2, n, kv_heads, head_dim], a copy on the KV's device."""
        return torch.stack([torch.stack([c.view(-1, *c.shape[2:]).index_select(0, slots) for c in kv])
                            for kv in self.kv_caches])

    def write(self, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Write `kv` ([layers, 2, n, kv_heads, head_dim], on the KV's device) at `slots` of every layer."""
        for (k_cache, v_cache), layer in zip(self.kv_caches, kv):
            k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, layer[0])
            v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, layer[1])
