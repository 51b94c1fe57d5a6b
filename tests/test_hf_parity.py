"""The model path must match Hugging Face transformers: greedy tokens identical, logprobs within 1e-3."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from sparsex import LLM, SamplingParams

MAX_NEW = 16          # decode crosses a block boundary of every prompt


@pytest.fixture(scope="module")
def hf_model(smollm2):
    """transformers' own Llama on the same weights: the reference every model path is checked against."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2.model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _prompts(tokenizer, wiki_texts) -> list[list[int]]:
    chat = lambda text: tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    raw = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        wiki_texts[0][:400] + "\n\nIn summary,",
        " ".join(wiki_texts[1:4]) + "\n\nThe three topics above are",
        " ".join(wiki_texts[4:8]) + "\n\nQuestion: which of these is oldest? Answer:",    # ~1k tokens
    ]
    chats = [
        "What is the tallest mountain on Earth?",
        "Summarise this:\n" + wiki_texts[14],
        "Give three facts from these passages:\n" + "\n\n".join(wiki_texts[15:22]),     # ~1.6k tokens
    ]
    ids = [tokenizer.encode(p) for p in raw] + [chat(c) for c in chats]
    ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
    return ids


@torch.no_grad()
def _hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for `ids` and their logprobs, from the logits of its own decode steps."""
    inp = torch.tensor([ids])
    out = model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    gen = out.sequences[0, len(ids):].tolist()
    logits = torch.cat(out.logits).float()                         # [n, vocab]: step t predicts gen[t]
    lps = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen)[:, None])[:, 0]
    return gen, lps.tolist()


def _hf_forced(model, ids: list[int], gen: list[int]) -> tuple[list[int], list[float]]:
    """transformers' argmax tokens and the logprobs of `gen` at each of its steps, from one forward over the
    prompt and `gen`: where the argmax equals `gen` at every step, `gen` is transformers' greedy output
    (`_hf_greedy`) in one forward instead of len(gen) decode steps."""
    with torch.no_grad():
        lps = torch.log_softmax(model(torch.tensor([ids + gen])).logits[0, len(ids) - 1:-1].float(), -1)  # [n, vocab]
    return lps.argmax(-1).tolist(), lps.gather(1, torch.tensor(gen)[:, None])[:, 0].tolist()


@pytest.mark.model
def test_llama_greedy_tokens_and_logprobs_match_transformers(llm_prefix, hf_model, wiki_texts):
    tok = llm_prefix.get_tokenizer()
    prompts = _prompts(tok, wiki_texts)
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 8 and lengths[-1] >= 1200, lengths
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1)
    outs = llm_prefix.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        got = o.outputs[0]
        # transformers' own greedy decode for the short prompts, one forward over prompt + tokens for the rest
        ref_ids, ref_lps = _hf_greedy(hf_model, p, MAX_NEW) if i < 2 else _hf_forced(hf_model, p, got.token_ids)
        assert got.token_ids == ref_ids, f"prompt of {len(p)} tokens diverges"
        ours = [lp[t] for lp, t in zip(got.logprobs, got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-3
    llm_prefix.llm_engine.check_integrity()


@pytest.mark.model
def test_prompt_logprobs_match_transformers(llm_none, hf_model, wiki_texts):
    ids = llm_none.get_tokenizer().encode(wiki_texts[2][:600])
    out = llm_none.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3),
                            use_tqdm=False)[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)   # [T, vocab]
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        d = out.prompt_logprobs[pos]
        assert abs(d[ids[pos]] - ref[pos - 1, ids[pos]].item()) < 1e-3
        top = torch.topk(ref[pos - 1], 3).indices.tolist()
        assert set(top) <= set(d)



@pytest.mark.model
def test_distributions_match_transformers_over_prompt_tail_and_generated_tokens(llm_none, hf_model, wiki_texts):
    ids = llm_none.get_tokenizer().encode(wiki_texts[3][:500])
    n = len(ids)
    out = llm_none.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, logprobs=0,
                                                                      distributions_from=n - 4), use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    # the prompt's last 4 rows (the last one predicts generated token 1), then the rows of generated
    # tokens 1 and 2 (which predict tokens 2 and 3); token 3's own row is never computed
    assert sorted(out.distributions) == list(range(n - 4, n + 2))
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids + gen])).logits[0].float(), -1)   # [T, vocab]
    for pos, d in out.distributions.items():
        assert d.shape == (ref.shape[-1],) and d.dtype == torch.float32
        assert (d - ref[pos]).abs().max().item() < 2e-3, pos
    for t, tok in enumerate(gen):          # the greedy tokens are the distributions' argmax, at their logprob
        assert int(out.distributions[n - 1 + t].argmax()) == tok
        assert abs(out.outputs[0].logprobs[t][tok] - ref[n - 1 + t, tok].item()) < 2e-3
    with pytest.raises(ValueError, match="distributions_from"):
        SamplingParams(distributions_from=-1)
    plain = llm_none.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert plain.distributions is None

# ---- Qwen2 architecture: q/k/v biases, untied head -------------------------------------------

def _tiny_qwen2_dir(tmp_path, tokenizer) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=1e6, tie_word_embeddings=False, rms_norm_eps=1e-6,
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)       # larger than init so attention is far from uniform
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.model
def test_qwen2_architecture_matches_transformers(tmp_path, smollm2):
    from transformers import AutoModelForCausalLM
    qdir = _tiny_qwen2_dir(tmp_path, smollm2.tokenizer)
    with open(os.path.join(qdir, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen2"
    ref = AutoModelForCausalLM.from_pretrained(qdir, dtype=torch.float32, attn_implementation="eager").eval()
    assert ref.model.layers[0].self_attn.q_proj.bias is not None
    llm = LLM(model=qdir, cache="prefix", dtype="float32", num_blocks=256)
    prompts = [smollm2.tokenizer.encode(t) for t in ("Hello world, this is a test of", "1 2 3 4 5 6 7 8 9 10 " * 20)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ref_ids, ref_lps = _hf_greedy(ref, p, 16)
        assert o.outputs[0].token_ids == ref_ids
        ours = [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-3


@pytest.mark.unit
def test_llama3_rope_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from sparsex.layers.rotary_embedding import rope_inv_freq
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0,
                      rope_scaling=dict(scaling), max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = rope_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(ours, rope_inv_freq(128, 500000.0, None))   # scaling changed something


# ---- Gemma 3 270M (real weights): sliding + global layers, two RoPE bases, (1 + w) norms --------

@pytest.fixture(scope="module")
def gemma3():
    from sparsex.models.loader import load_model
    from sparsex.models.packaged_gguf import GEMMA3_INSTALL_HINT
    try:
        loaded = load_model("gemma3-270m")
    except ValueError as e:
        pytest.skip(f"{e} ({GEMMA3_INSTALL_HINT})")
    return loaded


@pytest.mark.model
def test_gemma3_270m_matches_transformers(gemma3, wiki_texts):
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(gemma3.model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(model="gemma3-270m", cache="prefix", dtype="float32", num_blocks=256)
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):\n    ", wiki_texts[0][:400] + "\n\nIn summary,",
             " ".join(wiki_texts[1:6]) + "\n\nThe five topics above are"]     # the last: ~1k tokens, past the 512 window
    prompts = [tok.encode(t) for t in texts]
    assert max(map(len, prompts)) > 2 * gemma3.config.sliding_window
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    with_prompt = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [greedy] * 3 + [with_prompt], use_tqdm=False)
    for p, o in zip(prompts[:-1], outs):
        ref_ids, ref_lps = _hf_greedy(ref, p, 16)
        assert o.outputs[0].token_ids == ref_ids, f"prompt of {len(p)} tokens diverges"
        ours = [lp[t] for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lps)) < 1e-3
    # the long prompt: its prompt logprobs and its greedy tokens against one transformers forward over
    # the prompt and those tokens (greedy: each token is transformers' argmax where it was chosen)
    ids, out = prompts[-1], outs[-1]
    gen, n = out.outputs[0].token_ids, len(ids)
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([ids + gen])).logits[0].float(), -1)    # [T + 16, vocab]
    assert want[n - 1:-1].argmax(-1).tolist() == gen, f"prompt of {n} tokens diverges"
    assert max(abs(lp[t] - want[n - 1 + i, t].item()) for i, (lp, t) in enumerate(zip(out.outputs[0].logprobs, gen))) < 1e-3
    assert max(abs(out.prompt_logprobs[p][ids[p]] - want[p - 1, ids[p]].item()) for p in range(1, n)) < 1e-3
    llm.llm_engine.check_integrity()
