"""Prefill work of a request (token-layers and FLOPs) from the engine's reported counts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FlopModel:
    """Prefill FLOPs of a decoder-only transformer (multiply-add = 2 FLOPs).

    Per computed (row, layer): the q/k/v/o projections and the gated MLP, plus attention, whose
    cost for a row at position p is 4 * heads * head_dim * (p + 1) (QK^T and AV over p + 1 keys).
    Plus the LM head for the one row whose logits start decoding. Norms, RoPE, the segment KV
    copy and the selector's probe are left out (the selector's cost is reported as time).
    """
    num_layers: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int

    @staticmethod
    def from_config(cfg: Any) -> FlopModel:
        return FlopModel(cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size)

    @property
    def linear_per_row_layer(self) -> int:
        q_o = 2 * self.hidden * self.num_heads * self.head_dim
        kv = 2 * self.hidden * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        return 2 * (q_o + kv + mlp)

    @property
    def qkv_per_row_layer(self) -> int:
        return 2 * self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def token_layers(self, rows: int, kept_rows: int, full_layers: int,
                     candidate_rows: int | None = None, rescore_layers: int = 0) -> float:
        """(row, layer) passes of a prefill of `rows` rows of which `kept_rows` go past the
        selection layer S = max(F-1, 0): layers 0..S-1 run every row, layer S every row's q/k/v (a
        dropped row's counted as its share of a layer's linear FLOPs) and the kept rows' rest,
        layers S+1.. the kept rows. Two-stage selection: `candidate_rows` go past S, and the second
        selection at S2 = S + rescore_layers narrows them to `kept_rows` the same way."""
        L = self.num_layers
        S = max(min(full_layers, L) - 1, 0)
        S2 = min(S + rescore_layers, L)
        cand = kept_rows if candidate_rows is None else candidate_rows
        qkv_share = self.qkv_per_row_layer / self.linear_per_row_layer
        # every dropped row computed its q/k/v in the layer that dropped it, whichever stage that was
        return S * rows + (S2 - S) * cand + (L - S2) * kept_rows + (rows - kept_rows) * qkv_share

    def prefill(self, num_prompt: int, num_cached: int, reused_spans: list[tuple[int, int]],
                num_recomputed: int, full_layers: int, num_candidates: int | None = None,
                rescore_layers: int = 0) -> tuple[float, float]:
        """(token-layers, FLOPs) of one prefill. Token-layers count a row's pass through a layer as
        1, and a dropped row's q/k/v projection in the selection layer as its share of a layer's
        linear FLOPs.

        Rows at positions [num_cached, num_prompt) run layers 0..S-1 in full (S = max(F-1, 0), the
        selection layer, step_blend.selection_layer); layer S computes every row's q/k/v and the rest
        for the kept rows only; layers S+1.. run the kept rows: the new rows (outside
        `reused_spans`) plus `num_recomputed` reused rows. Which reused rows the selector kept is
        not reported by the engine, so their attention is costed at the reused rows' mean position
        (exact for their count and their linear FLOPs)."""
        L, F = self.num_layers, min(full_layers, self.num_layers)
        S = max(F - 1, 0)
        rows = num_prompt - num_cached
        keys_all = _keys(num_cached, num_prompt)
        reused = sum(e - s for s, e in reused_spans)
        keys_reused = sum(_keys(s, e) for s, e in reused_spans)
        mean_keys = keys_reused / reused if reused else 0.0
        sparse_rows = rows - reused + num_recomputed
        sparse_keys = keys_all - keys_reused + num_recomputed * mean_keys
        cand = num_recomputed if num_candidates is None else num_candidates
        S2 = min(S + rescore_layers, L)
        cand_keys = keys_all - keys_reused + cand * mean_keys
        token_layers = self.token_layers(rows, sparse_rows, full_layers, rows - reused + cand, S2 - S)
        attn = 4 * self.num_heads * self.head_dim * (S * keys_all + (S2 - S) * cand_keys + (L - S2) * sparse_keys)
        return token_layers, float(token_layers * self.linear_per_row_layer + attn + 2 * self.hidden * self.vocab)


def _keys(lo: int, hi: int) -> int:
    """Sum over positions p in [lo, hi) of the p + 1 keys a causal row attends to."""
    return (hi * (hi + 1) - lo * (lo + 1)) // 2
