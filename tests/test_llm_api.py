"""The offline API's surface on the real SmolLM2: `LLM(**knobs)` maps onto EngineConfig / ReuseConfig,
and `LLM.ingest` computes a corpus's segments so that a later prompt with them in another order
reuses them (against a control: the same prompt before ingestion reuses nothing)."""
from __future__ import annotations

import dataclasses

import pytest

from sparsex import LLM, SamplingParams
from sparsex.config import EngineConfig, ReuseConfig

from geo_passages import PASSAGES

# longer than min_context_tokens (128): segments computed after it are reusable anywhere
PREFIX = "You answer questions about geography using only the passages that follow. " * 11
QUESTION = "\nQuestion: which passage mentions a freshwater seal?\nAnswer:"
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_blocks=384, max_model_len=1024, recompute_ratio=0.25)


@pytest.mark.model
def test_knobs_map_onto_the_config(llm):
    assert llm.config.reuse.recompute_ratio == 0.25 and llm.config.max_model_len == 1024
    # everything not passed is EngineConfig's / ReuseConfig's default: LLM has no defaults of its own
    given = {"dtype", "num_blocks", "max_model_len", "reuse"}
    for f in dataclasses.fields(EngineConfig):
        if f.name not in given:
            assert getattr(llm.config, f.name) == getattr(EngineConfig(), f.name), f.name
    for f in dataclasses.fields(ReuseConfig):
        if f.name != "recompute_ratio":
            assert getattr(llm.config.reuse, f.name) == getattr(ReuseConfig(), f.name), f.name
    assert llm.config.cache == "sparsex"


@pytest.mark.unit
def test_unknown_or_bad_knob_is_named():
    with pytest.raises(TypeError, match=r"\['recompute_rate'\].*'recompute_ratio'"):
        LLM(recompute_rate=0.2)
    with pytest.raises(ValueError, match="recompute_ratio"):
        LLM(recompute_ratio=1.5)
    with pytest.raises(TypeError, match="ReuseConfig"):
        LLM(reuse={"recompute_ratio": 0.2})


@pytest.mark.model
def test_ingest_then_reordered_prompt_reuses_segments(llm):
    prompt = {"segments": [PREFIX, *PASSAGES[::-1], QUESTION]}
    llm.reset_cache()
    control = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert control.num_reused_tokens == 0                   # nothing indexed yet
    llm.reset_cache()
    result = llm.ingest(PASSAGES, prefix=PREFIX, group_size=3, passes=3)
    assert result.num_segments == len(PASSAGES)
    assert result.num_prompts == 3 * 3                      # 3 passes of ceil(8 / 3) prompts
    assert result.num_segment_entries >= len(PASSAGES)
    assert result.num_tokens_computed > 0
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert out.num_reused_tokens > 0
    # another namespace finds nothing of it
    salted = llm.generate({**prompt, "cache_salt": "another"}, GREEDY, use_tqdm=False)[0]
    assert salted.num_reused_tokens == 0 and salted.num_cached_tokens == 0


@pytest.mark.model
@pytest.mark.parametrize("kwargs, needle", [
    ({"segments": []}, "non-empty"),
    ({"segments": "one passage"}, "list of strings"),
    ({"segments": ["ok", 3]}, r"segments\[1\]"),
    ({"segments": ["ok", ""]}, r"segments\[1\]"),
    ({"segments": ["ok"], "passes": 0}, "passes"),
    ({"segments": ["ok"], "group_size": 0}, "group_size"),
    ({"segments": ["ok"], "prefix": ""}, "prefix"),
    ({"segments": ["ok", "hello " * 1100]}, r"segments\[1\].*max_model_len"),
    ({"segments": ["hello " * 300] * 4, "group_size": 4}, "lower group_size"),
])
def test_ingest_rejects_bad_input(llm, kwargs, needle):
    before = llm.llm_engine.stats().num_segment_entries
    segments = kwargs.pop("segments")
    with pytest.raises(ValueError, match=needle):
        llm.ingest(segments, **kwargs)
    assert llm.llm_engine.stats().num_segment_entries == before         # nothing ran
