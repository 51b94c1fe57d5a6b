"""Engine behaviour on the real model: exactness oracles, scheduling, bad input, sampling knobs."""
from __future__ import annotations

import pytest
import torch

from sparsex import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _texts(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts(wiki_texts):
    # 8 prompts of different lengths, two sharing a long prefix
    base = [wiki_texts[i][: 80 + 120 * i] for i in range(6)]
    return base + [wiki_texts[6] + " First question?", wiki_texts[6] + " Second question, different?"]


@pytest.mark.model
def test_batch_invariance(llm_none, prompts):
    together = _texts(llm_none.generate(prompts, GREEDY, use_tqdm=False))
    alone = [_texts(llm_none.generate(p, GREEDY, use_tqdm=False))[0] for p in prompts[:3]]
    assert together[:3] == alone
    llm_none.llm_engine.check_integrity()


@pytest.mark.model
def test_prefix_caching_on_off_identical(llm_none, llm_prefix, prompts):
    ref = _texts(llm_none.generate(prompts, GREEDY, use_tqdm=False))
    llm_prefix.reset_cache()
    first = llm_prefix.generate(prompts, GREEDY, use_tqdm=False)
    again = llm_prefix.generate(prompts[::-1], GREEDY, use_tqdm=False)[::-1]
    assert _texts(first) == ref and _texts(again) == ref
    assert all(o.num_cached_tokens > 0 for o in again)                  # the second pass really hit
    assert sum(o.num_cached_tokens for o in again) >= 0.8 * sum(len(o.prompt_token_ids) for o in again) - 16 * 8
    llm_prefix.llm_engine.check_integrity()


@pytest.mark.model
def test_chunked_prefill_and_preemption_give_identical_output(llm_none, prompts, smollm2):
    ref = _texts(llm_none.generate(prompts, GREEDY, use_tqdm=False))
    # 40 blocks of 16 tokens cannot hold 8 prompts at once: forces preemption by recompute;
    # a 64-token budget forces chunked prefill.
    tiny = LLM(cache="prefix", dtype="float32", num_blocks=40, max_num_batched_tokens=64)
    outs = tiny.generate(prompts, GREEDY, use_tqdm=False)
    assert _texts(outs) == ref
    assert tiny.llm_engine.scheduler.num_preemptions > 0
    tiny.llm_engine.check_integrity()
    assert tiny.llm_engine.kv.pool.usage().num_in_use == 0


@pytest.mark.model
def test_prompt_logprobs_cover_every_position_of_a_cached_prompt(llm_none, llm_prefix, wiki_texts):
    """A cached position has no logits: a prompt_logprobs request reads no cache, so every position
    gets its logprob (as with the cache off), and the next plain request still hits the cache."""
    ids = llm_prefix.get_tokenizer().encode(wiki_texts[5][:600])
    plain = SamplingParams(temperature=0, max_tokens=1)
    llm_prefix.generate({"prompt_token_ids": ids}, plain, use_tqdm=False)          # now cached
    want = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    got = llm_prefix.generate({"prompt_token_ids": ids}, want, use_tqdm=False)[0]
    ref = llm_none.generate({"prompt_token_ids": ids}, want, use_tqdm=False)[0]
    assert got.num_cached_tokens == 0 and got.prompt_logprobs[0] is None
    assert all(got.prompt_logprobs[p] is not None for p in range(1, len(ids)))
    assert max(abs(got.prompt_logprobs[p][ids[p]] - ref.prompt_logprobs[p][ids[p]]) for p in range(1, len(ids))) < 1e-4
    assert llm_prefix.generate({"prompt_token_ids": ids}, plain, use_tqdm=False)[0].num_cached_tokens > 0
    llm_prefix.llm_engine.check_integrity()


@pytest.mark.model
def test_cache_salt_isolation(llm_prefix, wiki_texts):
    llm_prefix.reset_cache()
    text = wiki_texts[10]
    p = SamplingParams(temperature=0, max_tokens=2)
    llm_prefix.generate({"prompt": text, "cache_salt": "tenant-a"}, p, use_tqdm=False)
    same = llm_prefix.generate({"prompt": text, "cache_salt": "tenant-a"}, p, use_tqdm=False)[0]
    other = llm_prefix.generate({"prompt": text, "cache_salt": "tenant-b"}, p, use_tqdm=False)[0]
    unsalted = llm_prefix.generate(text, p, use_tqdm=False)[0]
    assert same.num_cached_tokens > 0
    assert other.num_cached_tokens == 0 and unsalted.num_cached_tokens == 0
    llm_prefix.llm_engine.check_integrity()


@pytest.mark.unit
@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.model
def test_bad_input_raises_before_queuing_and_engine_keeps_serving(llm_prefix, smollm2):
    eng = llm_prefix.llm_engine
    with pytest.raises(ValueError, match="max_model_len"):
        llm_prefix.generate(["fine prompt", {"prompt_token_ids": [1] * (eng.max_model_len + 5)}], GREEDY, use_tqdm=False)
    assert not eng.has_unfinished_requests()                      # the valid one was not queued either
    with pytest.raises(ValueError, match="vocabulary"):
        llm_prefix.generate({"prompt_token_ids": [10**9]}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm_prefix.generate({"prompt_token_ids": []}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="unknown model"):
        LLM(model="no-such-model")
    with pytest.raises(ValueError, match="cache must be one of"):
        LLM(cache="bogus")
    out = llm_prefix.generate("Still serving?", GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 12
    eng.check_integrity()


@pytest.mark.model
def test_kv_pool_too_small_for_one_request(smollm2):
    small = LLM(cache="prefix", dtype="float32", num_blocks=2)            # 32 tokens
    with pytest.raises(ValueError, match="KV pool"):
        small.generate({"prompt_token_ids": list(range(100, 140))}, GREEDY, use_tqdm=False)
    # a request that fits to start but outgrows the pool while decoding ends cleanly, blocks freed
    out = small.generate({"prompt_token_ids": list(range(100, 120))},
                         SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "abort" and 0 < len(out.outputs[0].token_ids) < 40
    small.llm_engine.check_integrity()
    assert small.llm_engine.kv.pool.usage().num_in_use == 0


@pytest.mark.model
def test_stop_strings_stop_ids_max_tokens_and_n(llm_prefix):
    base = llm_prefix.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert base.finish_reason in ("length", "stop")
    stop_at = base.text[3:6]
    o = llm_prefix.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_at and stop_at not in o.text
    assert base.text.startswith(o.text)
    tid = base.token_ids[2]
    o = llm_prefix.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == tid and len(o.token_ids) <= 3
    many = llm_prefix.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False)[0]
    assert len(many.outputs) == 3 and len({tuple(c.token_ids) for c in many.outputs}) > 1


@pytest.mark.model
def test_seeded_sampling_reproducible_across_batches(llm_prefix):
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm_prefix.generate("The weather today", p, use_tqdm=False)[0].outputs[0].token_ids
    mixed = llm_prefix.generate(["Other prompt here", "The weather today", "A third one"],
                                [SamplingParams(temperature=1.0, max_tokens=7), p, GREEDY], use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm_prefix.generate("The weather today", SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=99,
                                     max_tokens=10, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert other_seed != alone


@pytest.mark.model
def test_abort_frees_blocks(llm_prefix):
    eng = llm_prefix.llm_engine
    eng.add_request("to-abort", "A long story begins here and", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.kv.pool.usage().num_in_use > 0
    eng.abort_request("to-abort")
    assert not eng.has_unfinished_requests()
    assert eng.kv.pool.usage().num_in_use == 0
    eng.check_integrity()


@pytest.mark.model
def test_outputs_carry_metrics_and_logprobs(llm_prefix):
    o = llm_prefix.generate("Hello", SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True), use_tqdm=False)[0]
    assert o.metrics.ttft is not None and o.metrics.ttft > 0
    assert len(o.outputs[0].logprobs) == 4
    for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids):
        assert t in d and len(d) >= 3 and d[t] == max(d.values())         # greedy: the top token


@pytest.mark.unit
def test_dtype_auto_follows_native_bf16(monkeypatch):
    from sparsex import config

    assert config.parse_dtype("auto", "cuda") == torch.bfloat16
    assert config.parse_dtype("auto", "cuda:1") == torch.bfloat16
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    assert config.parse_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)
    assert config.parse_dtype("auto", "cpu") == torch.float32
    assert config.EngineConfig(dtype="auto").torch_dtype == torch.float32
    with pytest.raises(ValueError, match="'bf17'"):
        config.parse_dtype("bf17")


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(device="cuda", dtype="float32")


@pytest.mark.model
def test_bf16_without_native_support_keeps_plain_linears(monkeypatch, llm_none, wiki_texts):
    """An AVX2-only CPU cannot reorder bf16 weights for oneDNN (it raises at load time): the engine
    must then keep F.linear, and still serve the same greedy text as a prepacked engine would."""
    from sparsex.layers import packed_linear

    monkeypatch.setattr(packed_linear, "cpu_has_native_bf16", lambda: False)
    assert not packed_linear.prepack_supported(torch.device("cpu"), torch.bfloat16)
    assert packed_linear.prepack_supported(torch.device("cpu"), torch.float32)
    llm = LLM(cache="prefix", dtype="bfloat16", seed=0, num_blocks=64)
    model = llm.llm_engine.runner.model
    assert not any(isinstance(m, packed_linear.PackedLinear) for m in model.modules())
    prompt = wiki_texts[0][:600]
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) > 0
    ref = llm_none.generate(prompt, GREEDY, use_tqdm=False)[0]
    # bf16 against fp32 on real text: the first greedy tokens agree
    assert out.outputs[0].token_ids[:4] == ref.outputs[0].token_ids[:4]
    llm.llm_engine.check_integrity()
