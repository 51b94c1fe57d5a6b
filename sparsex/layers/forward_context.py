"""What one forward pass needs besides token ids: attention metadata, KV caches, backend, and
SparseX's hooks (a probe that observes a layer's fresh K/V, a row selector that drops rows inside a
layer once its K/V are stored)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from sparsex.layers.attention_backend_protocol import AttentionBackend
from sparsex.layers.attention_metadata import AttentionMetadata


class RowSelector(Protocol):
    # layers inside which rows are selected: after the layer has stored every row's K/V, before
    # its attention (so that layer's K/V are fresh for all rows, and only kept rows go further)
    layers: frozenset[int]

    def __call__(self, layer_idx: int, ctx: "ForwardContext") -> tuple[torch.Tensor, list[int]] | None:
        """Row indices (sorted, int64) to keep from here on and how many rows each sequence keeps
        (host ints, so building the sparse layers' metadata needs no device sync), or None: all."""


# probe(layer_idx, q, k, v, k_cache, v_cache, ctx): called before this layer stores its K/V
Probe = Callable[..., None]


@dataclass
class ForwardContext:
    attn_metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]   # per layer (k_cache, v_cache)
    backend: AttentionBackend
    probe_layers: frozenset[int] = frozenset()
    probe: Probe | None = None
    row_selector: RowSelector | None = None
    # callbacks run just before layer i (a blended step launches its KV copies from one)
    pre_layer_hooks: dict[int, Callable[[], None]] = field(default_factory=dict)
    # rows kept so far, as indices into the step's original rows (None: all rows)
    kept_rows: torch.Tensor | None = None
