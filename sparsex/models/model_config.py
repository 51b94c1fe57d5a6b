"""Architecture hyper-parameters of a RoPE decoder, read from a Hugging Face `config.json`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                  # "llama" | "qwen2" (HF `model_type`)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False       # Qwen2: bias on q/k/v projections
    rope_scaling: dict[str, Any] | None = None   # e.g. Llama-3: {"rope_type": "llama3", "factor": 8, ...}
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model_type {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
        heads = cfg["num_attention_heads"]
        # transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta/rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
