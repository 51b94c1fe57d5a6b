"""sparsex.models.moe against transformers 5's Qwen3-MoE and Mixtral sparse-MoE blocks.

Tiny random models (hidden 64, 8 experts, top-2, expert width 32, 2 layers) are saved with
save_pretrained, in the default per-expert layout and in the fused one
(save_original_format=False); our block loads layer 1 from those safetensors and is compared with
the transformers block of that layer on random inputs. No real model is loaded.
"""
from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from sparsex.models import moe
from sparsex.models.model_config import ModelConfig
from sparsex.models.moe import FUSED, PER_EXPERT, SparseMoeBlock, detect_moe_layout, moe_param_shapes

pytestmark = pytest.mark.unit

HIDDEN, EXPERTS, TOP_K, INTER = 64, 8, 2, 32
PREFIX = "model.layers.1."
_COMMON = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, num_experts_per_tok=TOP_K)
FAMILIES = {
    "qwen3_moe-norm": lambda: (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **_COMMON, num_experts=EXPERTS, moe_intermediate_size=INTER, intermediate_size=96, head_dim=16,
        norm_topk_prob=True)),
    "qwen3_moe-nonorm": lambda: (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **_COMMON, num_experts=EXPERTS, moe_intermediate_size=INTER, intermediate_size=96, head_dim=16,
        norm_topk_prob=False)),
    "mixtral": lambda: (MixtralForCausalLM, MixtralConfig(**_COMMON, num_local_experts=EXPERTS,
                                                          intermediate_size=INTER)),
}
# one expert tensor of each layout, per family, and its shape
_EXPERT5_UP = {"qwen3_moe": "mlp.experts.5.up_proj.weight", "mixtral": "block_sparse_moe.experts.5.w3.weight"}


def _mlp_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Layer 1's MoE MLP tensors of a saved checkpoint."""
    return {k: v for k, v in state.items()
            if k.startswith(PREFIX) and (".mlp." in k or ".block_sparse_moe." in k)}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    cls, hf_cfg = FAMILIES[request.param]()
    torch.manual_seed(0)
    model = cls(hf_cfg).eval()
    with torch.no_grad():        # O(1) outputs, varied routing (the default init is std 0.02)
        for name, p in model.named_parameters():
            if ".mlp." in name:
                p.normal_(std=0.15)
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "per_expert")
    model.save_pretrained(root / "fused", save_original_format=False)
    return SimpleNamespace(
        name=request.param, model=model, hf_block=model.model.layers[1].mlp,
        cfg=ModelConfig.from_hf_config(model.config.to_dict()),
        state={PER_EXPERT: load_file(root / "per_expert" / "model.safetensors"),
               FUSED: load_file(root / "fused" / "model.safetensors")})


def _taker(tensors: dict[str, torch.Tensor]):
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        used.add(name)
        return tensors[name]
    return take, used


def _ours(fam, layout: str = PER_EXPERT, dtype: torch.dtype = torch.float32) -> SparseMoeBlock:
    block = SparseMoeBlock(fam.cfg)
    block.load_hf_weights(_taker(fam.state[layout])[0], PREFIX)
    return block.to(dtype)


def _reference(fam, x: torch.Tensor, impl: str = "grouped_mm") -> torch.Tensor:
    """transformers' block in x's dtype (a copy, so the float32 one keeps its weights); `impl` its
    experts implementation ("grouped_mm" is from_pretrained's default)."""
    block = fam.hf_block if x.dtype == torch.float32 else copy.deepcopy(fam.hf_block).to(x.dtype)
    block.experts.config._experts_implementation = impl
    with torch.no_grad():
        return block(x[None])[0]


def test_config_fields(family):
    cfg = family.cfg
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (EXPERTS, TOP_K, INTER)
    assert cfg.norm_topk_prob is (family.name != "qwen3_moe-nonorm")
    assert cfg.moe_layers == (True, True)


@pytest.mark.parametrize("layout", [PER_EXPERT, FUSED])
def test_param_shapes_are_the_saved_tensors(family, layout):
    """moe_param_shapes lists exactly layer 1's MLP tensors of the saved checkpoint, both layouts,
    and detect_moe_layout tells the layouts apart."""
    saved = _mlp_tensors(family.state[layout])
    assert moe_param_shapes(family.cfg, PREFIX, layout) == {k: tuple(v.shape) for k, v in saved.items()}
    assert detect_moe_layout(family.state[layout]) == layout
    if layout == PER_EXPERT:         # the Hub checkpoints' names (Qwen3-30B-A3B, Mixtral-8x7B)
        assert PREFIX + _EXPERT5_UP[family.cfg.architecture] in saved
    else:
        assert PREFIX + "mlp.experts.gate_up_proj" in saved


