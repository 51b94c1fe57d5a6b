"""Routed-experts MLP of the mixture-of-experts families (Qwen3-MoE, Mixtral).

On a MoE layer the decoder calls `SparseMoeBlock` where a dense layer calls the MLP: a router
(`gate`, Linear hidden -> num_experts) scores every token, the top-k experts of each token run a
SwiGLU MLP on it, and their outputs are summed, weighted by the routing probabilities. Routing
reproduces transformers 5 (Qwen3MoeTopKRouter, MixtralTopKRouter) step for step:

  logits  = gate(x)                                   in the model dtype
  probs   = softmax(logits in float32)
  w, e    = topk(probs, k)                            on the float32 probabilities, sorted, largest first
  w       = w / w.sum()                               Mixtral always, Qwen3-MoE iff norm_topk_prob
  qwen3_moe: w cast back to the model dtype (the router does `.to(router_logits.dtype)`);
  mixtral:   w stays float32 (its router returns it uncast), so in bf16 the weighted expert outputs
             and their sum are float32 and rounded once at the end.
  out[t]  = sum over the k slots, in slot order, of w[t, j] * down_e(act(gate_e(x)) * up_e(x))

The weighting and the per-token sum follow transformers' default experts implementation
("grouped_mm", which `from_pretrained` picks): weighted rows in the product's dtype, summed over
the k slots with `sum(dim=1)`, cast to the model dtype. (Its "eager" loop index_adds in the model
dtype instead; in float32 and for Qwen3-MoE with k=2 that is the same result.)

Compute: the T*k (token, expert) assignments are sorted by expert id (stable), so each expert's rows
are one contiguous run; each expert that received tokens does one [n, hidden] x [hidden, 2*inter]
and one [n, inter] x [inter, hidden] matmul (no loop over tokens), and the weighted rows are put
back in (token, slot) order and summed per token. On CPU the loop over the experts that received
tokens reads the per-expert counts on the host. On CUDA in bfloat16 (where `grouped_mm` exists,
SM80+, dims multiples of 8) the same grouped computation runs as two `grouped_mm` calls over all
experts with device-side offsets: no host sync; otherwise CUDA takes the loop, with one sync for
the counts.

Checkpoint layouts (what `moe_param_shapes` / `load_hf_weights` speak, checked against tiny models
saved by transformers 5.25's save_pretrained, which converts its fused in-memory weights back to
the original per-expert names by default):

  PER_EXPERT, qwen3_moe  mlp.gate.weight [E, H]; mlp.experts.{e}.{gate,up}_proj.weight [I, H],
                         mlp.experts.{e}.down_proj.weight [H, I]        (Qwen3-30B-A3B on the Hub)
  PER_EXPERT, mixtral    block_sparse_moe.gate.weight [E, H]; block_sparse_moe.experts.{e}.w1 (gate) /
                         w3 (up) .weight [I, H], w2 (down) .weight [H, I]  (Mixtral-8x7B on the Hub)
  FUSED, both families   mlp.gate.weight [E, H]; mlp.experts.gate_up_proj [E, 2I, H] (gate rows
                         first); mlp.experts.down_proj [E, H, I] (no ".weight"): transformers 5's
                         in-memory layout, written by save_pretrained(save_original_format=False)
                         and when the model was offloaded.

`detect_moe_layout(names)` tells the two apart from a checkpoint's tensor names;
`load_hf_weights` detects it by itself when not told.
"""
from __future__ import annotations

import functools
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sparsex.models.model_config import MOE_ARCHITECTURES, ModelConfig

PER_EXPERT = "per_expert"      # one tensor per expert and projection (the Hub checkpoints)
FUSED = "fused"                # transformers 5's stacked in-memory tensors
MOE_LAYOUTS = (PER_EXPERT, FUSED)

# family -> (module name in the checkpoint, per-expert names of (gate, up, down))
_PER_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}
_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _check_moe(cfg: ModelConfig) -> None:
    if cfg.architecture not in MOE_ARCHITECTURES or cfg.num_experts < 1 or cfg.num_experts_per_tok < 1:
        raise ValueError(f"{cfg.architecture!r} with num_experts={cfg.num_experts}, "
                         f"num_experts_per_tok={cfg.num_experts_per_tok} is not a mixture-of-experts config")


