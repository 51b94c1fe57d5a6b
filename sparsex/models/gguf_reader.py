"""Convert a llama.cpp GGUF checkpoint into Hugging Face names, layout and config.

Families (GGUF `general.architecture` -> HF `model_type`), one row each of `_FAMILIES`:
  llama -> llama, qwen2 -> qwen2, qwen3 -> qwen3, qwen3moe -> qwen3_moe, gemma3 -> gemma3_text.
Mistral GGUFs say "llama" and convert as Llama (llama.cpp runs them as Llama too).

What differs between the two worlds:
  * tensor names (`blk.3.attn_q.weight` vs `model.layers.3.self_attn.q_proj.weight`), per family:
    llama.cpp's `ffn_norm` is Llama's `post_attention_layernorm` but Gemma 3's
    `pre_feedforward_layernorm` (Gemma's `post_attention_norm` is the post-attention one);
  * quantisation: every tensor is dequantised to float32 with `gguf.quants.dequantize`;
  * Llama only: llama.cpp's converter permutes the rows of q_proj/k_proj inside every head so
    that its interleaved ("GPT-J") RoPE sees rotation pairs (2i, 2i+1). HF's rotate_half RoPE
    pairs (i, i + head_dim/2), so the permutation must be undone. Qwen2/Qwen3/Qwen3-MoE and
    Gemma 3 use NeoX RoPE and are stored un-permuted (their converters do not derive from
    llama.cpp's LlamaModel, which is where the permutation lives);
  * Gemma 3: HF's RMSNorm computes x * (1 + w) and stores w; llama.cpp's converter stores 1 + w
    for every `*norm.weight` (its `norm_shift`), so 1 is subtracted back;
  * Qwen3-MoE: llama.cpp stacks the experts of a layer into one 3-D tensor per projection
    (`ffn_{gate,up,down}_exps`, [experts, out, in]); they are split into HF's per-expert
    `mlp.experts.E.{gate,up,down}_proj.weight` (the layout of the Hub checkpoints);
  * tied embeddings are expressed by the absence of `output.weight`;
  * hyper-parameters live in `<arch>.*` metadata keys, float32-typed; what llama.cpp hard-codes
    instead of storing (Gemma 3's sliding-window pattern, local RoPE base and query scale) is
    filled in with llama.cpp's own values.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ATTENTION = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_QK_NORM = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_DENSE_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LLAMA_NORMS = {"ffn_norm.weight": "post_attention_layernorm.weight"}
_GEMMA_NORMS = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_ROUTER = {"ffn_gate_inp.weight": "mlp.gate.weight"}
# Stacked experts: [n_experts, out, in] in numpy order; expert e is HF's `mlp.experts.{e}.<proj>`.
_STACKED_EXPERTS = {
    "ffn_gate_exps.weight": "gate_proj.weight",
    "ffn_up_exps.weight": "up_proj.weight",
    "ffn_down_exps.weight": "down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")

# Token texts llama.cpp treats as end-of-generation whatever the metadata says (llama-vocab.cpp's
# EOT/EOG scan); added to eos_token_id for the families converted here since this list existed.
_EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<|end_of_text|>", "<EOT>", "_<EOT>", "<end_of_utterance>")


@dataclass(frozen=True)
class _Family:
    model_type: str                      # HF config `model_type`
    hf_class: str                        # HF `architectures[0]`
    block_tensors: dict[str, str]        # `blk.N.<key>` -> `model.layers.N.<value>`
    permuted_qk: bool = False            # llama.cpp permuted q/k rows for its interleaved RoPE
    norm_shift: float = 0.0              # llama.cpp stored `w + norm_shift` for every *norm.weight
    qkv_bias: str = "never"              # "optional" | "required" | "never"
    eog_by_text: bool = False            # add llama.cpp's end-of-generation tokens found by text
    stacked_experts: bool = False
    activation: tuple[str, str] = ("hidden_act", "silu")   # (config key, value)
    extra_config: Callable[["_Metadata", str, dict[str, Any], dict[str, Any]], None] | None = None
    defaults: dict[str, Any] = field(default_factory=dict)


def _gemma3_config(meta: "_Metadata", arch: str, cfg: dict[str, Any], by_name: dict[str, Any]) -> None:
    """What llama.cpp's gemma3 loader hard-codes (llama-model.cpp, LLM_ARCH_GEMMA3); transformers'
    Gemma3TextConfig defaults agree where they exist (pattern 6, local base 10000, 256 = head_dim)."""
    layers = cfg["num_hidden_layers"]
    window = meta.get(f"{arch}.attention.sliding_window")
    if window:
        pattern = meta.get(f"{arch}.attention.sliding_window_pattern", 6)   # llama.cpp: set_swa_pattern(6)
        if isinstance(pattern, list):       # per layer, True = sliding (the Gemma 3n style)
            if len(pattern) != layers:
                raise ValueError(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries for {layers} layers")
            sliding = [bool(p) for p in pattern]
        else:                               # every `pattern`-th layer is global
            sliding = [(i + 1) % int(pattern) != 0 for i in range(layers)]
        cfg["sliding_window"] = int(window)
        cfg["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]
        cfg["rope_local_base_freq"] = 10000.0   # llama.cpp: rope_freq_base_train_swa = 10000
    else:
        cfg["sliding_window"] = None
        cfg["layer_types"] = ["full_attention"] * layers
    # llama.cpp: attention scale 1/sqrt(n_embd / n_head) for the 27B (62 layers), else 1/sqrt(head_dim);
    # HF spells it query_pre_attn_scalar (27B: 168, the others: 256).
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"] if layers == 62
                                    else cfg["head_dim"])
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        cap = meta.get(f"{arch}.{key}")
        cfg[key] = _shortest_float(cap) if cap else None


def _moe_config(meta: "_Metadata", arch: str, cfg: dict[str, Any], by_name: dict[str, Any]) -> None:
    cfg["num_experts"] = meta.require_int(f"{arch}.expert_count")
    cfg["num_experts_per_tok"] = meta.require_int(f"{arch}.expert_used_count")
    cfg["moe_intermediate_size"] = meta.require_int(f"{arch}.expert_feed_forward_length")
    # llama.cpp's qwen3moe graph always renormalises the top-k weights (transformers' GGUF loader
    # sets norm_topk_prob=True for the same reason); a file may also say so explicitly.
    cfg["norm_topk_prob"] = bool(meta.get(f"{arch}.expert_weights_norm", True))
    cfg["decoder_sparse_step"] = 1
    cfg["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" not in by_name]


GGUF_FAMILIES: dict[str, _Family] = {
    "llama": _Family("llama", "LlamaForCausalLM", {**_ATTENTION, **_LLAMA_NORMS, **_DENSE_MLP},
                     permuted_qk=True, qkv_bias="optional", defaults={"mlp_bias": False}),
    "qwen2": _Family("qwen2", "Qwen2ForCausalLM", {**_ATTENTION, **_LLAMA_NORMS, **_DENSE_MLP}, qkv_bias="required"),
    "qwen3": _Family("qwen3", "Qwen3ForCausalLM", {**_ATTENTION, **_QK_NORM, **_LLAMA_NORMS, **_DENSE_MLP},
                     eog_by_text=True),
    "qwen3moe": _Family("qwen3_moe", "Qwen3MoeForCausalLM",
                        {**_ATTENTION, **_QK_NORM, **_LLAMA_NORMS, **_ROUTER, **_DENSE_MLP},
                        eog_by_text=True, stacked_experts=True, extra_config=_moe_config),
    "gemma3": _Family("gemma3_text", "Gemma3ForCausalLM", {**_ATTENTION, **_QK_NORM, **_GEMMA_NORMS, **_DENSE_MLP},
                      norm_shift=1.0, eog_by_text=True, activation=("hidden_activation", "gelu_pytorch_tanh"),
                      extra_config=_gemma3_config),
}
# GGUF architecture -> HF class (kept for callers of the original two-family table).
GGUF_ARCHITECTURES = {arch: fam.hf_class for arch, fam in GGUF_FAMILIES.items()}


@dataclass
class GGUFCheckpoint:
    hf_config: dict[str, Any]          # transformers config.json content (model_type, sizes, ...)
    tensors: dict[str, torch.Tensor]   # HF parameter name -> float32 CPU tensor
    chat_template: str | None          # `tokenizer.chat_template` metadata, if any


def _family(arch: str, path: str = "") -> _Family:
    if arch not in GGUF_FAMILIES:
        where = f"GGUF {path}: " if path else ""
        raise ValueError(f"{where}unsupported architecture {arch!r}; supported: {sorted(GGUF_FAMILIES)}")
    return GGUF_FAMILIES[arch]


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str:
    """llama.cpp tensor name -> HF parameter name for GGUF architecture `arch`; ValueError for
    tensors we do not model (stacked expert tensors: see `hf_expert_names`)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    table = _family(arch).block_tensors
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} for architecture {arch!r}")


