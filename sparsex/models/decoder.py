"""The RoPE decoder every supported family runs on (Llama 2/3, SmolLM2, Qwen2/3, Mistral, Phi-3/4,
Gemma 3 text, Granite, Qwen3-MoE, Mixtral): the Llama layer plus the switches of `ModelConfig`
(models/model_config.py lists which family sets which).

Flat batches: every tensor is `[num_tokens, ...]` with the tokens of all sequences of a step
concatenated; `AttentionMetadata` says which rows belong to which sequence.

Module names follow the Hugging Face checkpoints', so loading is by name; q/k/v and gate/up are
fused into one matmul each (Phi-3 checkpoints store them fused already). Norm weights are stored
effective: Gemma's (1 + w) is folded in at load time.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sparsex.layers.forward_context import ForwardContext
from sparsex.layers import cpu_kernels
from sparsex.layers.layernorm import RMSNorm
from sparsex.layers.packed_linear import PackedLinear, prepack_linears
from sparsex.layers.rotary_embedding import RotaryEmbedding
from sparsex.layers.tensor_parallel import TensorParallelGroup, VocabParallelEmbedding
from sparsex.models.model_config import ModelConfig
from sparsex.models.moe import SparseMoeBlock
from sparsex.models.weight_sharding import local_config


class Attention(nn.Module):
    """`cfg` is the rank's (weight_sharding.local_config): its heads only under tensor parallelism,
    whose o_proj partial sums `tp` all-reduces."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 tp: TensorParallelGroup | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attention_scale if cfg.attention_scale is not None else self.head_dim ** -0.5
        # only what differs from plain causal attention goes to the backend (None: the default path)
        self.extra: dict[str, float | int] = {}
        if cfg.layer_window(layer_idx) is not None:
            self.extra["sliding_window"] = cfg.layer_window(layer_idx)
        if cfg.attn_logit_softcapping is not None:
            self.extra["logits_soft_cap"] = float(cfg.attn_logit_softcapping)
        # q, k, v fused into one matmul (loaded from HF's separate q_proj/k_proj/v_proj)
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        # QK-norm (Qwen3, Gemma 3): RMSNorm over each head's dims, before RoPE. Cached keys are
        # post-norm, post-RoPE, so re-rotating one is still exact: the norm saw no position.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                select: Callable[[], torch.Tensor | None] | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (output rows, `keep`): `select`, when given, is called once this layer's K/V of
        every row are stored and may narrow the rows (sorted indices `keep`) whose attention and
        output are computed; the caller narrows its residual and positions the same way."""
        qkv = self.qkv_proj(hidden)                                      # [T, q_size + 2*kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))                # [T * H, D]
            k = self.k_norm(k.reshape(-1, self.head_dim))                # [T * KVH, D]
        q = q.view(-1, self.num_heads, self.head_dim)                    # [T, H, D]
        k = k.view(-1, self.num_kv_heads, self.head_dim)                 # [T, KVH, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        slot_mapping = ctx.attn_metadata.slot_mapping
        if ctx.probe is not None and self.layer_idx in ctx.probe_layers:
            # the probe reads the cached copies this layer's store overwrites
            q, k = self.rotary(positions, q, k)
            ctx.probe(self.layer_idx, q, k, v, k_cache, v_cache, ctx)
            ctx.backend.store_kv(k, v, k_cache, v_cache, slot_mapping)
        else:
            q, k = self.rotary.forward_and_store(positions, q, k, v, k_cache, v_cache, slot_mapping,
                                                 ctx.backend.store_kv)
        keep = select() if select is not None else None
        if keep is not None:
            # SparseX's selection layer: every row's K/V are fresh (the probe read them), but only
            # the kept rows go on, so the others' attention, o_proj and MLP here would be wasted
            q, k, v = q[keep], None, None                                # [kept, H, D]
        o = ctx.backend.attention(q, k_cache, v_cache, ctx.attn_metadata, self.scale, key=k, value=v,
                                  **self.extra)                          # [T, H, D]
        out = self.o_proj(o.reshape(-1, self.q_size))                    # [T, hidden] (a partial sum under TP)
        return (out if self.tp is None else self.tp.all_reduce(out)), keep


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.inter = cfg.intermediate_size
        self.act = cfg.hidden_act
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)                                   # [T, 2 * inter]
        if self.act == "gelu_pytorch_tanh":
            gate, up = gate_up.split(self.inter, dim=-1)                 # [T, inter] each
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if gate_up.is_cuda:
            from sparsex.layers.triton_fused import silu_and_mul
            return self.down_proj(silu_and_mul(gate_up))
        if cpu_kernels.supports(gate_up):
            return self.down_proj(cpu_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.inter, dim=-1)                     # [T, inter] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, rotary: RotaryEmbedding,
                 tp: TensorParallelGroup | None = None):
        super().__init__()
        self.tp = tp
        self.self_attn = Attention(cfg, layer_idx, rotary, tp)
        self.mlp = SparseMoeBlock(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Llama: post_attention_layernorm is the MLP's input norm (residual add fused in).
        # Gemma 3: it normalises the attention output; pre_feedforward_layernorm is the MLP's input
        # norm and post_feedforward_layernorm normalises the MLP output.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.residual_multiplier = cfg.residual_multiplier     # Granite; 1.0 elsewhere

    def forward(self, positions, hidden, residual, ctx: ForwardContext, select=None):
        """Returns (hidden, residual, keep); `keep` as `Attention.forward` returns it. `hidden` is the
        block's output not yet added to `residual` (the next norm adds it)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, keep = self.self_attn(positions, hidden, ctx, select)
        if keep is not None:
            residual = residual[keep]
        if self.sandwich:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self._mlp(hidden)), residual, keep
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self._mlp(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual, keep

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mlp(x)                               # a partial sum under TP (row-parallel down_proj)
        return out if self.tp is None else self.tp.all_reduce(out)


def _select_rows(layer_idx: int, ctx: ForwardContext) -> torch.Tensor | None:
    """Ask the row selector which rows go on from inside layer `layer_idx`; narrow the metadata."""
    selection = ctx.row_selector(layer_idx, ctx)
    if selection is None:
        return None
    keep, rows_per_seq = selection                                       # indices into current rows
    ctx.attn_metadata = ctx.attn_metadata.select_rows(keep, rows_per_seq)
    ctx.kept_rows = keep if ctx.kept_rows is None else ctx.kept_rows[keep]
    return keep


class DecoderForCausalLM(nn.Module):
    """`tp`: this rank of a tensor-parallel group (None or size 1: the whole model). `config` stays
    the full model's; the layers are built from the rank's share of it."""

    def __init__(self, cfg: ModelConfig, max_position: int, tp: TensorParallelGroup | None = None):
        super().__init__()
        self.config = cfg
        self.tp = tp if tp is not None and tp.size > 1 else None
        layer_cfg = cfg if self.tp is None else local_config(cfg, self.tp)
        # one RotaryEmbedding per distinct (base, scaling): Gemma 3's sliding layers use another base
        ropes: dict[tuple, RotaryEmbedding] = {}
        layer_rope: list[RotaryEmbedding] = []
        for i in range(cfg.num_hidden_layers):
            theta, scaling = cfg.layer_rope_theta(i), cfg.layer_rope_scaling(i)
            key = (theta, repr(scaling))
            if key not in ropes:
                ropes[key] = RotaryEmbedding(cfg.head_dim, theta, scaling, max_position, cfg.rotary_dim)
            layer_rope.append(ropes[key])
        self.rotaries = nn.ModuleList(ropes.values())
        if self.tp is None:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.tp)
        self.layers = nn.ModuleList(DecoderLayer(layer_cfg, i, layer_rope[i], self.tp)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        head_rows = self.embed_tokens.weight.shape[0]    # the vocabulary, or this rank's range of it
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, head_rows, bias=False)
        self.packed_lm_head: PackedLinear | None = None      # set by prepack_for_cpu()

    def build_rotary(self, device: torch.device) -> None:
        """(Re)compute every RoPE table, float32, on `device` (after the model was moved or cast)."""
        for rotary in self.rotaries:
            rotary.build(device)

    def layer_inv_freqs(self) -> list[torch.Tensor]:
        """Each layer's RoPE frequencies ([rotary_dim / 2] float32; layers sharing a base share the
        tensor): what re-rotating a reused key of that layer applies."""
        return [layer.self_attn.rotary.inv_freq for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Returns final-norm hidden states of the rows still kept at the last layer:
        all rows, or `ctx.kept_rows` when a row selector dropped some."""
        hidden = self.embed_tokens(input_ids)                            # [T, hidden]
        scale = self.config.embedding_multiplier
        if scale != 1.0:
            # as transformers does: Gemma rounds sqrt(hidden) to the model dtype first, Granite does not
            hidden = hidden * (torch.tensor(scale, dtype=hidden.dtype) if self.config.sandwich_norms else scale)
        residual = None
        for i, layer in enumerate(self.layers):
            hook = ctx.pre_layer_hooks.get(i)
            if hook is not None:
                hook()
            select = None
            if ctx.row_selector is not None and i in ctx.row_selector.layers:
                select = functools.partial(_select_rows, i, ctx)
            hidden, residual, keep = layer(positions, hidden, residual, ctx, select)
            if keep is not None:
                positions = positions[keep]
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            logits = self.packed_lm_head(hidden)                         # [rows, vocab]
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight)                            # [rows, vocab]
        if self.tp is not None:         # [rows, vocab range] per rank -> [rows, vocab]
            logits = self.tp.all_gather_last(logits)[:, :self.config.vocab_size]
        cfg = self.config
        if cfg.logits_scaling != 1.0:
            logits = logits / cfg.logits_scaling                         # Granite
        if cfg.final_logit_softcapping is not None:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def prepack_for_cpu(self) -> None:
        """CPU inference: every linear and the LM head in oneDNN's blocked layout (packed_linear.py).
        Call after the weights are loaded and cast; the model is frozen from then on."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.packed_lm_head = PackedLinear(head, None)
        self.lm_head = None                  # the packed copy replaces it (the embedding stays for lookups)
        prepack_linears(self.layers)

    @torch.no_grad()
    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up (unless the checkpoint stores them
        fused, as Phi-3 does) and folding a norm offset; checks names and shapes."""
        cfg = self.config
        own = dict(self.named_parameters())
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            used.add(name)
            return weights[name]

        def put(name: str, value: torch.Tensor) -> None:
            if own[name].shape != value.shape:
                raise ValueError(f"shape mismatch for {name}: model {tuple(own[name].shape)}, checkpoint {tuple(value.shape)}")
            own[name].copy_(value)

        def put_norm(name: str, value: torch.Tensor) -> None:
            put(name, value.float() + cfg.norm_weight_offset if cfg.norm_weight_offset else value)

        def fused(name: str, parts: list[str]) -> torch.Tensor:
            return take(name) if name in weights else torch.cat([take(x) for x in parts])

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put_norm("norm.weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put("lm_head.weight", take("lm_head.weight"))
        norms = ["input_layernorm", "post_attention_layernorm"]
        if cfg.sandwich_norms:
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a = f"layers.{i}.self_attn."
            put(a + "qkv_proj.weight", fused(p + "self_attn.qkv_proj.weight",
                                             [p + f"self_attn.{x}_proj.weight" for x in "qkv"]))
            if cfg.attention_bias:
                put(a + "qkv_proj.bias", torch.cat([take(p + f"self_attn.{x}_proj.bias") for x in "qkv"]))
            put(a + "o_proj.weight", take(p + "self_attn.o_proj.weight"))
            if cfg.qk_norm:
                put_norm(a + "q_norm.weight", take(p + "self_attn.q_norm.weight"))
                put_norm(a + "k_norm.weight", take(p + "self_attn.k_norm.weight"))
            if cfg.is_moe_layer(i):
                self.layers[i].mlp.load_hf_weights(take, p)
            else:
                put(f"layers.{i}.mlp.gate_up_proj.weight",
                    fused(p + "mlp.gate_up_proj.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]))
                put(f"layers.{i}.mlp.down_proj.weight", take(p + "mlp.down_proj.weight"))
            for norm in norms:
                put_norm(f"layers.{i}.{norm}.weight", take(p + f"{norm}.weight"))
        unused = set(weights) - used - {"lm_head.weight"}
        if unused:
            raise ValueError(f"checkpoint has tensors the model does not use: {sorted(unused)[:5]}")

    @torch.no_grad()
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The inverse of `load_hf_weights`, in transformers' in-memory names (experts stacked as
        `mlp.experts.gate_up_proj` / `down_proj`, Phi-3's projections fused): views of our tensors
        where the layout allows, copies only of offset norms. Lets a benchmark run transformers on
        our weights without a second copy of the model. Needs the plain weights (not prepacked)."""
        cfg = self.config
        if self.packed_lm_head is not None:
            raise ValueError("hf_state_dict needs the plain weights; this model was prepacked for the CPU")
        q, kv, inter = self.layers[0].self_attn.q_size, self.layers[0].self_attn.kv_size, cfg.intermediate_size
        fused = cfg.architecture == "phi3"

        def norm(w: torch.Tensor) -> torch.Tensor:
            return (w.float() - cfg.norm_weight_offset).to(w.dtype) if cfg.norm_weight_offset else w

        sd = {"model.embed_tokens.weight": self.embed_tokens.weight, "model.norm.weight": norm(self.norm.weight)}
        # a tied model's state dict names the shared tensor twice
        sd["lm_head.weight"] = self.embed_tokens.weight if cfg.tie_word_embeddings else self.lm_head.weight
        for i, layer in enumerate(self.layers):
            p, attn = f"model.layers.{i}.", layer.self_attn
            w = attn.qkv_proj.weight
            if fused:
                sd[p + "self_attn.qkv_proj.weight"] = w
            else:
                for name, rows in zip("qkv", (w[:q], w[q:q + kv], w[q + kv:])):
                    sd[p + f"self_attn.{name}_proj.weight"] = rows
            if cfg.attention_bias:
                b = attn.qkv_proj.bias
                for name, rows in zip("qkv", (b[:q], b[q:q + kv], b[q + kv:])):
                    sd[p + f"self_attn.{name}_proj.bias"] = rows
            sd[p + "self_attn.o_proj.weight"] = attn.o_proj.weight
            if attn.q_norm is not None:
                sd[p + "self_attn.q_norm.weight"] = norm(attn.q_norm.weight)
                sd[p + "self_attn.k_norm.weight"] = norm(attn.k_norm.weight)
            mlp = layer.mlp
            if isinstance(mlp, SparseMoeBlock):
                sd[p + "mlp.gate.weight"] = mlp.gate.weight
                sd[p + "mlp.experts.gate_up_proj"] = mlp.w_gate_up
                sd[p + "mlp.experts.down_proj"] = mlp.w_down
            elif fused:
                sd[p + "mlp.gate_up_proj.weight"] = mlp.gate_up_proj.weight
                sd[p + "mlp.down_proj.weight"] = mlp.down_proj.weight
            else:
                gu = mlp.gate_up_proj.weight
                sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = gu[:inter], gu[inter:]
                sd[p + "mlp.down_proj.weight"] = mlp.down_proj.weight
            norms = ["input_layernorm", "post_attention_layernorm"]
            if cfg.sandwich_norms:
                norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
            for name in norms:
                sd[p + f"{name}.weight"] = norm(getattr(layer, name).weight)
        return sd