@pytest.mark.parametrize("layout", [PER_EXPERT, FUSED])
@pytest.mark.parametrize("explicit", [False, True])
def test_load_takes_exactly_the_layer_tensors(family, layout, explicit):
    take, used = _taker(family.state[layout])
    block = SparseMoeBlock(family.cfg)
    block.load_hf_weights(take, PREFIX, layout if explicit else None)
    assert used == set(moe_param_shapes(family.cfg, PREFIX, layout))
    hf = family.hf_block
    torch.testing.assert_close(block.gate.weight, hf.gate.weight, rtol=0, atol=0)
    torch.testing.assert_close(block.w_gate_up, hf.experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(block.w_down, hf.experts.down_proj, rtol=0, atol=0)


@pytest.mark.parametrize("num_tokens", [1, 3, 300])
@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_matches_transformers_fp32(family, num_tokens, impl):
    """T=1 and T=3 (6 assignments for 8 experts) leave experts without tokens; 300 reach them all."""
    torch.manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN)
    ref = _reference(family, x, impl)
    block = _ours(family, FUSED if num_tokens == 3 else PER_EXPERT)
    _, experts = block.route(x)
    hit = experts.unique().numel()
    assert hit < EXPERTS if num_tokens < 4 else hit == EXPERTS
    for grouped in ([False, True] if moe._grouped_mm is not None else [False]):
        out = block(x, grouped_mm=grouped)
        assert out.shape == x.shape and out.dtype == torch.float32
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_matches_transformers_bf16(family):
    torch.manual_seed(1)
    x = torch.randn(300, HIDDEN).to(torch.bfloat16)
    block = _ours(family, dtype=torch.bfloat16)
    weights, _ = block.route(x)
    # Qwen3-MoE's router casts the top-k weights to the model dtype, Mixtral's keeps float32
    assert weights.dtype == (torch.float32 if family.cfg.architecture == "mixtral" else torch.bfloat16)
    out = block(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, _reference(family, x), atol=1e-2, rtol=1.6e-2)


@pytest.mark.skipif(moe._grouped_mm is None, reason="this torch has no grouped_mm")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_path_matches_loop(family, dtype):
    """The CUDA bf16 path (two grouped GEMMs, device-side offsets), run on CPU."""
    torch.manual_seed(2)
    x = torch.randn(37, HIDDEN).to(dtype)
    block = _ours(family, dtype=dtype)
    loop, grouped = block(x, grouped_mm=False), block(x, grouped_mm=True)
    if dtype == torch.float32:
        torch.testing.assert_close(grouped, loop, atol=1e-6, rtol=0)
    else:
        torch.testing.assert_close(grouped, loop, atol=1e-2, rtol=1.6e-2)


def test_missing_expert_tensor_raises(family):
    name = PREFIX + _EXPERT5_UP[family.cfg.architecture]
    state = dict(family.state[PER_EXPERT])
    del state[name]
    with pytest.raises(ValueError, match=re.escape(name)):
        SparseMoeBlock(family.cfg).load_hf_weights(_taker(state)[0], PREFIX)
    state = dict(family.state[FUSED])
    del state[PREFIX + "mlp.experts.down_proj"]
    with pytest.raises(ValueError, match=re.escape(PREFIX + "mlp.experts.down_proj")):
        SparseMoeBlock(family.cfg).load_hf_weights(_taker(state)[0], PREFIX)


def test_shape_mismatch_raises(family):
    state = dict(family.state[FUSED])
    name = PREFIX + "mlp.experts.down_proj"
    state[name] = state[name].transpose(1, 2).contiguous()
    with pytest.raises(ValueError, match=f"shape mismatch for {re.escape(name)}"):
        SparseMoeBlock(family.cfg).load_hf_weights(_taker(state)[0], PREFIX)


def test_no_tokens_and_dense_config(family):
    block = _ours(family)
    assert block(torch.randn(0, HIDDEN)).shape == (0, HIDDEN)
    dense = ModelConfig.from_hf_config({**family.model.config.to_dict(), "model_type": "qwen3"})
    with pytest.raises(ValueError, match="not a mixture-of-experts config"):
        SparseMoeBlock(dense)
    with pytest.raises(ValueError, match="not a mixture-of-experts config"):
        moe_param_shapes(dense, PREFIX)