def detect_moe_layout(names: Iterable[str]) -> str:
    """FUSED if the checkpoint's tensor names hold transformers 5's stacked expert tensors
    (`...mlp.experts.gate_up_proj`), else PER_EXPERT."""
    return FUSED if any(n.endswith("." + _FUSED_GATE_UP) for n in names) else PER_EXPERT


def moe_param_shapes(cfg: ModelConfig, prefix: str, layout: str = PER_EXPERT) -> dict[str, tuple[int, ...]]:
    """HF checkpoint name -> shape of the MoE MLP of the layer under `prefix` (e.g. 'model.layers.3.'):
    router first, then experts 0..E-1 (gate, up, down each), or the two stacked tensors for FUSED.
    PER_EXPERT is what save_pretrained writes and what the Hub checkpoints hold; a loader that
    validates a checkpoint passes `layout=detect_moe_layout(checkpoint names)`."""
    _check_moe(cfg)
    h, inter, experts = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    if layout == FUSED:
        return {prefix + "mlp.gate.weight": (experts, h),
                prefix + _FUSED_GATE_UP: (experts, 2 * inter, h),
                prefix + _FUSED_DOWN: (experts, h, inter)}
    if layout != PER_EXPERT:
        raise ValueError(f"unknown MoE checkpoint layout {layout!r}; expected one of {MOE_LAYOUTS}")
    module, (gate, up, down) = _PER_EXPERT_NAMES[cfg.architecture]
    shapes: dict[str, tuple[int, ...]] = {f"{prefix}{module}.gate.weight": (experts, h)}
    for e in range(experts):
        p = f"{prefix}{module}.experts.{e}."
        shapes[p + f"{gate}.weight"] = (inter, h)
        shapes[p + f"{up}.weight"] = (inter, h)
        shapes[p + f"{down}.weight"] = (h, inter)
    return shapes


@functools.cache
def _cuda_grouped_mm_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


