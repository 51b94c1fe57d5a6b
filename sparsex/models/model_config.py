"""Architecture hyper-parameters of a RoPE decoder, read from a Hugging Face `config.json`.

One decoder (`models/decoder.py`) serves every family below; what differs between them is a
handful of switches, all read here from the family's own config keys:

  family (model_type)      what it adds to the Llama layer
  llama                    (Llama 2/3, SmolLM2) rope scaling "llama3" / "linear"
  qwen2                    q/k/v biases
  qwen3, qwen3_moe         per-head RMSNorm on q and k before RoPE (QK-norm); explicit head_dim
  mistral, mixtral         optional sliding window on every layer
  phi3                     fused qkv_proj / gate_up_proj in the checkpoint; partial rotary; longrope
  gemma3_text (gemma3)     (1 + w) RMSNorm, sandwich norms around attention and MLP, GELU-tanh MLP,
                           embeddings scaled by sqrt(hidden), QK-norm, query_pre_attn_scalar,
                           sliding-window and global layers (`layer_types`) with their own RoPE bases,
                           optional final-logit softcapping
  granite                  embedding / residual / attention multipliers, logits divided by logits_scaling
  qwen3_moe, mixtral       top-k routed experts in place of the MLP (models/moe.py)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text", "granite",
                           "qwen3_moe", "mixtral")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral")
QK_NORM_ARCHITECTURES = ("qwen3", "qwen3_moe", "gemma3_text")
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_ROPE_TYPES = (None, "llama3", "linear", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                  # HF `model_type` (one of SUPPORTED_ARCHITECTURES; "gemma3" maps to "gemma3_text")
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
    # ---- per-family switches (defaults: the Llama layer)
    hidden_act: str = "silu"           # MLP gate activation: "silu" | "gelu_pytorch_tanh" (Gemma)
    qk_norm: bool = False              # RMSNorm over head_dim on q and k before RoPE (Qwen3, Gemma 3)
    partial_rotary_factor: float = 1.0  # share of head_dim that RoPE rotates (Phi-4-mini: 0.75)
    layer_types: tuple[str, ...] = ()  # per layer FULL_ATTENTION | SLIDING_ATTENTION; () = all full
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    rope_local_theta: float | None = None   # RoPE base of sliding layers where it differs (Gemma 3)
    norm_weight_offset: float = 0.0    # RMSNorm multiplies by (offset + w): Gemma's (1 + w)
    sandwich_norms: bool = False       # Gemma 3: norms after attention and around the MLP
    embedding_multiplier: float = 1.0  # embeddings scaled (Gemma: sqrt(hidden); Granite: embedding_multiplier)
    residual_multiplier: float = 1.0   # Granite: each block's output scaled before the residual add
    attention_scale: float | None = None   # softmax scale; None = head_dim ** -0.5
    logits_scaling: float = 1.0        # Granite: logits divided by this
    attn_logit_softcapping: float | None = None    # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None   # logits -> cap * tanh(logits / cap)
    # ---- mixture of experts (qwen3_moe, mixtral); num_experts == 0: dense
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True        # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates (all of them unless partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == SLIDING_ATTENTION and self.sliding_window is not None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for a global layer."""
        return self.sliding_window if self.is_sliding(layer) else None

    def layer_rope_theta(self, layer: int) -> float:
        if self.is_sliding(layer) and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    def layer_rope_scaling(self, layer: int) -> dict[str, Any] | None:
        # Gemma 3's scaled variants (4B+) scale the global layers only; local layers use plain RoPE
        if self.is_sliding(layer) and self.rope_local_theta is not None:
            return None
        return self.rope_scaling

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = cfg.get("model_type")
        if arch == "gemma3":
            # the multimodal wrapper: serve its text part (a checkpoint that keeps the vision tower
            # is refused by the weight check, naming the tensors)
            arch, cfg = "gemma3_text", {**cfg.get("text_config", {}), **{k: cfg[k] for k in ("eos_token_id", "bos_token_id") if k in cfg}}
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model_type {arch!r}; supported: {SUPPORTED_ARCHITECTURES}")
        for key in ("alibi", "position_embedding_type"):
            if cfg.get(key) not in (None, False, "rope"):
                raise ValueError(f"unsupported {key}={cfg[key]!r} for {arch!r}: only RoPE decoders are served")
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        theta, scaling, local_theta, partial = _rope_settings(cfg, arch)
        layers = cfg["num_hidden_layers"]
        layer_types = tuple(cfg.get("layer_types") or ())
        if layer_types and len(layer_types) != layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        bad = [t for t in layer_types if t not in (FULL_ATTENTION, SLIDING_ATTENTION)]
        if bad:
            raise ValueError(f"unsupported layer_types entry {bad[0]!r} for {arch!r}")
        window = cfg.get("sliding_window")
        if arch in ("qwen3", "qwen3_moe", "qwen2") and not cfg.get("use_sliding_window", False):
            window = None      # Qwen keeps a sliding_window value it does not use unless use_sliding_window
        if window is not None and not layer_types:      # Mistral, Mixtral, Phi-3: every layer slides
            layer_types = (SLIDING_ATTENTION,) * layers
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive integer, got {window!r}")
        if window is None:
            layer_types = ()
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {act!r} for {arch!r}; supported: {_ACTIVATIONS}")
        gemma = arch == "gemma3_text"
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        moe: dict[str, Any] = {}
        if arch in MOE_ARCHITECTURES:
            experts = cfg.get("num_local_experts") or cfg.get("num_experts")
            if not experts:
                raise ValueError(f"{arch!r} config lacks num_local_experts / num_experts")
            step = cfg.get("decoder_sparse_step", 1) or 1
            dense = set(cfg.get("mlp_only_layers") or ())
            moe = dict(
                num_experts=int(experts), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) if arch == "qwen3_moe" else True,
                moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
            )
            if shared := cfg.get("shared_expert_intermediate_size"):
                raise ValueError(f"{arch!r} with shared experts (shared_expert_intermediate_size={shared}) is not supported")
        if arch == "granite":
            attention_scale = float(cfg.get("attention_multiplier", head_dim ** -0.5))
        elif gemma:
            attention_scale = float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5
        else:
            attention_scale = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=act,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            partial_rotary_factor=partial,
            layer_types=layer_types,
            sliding_window=window,
            rope_local_theta=local_theta,
            norm_weight_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embedding_multiplier=(float(cfg["hidden_size"]) ** 0.5 if gemma
                                  else float(cfg.get("embedding_multiplier", 1.0))),
            residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
            attention_scale=attention_scale,
            logits_scaling=float(cfg.get("logits_scaling", 1.0)) if arch == "granite" else 1.0,
            # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it
            # (the released checkpoints set it null); applying it would depart from the reference
            attn_logit_softcapping=None if gemma else cfg.get("attn_logit_softcapping"),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            **moe,
        )


