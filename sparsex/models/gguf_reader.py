"""Convert a llama.cpp GGUF checkpoint (Llama / Qwen2) into Hugging Face names, layout and config.

What differs between the two worlds:
  * tensor names (`blk.3.attn_q.weight` vs `model.layers.3.self_attn.q_proj.weight`);
  * quantisation: every tensor is dequantised to float32 with `gguf.quants.dequantize`;
  * Llama only: llama.cpp's converter permutes the rows of q_proj/k_proj inside every head so
    that its interleaved ("GPT-J") RoPE sees rotation pairs (2i, 2i+1). HF's rotate_half RoPE
    pairs (i, i + head_dim/2), so the permutation must be undone. Qwen2 GGUFs use NeoX RoPE and
    are stored un-permuted;
  * tied embeddings are expressed by the absence of `output.weight`;
  * hyper-parameters live in `<arch>.*` metadata keys, float32-typed.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass
class GGUFCheckpoint:
    hf_config: dict[str, Any]          # transformers config.json content (model_type, sizes, ...)
    tensors: dict[str, torch.Tensor]   # HF parameter name -> float32 CPU tensor
    chat_template: str | None          # `tokenizer.chat_template` metadata, if any


def hf_tensor_name(gguf_name: str) -> str:
    """llama.cpp tensor name -> HF parameter name; ValueError for tensors we do not model."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_TENSORS:
        return f"model.layers.{m.group(1)}.{_BLOCK_TENSORS[m.group(2)]}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r} (only Llama/Qwen2 decoder tensors are mapped)")


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
            # Per-layer arrays (e.g. varying head counts) are not a Llama/Qwen2 layout.
            raise ValueError(f"GGUF {self._path}: metadata {key!r} must be an integer, got {value!r}")
        return value


def _hf_config(meta: _Metadata, arch: str, vocab_size: int, tied: bool, has_qkv_bias: bool, path: str) -> dict[str, Any]:
    hidden = meta.require_int(f"{arch}.embedding_length")
    heads = meta.require_int(f"{arch}.attention.head_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = meta.get(f"{arch}.attention.key_length") or hidden // heads
    cfg: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta.require_int(f"{arch}.feed_forward_length"),
        "num_hidden_layers": meta.require_int(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _shortest_float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _shortest_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.get(f"{arch}.context_length", 4096),
        "tie_word_embeddings": tied,
    }
    if arch == "llama":
        cfg["attention_bias"] = has_qkv_bias
        cfg["mlp_bias"] = False
    elif not has_qkv_bias:
        raise ValueError(f"GGUF {path}: qwen2 checkpoint without q/k/v biases is not a Qwen2 layout")
    scaling = _rope_scaling(meta, arch)
    if scaling is not None:
        cfg["rope_scaling"] = scaling
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        cfg["bos_token_id"] = bos
    # End-of-turn may be a separate token from end-of-text; generation must stop on either.
    eos_ids = [i for i in (meta.get("tokenizer.ggml.eos_token_id"), meta.get("tokenizer.ggml.eot_token_id")) if i is not None]
    eos_ids = list(dict.fromkeys(eos_ids))
    if eos_ids:
        cfg["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    pad = meta.get("tokenizer.ggml.padding_token_id")
    if pad is not None:
        cfg["pad_token_id"] = pad
    return cfg


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
    """Dequantise every tensor of a Llama/Qwen2 GGUF into HF-named float32 tensors + HF config."""
    import gguf

    reader = gguf.GGUFReader(path)
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF {path}: unsupported architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}")
    by_name = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in by_name:
        # Llama-3.1-style scaling is stored as per-frequency factors, not as the rope_scaling
        # parameters HF needs; silently dropping it would corrupt long-context attention.
        raise ValueError(f"GGUF {path}: per-frequency RoPE factors (rope_freqs.weight) are not supported")
    if "token_embd.weight" not in by_name:
        raise ValueError(f"GGUF {path}: no token_embd.weight tensor")
    vocab_size = int(by_name["token_embd.weight"].shape[1])   # GGUF shape: [hidden, vocab]
    has_bias = "blk.0.attn_q.bias" in by_name
    cfg = _hf_config(meta, arch, vocab_size, "output.weight" not in by_name, has_bias, path)

    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in by_name.items():
        hf_name = hf_tensor_name(name)
        value = _dequantize(tensor)
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = cfg["num_attention_heads"] if ".q_proj." in hf_name else cfg["num_key_value_heads"]
            value = undo_rope_permute(value, heads)
        tensors[hf_name] = value
    return GGUFCheckpoint(hf_config=cfg, tensors=tensors, chat_template=meta.get("tokenizer.chat_template"))