class SparseMoeBlock(nn.Module):
    """x [num_tokens, hidden] -> [num_tokens, hidden]; parameters `gate` (router), `w_gate_up`
    [E, 2 * inter, hidden] (gate rows first, then up) and `w_down` [E, hidden, inter]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        _check_moe(cfg)
        self.architecture = cfg.architecture
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds num_experts={self.num_experts}")
        self.hidden = cfg.hidden_size
        self.inter = cfg.moe_intermediate_size
        self.act = cfg.hidden_act
        self.norm_topk_prob = cfg.norm_topk_prob or cfg.architecture == "mixtral"
        # Qwen3-MoE's router casts the top-k weights to the model dtype; Mixtral's keeps float32
        self.weights_in_model_dtype = cfg.architecture == "qwen3_moe"
        self.gate = nn.Linear(self.hidden, self.num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(self.num_experts, 2 * self.inter, self.hidden))
        self.w_down = nn.Parameter(torch.empty(self.num_experts, self.hidden, self.inter))

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden}, inter={self.inter}, "
                f"norm_topk_prob={self.norm_topk_prob}")

    # ---------------------------------------------------------------- routing
    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k] int64), slots largest probability first; weights in
        the model dtype for Qwen3-MoE, float32 for Mixtral (as transformers)."""
        logits = self.gate(x)                                            # [T, E], model dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)        # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, experts

    # ---------------------------------------------------------------- experts
    def _act_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2 * inter] (gate first) -> act(gate) * up: [n, inter]. Plain torch ops on every device
        (the rows per expert are few; the fused kernels of the dense MLP would save little here)."""
        gate, up = gate_up.split(self.inter, dim=-1)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return gate * up

    def _use_grouped_mm(self, x: torch.Tensor) -> bool:
        return self.graph_capturable(x.device, x.dtype)

    def graph_capturable(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this block runs the grouped-GEMM path on `device`/`dtype`, the only one a CUDA graph
        can hold: it keeps the expert offsets on the device (the per-expert loop reads counts on the host)."""
        return (device.type == "cuda" and dtype == torch.bfloat16 and _grouped_mm is not None
                and self.hidden % 8 == 0 and self.inter % 8 == 0      # 16-byte aligned strides
                and _cuda_grouped_mm_capable(device.index if device.index is not None else torch.cuda.current_device()))

    def _experts_loop(self, x: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert outputs of the sorted assignments [S, hidden]: one pair of matmuls per expert that
        received tokens. Reads `counts` on the host (a sync on CUDA)."""
        out = x.new_empty(tokens.shape[0], self.hidden)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            end = start + n
            rows = x.index_select(0, tokens[start:end])                 # [n, hidden]
            h = self._act_and_mul(F.linear(rows, self.w_gate_up[e]))    # [n, inter]
            out[start:end] = F.linear(h, self.w_down[e])                # [n, hidden]
            start = end
        return out

    def _experts_grouped_mm(self, x: torch.Tensor, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same as `_experts_loop` with two grouped GEMMs over all experts (offsets stay on the
        device: no host sync). Used on CUDA in bfloat16; its CPU semantics are tested."""
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)        # [E] end row of each expert
        rows = x.index_select(0, tokens)                                 # [S, hidden]
        h = _grouped_mm(rows, self.w_gate_up.transpose(1, 2), offs=offsets)       # [S, 2 * inter]
        return _grouped_mm(self._act_and_mul(h), self.w_down.transpose(1, 2), offs=offsets)  # [S, hidden]

    def forward(self, x: torch.Tensor, grouped_mm: bool | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. `grouped_mm` forces the expert path (None: grouped GEMMs
        on CUDA bf16 where available, else the per-expert loop)."""
        num_tokens = x.shape[0]
        if num_tokens == 0:
            return x.new_zeros(x.shape)
        weights, experts = self.route(x)                                 # [T, k] each
        flat = experts.reshape(-1)                                       # [S = T*k], (token, slot) order
        _, order = torch.sort(flat, stable=True)                         # assignments grouped by expert
        tokens = order // self.top_k                                     # token of each sorted assignment
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))              # [E] tokens per expert
        if grouped_mm is None:
            grouped_mm = self._use_grouped_mm(x)
        if grouped_mm:
            y = self._experts_grouped_mm(x, tokens, counts)
        else:
            y = self._experts_loop(x, tokens, counts)                    # [S, hidden], sorted order
        y = y * weights.reshape(-1)[order].unsqueeze(-1)                 # float32 for Mixtral's weights
        out = torch.empty_like(y).index_copy_(0, order, y)               # back to (token, slot) order
        return out.view(num_tokens, self.top_k, self.hidden).sum(dim=1).to(x.dtype)

    # ---------------------------------------------------------------- loading
    @torch.no_grad()
    def load_hf_weights(self, take: Callable[[str], torch.Tensor], prefix: str,
                        layout: str | None = None) -> None:
        """Load this layer's MoE MLP from HF-named tensors. `prefix` e.g. 'model.layers.3.';
        `take(name)` returns a checkpoint tensor and marks it used, raising ValueError when it is
        missing. `layout` (PER_EXPERT / FUSED, see `detect_moe_layout`): None probes for the fused
        tensor first and falls back to the per-expert names, so a missing expert tensor raises
        naming the per-expert tensor."""
        if layout is None:
            try:
                gate_up = take(prefix + _FUSED_GATE_UP)
            except (ValueError, KeyError):
                layout = PER_EXPERT
            else:
                layout = FUSED
                self._put(self.w_gate_up, gate_up, prefix + _FUSED_GATE_UP)
        elif layout == FUSED:
            self._put(self.w_gate_up, take(prefix + _FUSED_GATE_UP), prefix + _FUSED_GATE_UP)
        elif layout != PER_EXPERT:
            raise ValueError(f"unknown MoE checkpoint layout {layout!r}; expected one of {MOE_LAYOUTS}")

        if layout == FUSED:
            self._put(self.w_down, take(prefix + _FUSED_DOWN), prefix + _FUSED_DOWN)
            self._put(self.gate.weight, take(prefix + "mlp.gate.weight"), prefix + "mlp.gate.weight")
            return
        module, (gate, up, down) = _PER_EXPERT_NAMES[self.architecture]
        name = f"{prefix}{module}.gate.weight"
        self._put(self.gate.weight, take(name), name)
        for e in range(self.num_experts):
            p = f"{prefix}{module}.experts.{e}."
            for dst, proj in ((self.w_gate_up[e, :self.inter], gate), (self.w_gate_up[e, self.inter:], up),
                              (self.w_down[e], down)):
                name = f"{p}{proj}.weight"
                self._put(dst, take(name), name)

    @staticmethod
    def _put(dst: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if tuple(dst.shape) != tuple(value.shape):
            raise ValueError(f"shape mismatch for {name}: model {tuple(dst.shape)}, checkpoint {tuple(value.shape)}")
        dst.copy_(value)