def _rope_settings(cfg: dict[str, Any], arch: str) -> tuple[float, dict[str, Any] | None, float | None, float]:
    """(theta, scaling or None, local theta or None, partial rotary factor) from either config style:
    transformers 5 keeps rope settings in `rope_parameters` (per layer type for Gemma 3), 4.x in
    rope_theta / rope_scaling / rope_local_base_freq / partial_rotary_factor."""
    params = cfg.get("rope_parameters") or {}
    local_theta = cfg.get("rope_local_base_freq")
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        local = params.get(SLIDING_ATTENTION) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {local['rope_type']!r} on {arch!r} sliding layers")
        local_theta = local.get("rope_theta", local_theta)
        params = params.get(FULL_ATTENTION) or {}
    params = dict(params)
    theta = params.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    partial = float(params.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0)
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = None if kind == "default" else kind
        if kind == "su":                                # the early name of Phi-3's longrope
            scaling["rope_type"] = "longrope"
        if scaling["rope_type"] == "longrope":
            scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
            scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
        if scaling["rope_type"] is None:
            scaling = None
        elif scaling["rope_type"] not in _ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {scaling['rope_type']!r} for {arch!r}; supported: "
                             f"{[t for t in _ROPE_TYPES if t]}")
    if not 0.0 < partial <= 1.0:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {partial}")
    return float(theta), scaling, (float(local_theta) if local_theta is not None else None), partial
