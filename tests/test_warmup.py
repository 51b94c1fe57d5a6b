"""Start-up warm-up (sparsex/engine/warmup.py): it runs the paths it claims to (a plain prefill and
decode, an exact prefix hit, a blended prefill), and a warmed engine starts from the same empty
caches and zero counters as a cold one, giving the same output token for token."""
from __future__ import annotations

import dataclasses

import pytest

from sparsex import LLM, SamplingParams
from sparsex.config import EngineConfig


def _empty(engine) -> None:
    st = engine.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits, st.approx_prefix_hits) == (0, 0, 0)
    assert (st.segment_cache_queries, st.segment_cache_hits, st.recomputed_tokens) == (0, 0, 0)
    assert st.num_segment_entries == 0 and st.num_running == st.num_waiting == 0
    usage = engine.kv.pool.usage()
    assert usage.num_free == usage.num_blocks and not engine.kv.pool.cached
    assert engine.num_recomputed_tokens == 0 and engine.runner.timings.forward_s == 0.0
    assert not engine.requests
    engine.check_integrity()


@pytest.mark.unit
def test_default_is_on_for_cuda_only_and_bad_values_are_refused():
    assert EngineConfig(device="cpu").warmup_enabled is False
    assert EngineConfig(device="cuda").warmup_enabled is True
    assert EngineConfig(device="cuda", warmup=False).warmup_enabled is False
    assert EngineConfig(device="cpu", warmup=True).warmup_enabled is True
    with pytest.raises(ValueError, match="warmup"):
        EngineConfig(warmup="yes")


@pytest.mark.model
def test_warm_up_runs_the_prefix_and_blend_paths(smollm2):
    llm = LLM(cache="sparsex", dtype="float32", seed=0, num_blocks=512)
    engine = llm.llm_engine
    _empty(engine)
    seconds = engine.warm_up()
    assert seconds > 0.0
    st = engine.stats()
    assert st.prefix_cache_hits > 0                      # r2 extended r1's cached prefix
    assert st.segment_cache_hits >= 2 * 256              # r3 reused its passages at new positions
    assert st.recomputed_tokens > 0                      # ... and blended them
    assert engine.runner.timings.forward_s > 0.0
    engine.check_integrity()


@pytest.mark.model
def test_a_warmed_engine_serves_like_a_cold_one(smollm2, wiki_texts):
    cold = LLM(cache="sparsex", dtype="float32", seed=0, num_blocks=512)
    warm = LLM(cache="sparsex", dtype="float32", seed=0, num_blocks=512, warmup=True)
    assert cold.llm_engine.warmup_seconds == 0.0 and warm.llm_engine.warmup_seconds > 0.0
    _empty(warm.llm_engine)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    h1, h2, a, b = wiki_texts[:4]
    q = "Question: who or what is the second passage about?"
    for prompt in ({"segments": [h1, a, b, q]}, {"segments": [h2, b, a, q]}):   # the second one blends
        oc, ow = cold.generate(prompt, params, use_tqdm=False)[0], warm.generate(prompt, params, use_tqdm=False)[0]
        assert ow.outputs[0].token_ids == oc.outputs[0].token_ids
        assert (ow.num_cached_tokens, ow.num_reused_tokens, ow.num_recomputed_tokens) == \
            (oc.num_cached_tokens, oc.num_reused_tokens, oc.num_recomputed_tokens)
    assert ow.num_reused_tokens > 0
    untimed = lambda st: dataclasses.replace(st, selection_seconds=0.0, span_search_seconds=0.0)
    assert untimed(warm.llm_engine.stats()) == untimed(cold.llm_engine.stats())


@pytest.mark.model
@pytest.mark.parametrize("cache", ["none", "prefix"])
def test_other_cache_modes_warm_up_without_blending(smollm2, cache):
    llm = LLM(cache=cache, dtype="float32", seed=0, num_blocks=256, warmup=True)
    engine = llm.llm_engine
    assert engine.warmup_seconds > 0.0 and engine.planner is None and engine.registrar is None
    st = engine.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (0, 0)
    engine.check_integrity()


@pytest.mark.model
def test_a_pool_too_small_skips_the_warm_up(smollm2):
    llm = LLM(cache="sparsex", dtype="float32", seed=0, num_blocks=8, warmup=True)
    assert llm.llm_engine.warmup_seconds == 0.0
    out = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.model
def test_segments_follow_the_engines_min_segment_tokens(smollm2):
    llm = LLM(cache="sparsex", dtype="float32", seed=0, num_blocks=512, min_segment_tokens=300)
    llm.llm_engine.warm_up()
    assert llm.llm_engine.stats().segment_cache_hits >= 2 * 300     # still blended, with longer segments
