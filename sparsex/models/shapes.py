"""Expected Hugging Face parameter names and shapes of a decoder of any supported family.

The single source of truth for "which tensors does a model of this config have": the dummy
generator creates exactly these, and the loaders validate checkpoints against them.
"""
from __future__ import annotations

from sparsex.models.model_config import ModelConfig
from sparsex.models.moe import PER_EXPERT, moe_param_shapes

# Families whose checkpoints store q/k/v and gate/up fused (the decoder fuses the others at load)
FUSED_PROJECTION_ARCHITECTURES = ("phi3",)


def param_shapes(config: ModelConfig, moe_layout: str = PER_EXPERT) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, in a fixed order (embeddings, layers 0..L-1, final norm, head).
    `moe_layout`: how a MoE checkpoint stores its experts (moe.detect_moe_layout)."""
    h = config.hidden_size
    q_dim = config.num_attention_heads * config.head_dim      # rows of q_proj
    kv_dim = config.num_key_value_heads * config.head_dim     # rows of k_proj / v_proj
    ffn = config.intermediate_size
    fused = config.architecture in FUSED_PROJECTION_ARCHITECTURES
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        if fused:
            shapes[p + "self_attn.qkv_proj.weight"] = (q_dim + 2 * kv_dim, h)
        else:
            shapes[p + "self_attn.q_proj.weight"] = (q_dim, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv_dim, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv_dim, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_dim)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        if config.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (h,)
            shapes[p + "post_feedforward_layernorm.weight"] = (h,)
        if config.is_moe_layer(i):
            shapes.update(moe_param_shapes(config, p, moe_layout))
        elif fused:
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * ffn, h)
            shapes[p + "mlp.down_proj.weight"] = (h, ffn)
        else:
            shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
            shapes[p + "mlp.up_proj.weight"] = (ffn, h)
            shapes[p + "mlp.down_proj.weight"] = (h, ffn)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def is_norm_weight(name: str) -> bool:
    """RMSNorm gains (initialised to 1 in random models, unlike projections)."""
    return name.endswith(("layernorm.weight", "_norm.weight")) or name == "model.norm.weight"
