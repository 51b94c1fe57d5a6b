"""Random-weight models with the shapes of real ones (`dummy:<shape>`), for benchmarks and GPU
sizing without downloading checkpoints."""
from __future__ import annotations

from typing import Any

import torch

from sparsex.models.model_config import ModelConfig
from sparsex.models.shapes import is_norm_weight, param_shapes

DUMMY_PREFIX = "dummy:"

# Dummy models reuse the SmolLM2 tokenizer (the only one shipped with the package set), so their
# bos/eos ids are SmolLM2's: <|im_start|> = 1, <|im_end|> = 2. Every id it produces is < 49152,
# hence valid for the larger vocabularies below too.
_TOKENIZER_IDS: dict[str, Any] = {"bos_token_id": 1, "eos_token_id": 2}

# Hugging Face `config.json`-style dicts (read by ModelConfig.from_hf_config).
# Llama 3.1's RoPE scaling (8B and 70B alike)
_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": {  # Llama-3.1-8B
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "attention_bias": False,
        **_TOKENIZER_IDS,
    },
    "llama3-70b": {  # Llama-3.1-70B: larger than one GPU in bf16 (tensor parallelism)
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "attention_bias": False,
        **_TOKENIZER_IDS,
    },
    "qwen2.5-7b": {  # Qwen2.5-7B-Instruct
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": True,
        **_TOKENIZER_IDS,
    },
    "qwen3-8b": {  # Qwen3-8B
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        **_TOKENIZER_IDS,
    },
    "gemma3-12b": {  # Gemma-3-12B, the text model
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window": 1024,
        "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        **_TOKENIZER_IDS,
    },
    "qwen3-30b-a3b": {  # Qwen3-30B-A3B (MoE: 128 experts, 8 per token)
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        **_TOKENIZER_IDS,
    },
    "smollm2-135m": {  # SmolLM2-135M(-Instruct)
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "attention_bias": False,
        **_TOKENIZER_IDS,
    },
}


def dummy_shape_of(model: str) -> str | None:
    """`"dummy:llama3-8b"` -> `"llama3-8b"`; None when `model` is not a dummy spec at all."""
    if not model.lower().startswith(DUMMY_PREFIX):
        return None
    return model[len(DUMMY_PREFIX):].strip().lower()


def dummy_config(shape: str) -> ModelConfig:
    """Config of a dummy shape, without allocating any weights."""
    if shape not in DUMMY_SHAPES:
        raise ValueError(f"unknown dummy shape {shape!r}; known: {sorted(DUMMY_SHAPES)}")
    return ModelConfig.from_hf_config(DUMMY_SHAPES[shape])


def random_weights(
    config: ModelConfig, *, dtype: torch.dtype, seed: int, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """N(0, 0.02) projections/embeddings/biases and unit norms (effective: Gemma's stored w is 0), deterministic in `seed` (per device).

    Generated directly in `dtype` on `device` (no float32 CPU staging copy): an 8B model in
    bfloat16 is 16 GB, in float32 32 GB, more than a 24 GB CPU host holds.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in param_shapes(config).items():   # fixed order => reproducible stream
        if is_norm_weight(name):
            weights[name] = torch.full(shape, 1.0 - config.norm_weight_offset, dtype=dtype, device=device)
        else:
            weights[name] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
    return weights