def hf_expert_names(gguf_name: str, n_experts: int) -> list[str] | None:
    """HF names of the experts stacked in `blk.N.ffn_{gate,up,down}_exps.weight`, in stacking
    order; None for any other tensor."""
    m = _BLOCK_RE.match(gguf_name)
    if not m or m.group(2) not in _STACKED_EXPERTS:
        return None
    return [f"model.layers.{m.group(1)}.mlp.experts.{e}.{_STACKED_EXPERTS[m.group(2)]}" for e in range(n_experts)]


def undo_rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k row permutation. w: [n_heads * head_dim, ...] (weight or bias).

    llama.cpp row b*2 + a (b < head_dim/2, a in {0, 1}) holds HF row a*head_dim/2 + b of the same head.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads) != 0:
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even head_dim")
    rest = tuple(w.shape[1:])
    # [n_heads, head_dim/2 (b), 2 (a), ...] -> [n_heads, 2 (a), head_dim/2 (b), ...]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()


def _shortest_float(x: float) -> float:
    """GGUF stores hyper-parameters as float32 (1e-5 reads back as 9.99999974e-06); recover the
    decimal the model author wrote, so configs compare equal to the original HF ones."""
    return float(str(np.float32(x)))


class _Metadata:
    """Typed access to the key/value section of a GGUFReader."""

    def __init__(self, reader: Any, path: str):
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require_int(self, key: str) -> int:
        value = self.get(key)
        if not isinstance(value, int):
            # Per-layer arrays (e.g. varying head counts) are not a layout we convert.
            raise ValueError(f"GGUF {self._path}: metadata {key!r} must be an integer, got {value!r}")
        return value


