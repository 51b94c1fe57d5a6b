"""One tensor-parallel rank's share of a checkpoint: the rank-local model config and the
Hugging Face-named tensors cut to it (layers/tensor_parallel.py says which rank holds what).

The cut tensors keep their checkpoint names and take the local shapes, so
`DecoderForCausalLM.load_hf_weights` loads them unchanged. Fused checkpoints (Phi-3's qkv_proj and
gate_up_proj, fused MoE experts) are split into their parts first: a fused tensor's rows are
[q | k | v] or [gate | up], and a rank needs a slice of each part.
"""
from __future__ import annotations

import dataclasses

import torch

from sparsex.layers.tensor_parallel import TensorParallelGroup, check_divisible
from sparsex.models.model_config import ModelConfig
from sparsex.models.moe import _FUSED_DOWN, _FUSED_GATE_UP, _PER_EXPERT_NAMES


def local_config(cfg: ModelConfig, tp: TensorParallelGroup) -> ModelConfig:
    """The config of one rank's layers: its query heads, KV heads and MLP columns (hidden size,
    head_dim and vocabulary unchanged: the embedding and head are split by layers/tensor_parallel.py)."""
    check_divisible(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size,
                    cfg.moe_intermediate_size, tp.size)
    kv0, kv1 = tp.kv_head_range(cfg.num_key_value_heads)
    return dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp.size,
                               num_key_value_heads=kv1 - kv0,
                               intermediate_size=cfg.intermediate_size // tp.size,
                               moe_intermediate_size=cfg.moe_intermediate_size // tp.size)


def shard_hf_weights(weights: dict[str, torch.Tensor], cfg: ModelConfig,
                     tp: TensorParallelGroup) -> dict[str, torch.Tensor]:
    """HF-named full tensors -> this rank's tensors (copies: the full ones can be dropped)."""
    d = cfg.head_dim
    q0, q1 = (h * d for h in tp.head_range(cfg.num_attention_heads))
    k0, k1 = (h * d for h in tp.kv_head_range(cfg.num_key_value_heads))
    q_dim, kv_dim = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def cols(n: int) -> tuple[int, int]:          # this rank's share of an inner dimension of n
        per = n // tp.size
        return tp.rank * per, (tp.rank + 1) * per

    i0, i1 = cols(cfg.intermediate_size)
    m0, m1 = cols(cfg.moe_intermediate_size) if cfg.num_experts else (0, 0)
    v0, v1 = tp.vocab_range(cfg.vocab_size)
    out: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = w[v0:min(v1, w.shape[0])]
            if part.shape[0] < v1 - v0:                       # the last rank's padding rows
                part = torch.cat([part, part.new_zeros(v1 - v0 - part.shape[0], *part.shape[1:])])
            out[name] = part.clone()
        elif name.endswith("self_attn.qkv_proj.weight"):      # Phi-3: [q | k | v] rows
            base = name[: -len("qkv_proj.weight")]
            q, k, v = w.split([q_dim, kv_dim, kv_dim])
            out[base + "q_proj.weight"], out[base + "k_proj.weight"] = q[q0:q1].clone(), k[k0:k1].clone()
            out[base + "v_proj.weight"] = v[k0:k1].clone()
        elif name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            out[name] = w[q0:q1].clone()
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight",
                            "self_attn.k_proj.bias", "self_attn.v_proj.bias")):
            out[name] = w[k0:k1].clone()
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = w[:, q0:q1].clone()
        elif name.endswith("mlp.gate_up_proj.weight"):       # Phi-3: [gate | up] rows
            base = name[: -len("gate_up_proj.weight")]
            gate, up = w.split(cfg.intermediate_size)
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = gate[i0:i1].clone(), up[i0:i1].clone()
        elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            out[name] = w[i0:i1].clone()
        elif name.endswith("mlp.down_proj.weight"):
            out[name] = w[:, i0:i1].clone()
        elif name.endswith(_FUSED_GATE_UP):                  # [E, 2 * inter, hidden]: gate rows, then up
            gate, up = w.split(cfg.moe_intermediate_size, dim=1)
            out[name] = torch.cat([gate[:, m0:m1], up[:, m0:m1]], dim=1)
        elif name.endswith(_FUSED_DOWN):                     # [E, hidden, inter]
            out[name] = w[:, :, m0:m1].clone()
        elif ".experts." in name:                            # per-expert gate / up / down
            out[name] = _shard_expert(name, w, cfg, m0, m1)
        else:                                                # norms, the router: every rank whole
            out[name] = w
    return out


def _shard_expert(name: str, w: torch.Tensor, cfg: ModelConfig, m0: int, m1: int) -> torch.Tensor:
    _, (gate, up, down) = _PER_EXPERT_NAMES[cfg.architecture]
    proj = name.rsplit(".", 2)[-2]
    if proj in (gate, up):
        return w[m0:m1].clone()                              # [inter, hidden] rows
    if proj == down:
        return w[:, m0:m1].clone()                           # [hidden, inter] columns
    raise ValueError(f"unknown expert tensor {name!r} for {cfg.architecture!r}")
