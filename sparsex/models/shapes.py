"""Expected Hugging Face parameter names and shapes of a Llama/Qwen2 decoder.

The single source of truth for "which tensors does a model of this config have": the dummy
generator creates exactly these, and the loaders validate checkpoints against them.
"""
from __future__ import annotations

from sparsex.models.model_config import ModelConfig


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, in a fixed order (embeddings, layers 0..L-1, final norm, head)."""
    h = config.hidden_size
    q_dim = config.num_attention_heads * config.head_dim      # rows of q_proj
    kv_dim = config.num_key_value_heads * config.head_dim     # rows of k_proj / v_proj
    ffn = config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_dim, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_dim, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_dim, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_dim,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_dim)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (ffn, h)
        shapes[p + "mlp.up_proj.weight"] = (ffn, h)
        shapes[p + "mlp.down_proj.weight"] = (h, ffn)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def is_norm_weight(name: str) -> bool:
    """RMSNorm gains (initialised to 1 in random models, unlike projections)."""
    return name.endswith("layernorm.weight") or name == "model.norm.weight"