def _hf_config(meta: _Metadata, arch: str, by_name: dict[str, Any], path: str) -> dict[str, Any]:
    fam = GGUF_FAMILIES[arch]
    hidden = meta.require_int(f"{arch}.embedding_length")
    heads = meta.require_int(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // heads
    has_bias = "blk.0.attn_q.bias" in by_name
    if fam.qkv_bias == "required" and not has_bias:
        raise ValueError(f"GGUF {path}: {arch} checkpoint without q/k/v biases is not a {fam.hf_class} layout")
    if fam.qkv_bias == "never" and has_bias:
        raise ValueError(f"GGUF {path}: {arch} checkpoint with q/k/v biases is not a {fam.hf_class} layout")
    ffn = meta.get(f"{arch}.feed_forward_length")
    if ffn is None and fam.stacked_experts:
        ffn = meta.get(f"{arch}.expert_feed_forward_length")
    if not isinstance(ffn, int):
        raise ValueError(f"GGUF {path}: metadata {arch + '.feed_forward_length'!r} must be an integer, got {ffn!r}")
    act_key, act = fam.activation
    cfg: dict[str, Any] = {
        "architectures": [fam.hf_class],
        "model_type": fam.model_type,
        "vocab_size": int(by_name["token_embd.weight"].shape[1]),   # GGUF shape: [hidden, vocab]
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": meta.require_int(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        act_key: act,
        "rms_norm_eps": _shortest_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _shortest_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.get(f"{arch}.context_length", 4096),
        "tie_word_embeddings": "output.weight" not in by_name,
    }
    if fam.qkv_bias != "required":          # Qwen2's config has no such key: its biases always exist
        cfg["attention_bias"] = has_bias
    cfg.update(fam.defaults)
    scaling = _rope_scaling(meta, arch)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    if fam.extra_config is not None:
        fam.extra_config(meta, arch, cfg, by_name)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = bos
    # End-of-turn may be a separate token from end-of-text; generation must stop on either.
    eos_ids = [i for i in (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")) if i is not None]
    if fam.eog_by_text:
        eos_ids += _eog_ids_by_text(meta)
    eos_ids = list(dict.fromkeys(eos_ids))
    if eos_ids:
        cfg["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        cfg["pad_token_id"] = pad
    return cfg


def _eog_ids_by_text(meta: _Metadata) -> list[int]:
    """Ids of the tokens llama.cpp stops on by their text (e.g. Gemma's <end_of_turn>, which no
    metadata key names), in vocabulary order."""
    wanted = set(_EOG_TEXTS)
    return [i for i, text in enumerate(meta.get("tokenizer.ggml.tokens") or ()) if text in wanted]


def _rope_scaling(meta: _Metadata, arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("none", None):
        return None
    factor = _shortest_float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length"),
        }
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


def _dequantize(tensor: Any) -> torch.Tensor:
    import gguf

    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dims fastest-first; numpy/torch want them slowest-first.
    arr = arr.reshape(tuple(reversed([int(d) for d in tensor.shape])))
    if arr.dtype != np.float32 or not arr.flags.writeable:
        arr = arr.astype(np.float32, copy=True)  # F32 tensors are read-only views of the mmap
    return torch.from_numpy(arr)


def read_gguf(path: str) -> GGUFCheckpoint:
    """Dequantise every tensor of a GGUF of a supported family into HF-named float32 tensors + HF config."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    fam = _family(arch, path)
    by_name = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in by_name:
        # Llama-3.1-style scaling is stored as per-frequency factors, not as the rope_scaling
        # parameters HF needs; silently dropping it would corrupt long-context attention.
        raise ValueError(f"GGUF {path}: per-frequency RoPE factors (rope_freqs.weight) are not supported")
    if "token_embd.weight" not in by_name:
        raise ValueError(f"GGUF {path}: no token_embd.weight tensor")
    cfg = _hf_config(meta, arch, by_name, path)

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in by_name.items():
        experts = hf_expert_names(name, cfg.get("num_experts", 0)) if fam.stacked_experts else None
        if experts is not None:
            value = _dequantize(tensor)
            if value.shape[0] != len(experts):
                raise ValueError(f"GGUF {path}: {name} stacks {value.shape[0]} experts, metadata says {len(experts)}")
            for hf_name, expert in zip(experts, value):
                tensors[hf_name] = expert.clone()   # own storage: safetensors refuses shared views
            continue
        hf_name = hf_tensor_name(name, arch)
        value = _dequantize(tensor)
        if fam.permuted_qk and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = cfg["num_attention_heads"] if ".q_proj." in hf_name else cfg["num_key_value_heads"]
            value = undo_rope_permute(value, heads)
        if fam.norm_shift and hf_name.endswith("norm.weight"):
            value -= fam.norm_shift
        tensors[hf_name] = value
    return GGUFCheckpoint(hf_config=cfg, tensors=tensors, chat_template=meta.get("tokenizer.chat_template"))
