"""The live quality monitor (`quality_sample`): its scores are the fidelity bench's, it runs only in idle
capacity, gives way to arriving requests, and costs nothing when off."""
from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from sparsex import LLM, SamplingParams
from sparsex.bench.fidelity import pieces_prompt, reference, run_to_completion, teacher_forced
from sparsex.config import EngineConfig
from sparsex.engine.quality_monitor import QualityMonitor
from sparsex.engine.ratio_controller import LOWER_BELOW, STEP, RatioController
from sparsex.entrypoints.async_engine import AsyncLLM

KNOBS = dict(cache="sparsex", dtype="float32", seed=0, num_blocks=512, min_blend_tokens=0, transparent_segments=False,
             min_context_tokens=0)
HEAD = "System: answer from the passages.\n\n"
QUESTION = "\nQuestion: what is the first passage about? Answer:"
ANSWER_TOKENS = 5          # the served answer and full prefill's agree on these (they part at the 6th)


@pytest.fixture(scope="module")
def passages(wiki_texts):
    return [t[:700] for t in wiki_texts[30:34]]          # ~150 tokens each


@pytest.fixture(scope="module")
def llm_q(smollm2):
    return LLM(quality_sample=1.0, **KNOBS)


def _prompt(engine, head, passages):
    return pieces_prompt(engine, [head, *passages, QUESTION], [True] * (len(passages) + 1) + [False])


def _serve_blended(engine, passages):
    """Register the passages, then serve a prompt that reuses them in another order."""
    run_to_completion(engine, _prompt(engine, HEAD, passages), SamplingParams(temperature=0, max_tokens=1))
    p = _prompt(engine, "Another system prompt, so no prefix hit.\n", passages[::-1])
    out, _ = run_to_completion(engine, p, SamplingParams(temperature=0, max_tokens=ANSWER_TOKENS, ignore_eos=True))
    assert out.num_reused_tokens > 0 and out.num_recomputed_tokens < out.num_reused_tokens
    return p, out


@pytest.mark.model
def test_the_monitor_scores_what_the_fidelity_bench_scores(llm_q, llm_none, passages):
    eng = llm_q.llm_engine
    eng.reset_cache()
    mon = eng.quality_monitor
    before = mon.num_sampled
    p, out = _serve_blended(eng, passages)
    assert mon.num_sampled == before + 1 and len(mon.pending) == 1      # only the blended request is sampled
    # the bench first (its blend leaves no exact blocks; the monitor's reference leaves the whole prompt
    # on the exact chain, where a later blend of it would be an exact hit): full prefill's greedy
    # continuation in a cache-less engine, then the blend teacher-forced on it
    cont, ref_lps = reference(llm_none.llm_engine, p, ANSWER_TOKENS)
    assert cont == out.outputs[0].token_ids, "the served answer is full prefill's here, so both score the same tokens"
    bench = teacher_forced(eng, p, cont, ref_lps, reuse={"min_blend_tokens": 0, "transparent_segments": False,
                                                         "min_context_tokens": 0})
    # the bench's teacher-forced run is a blended request too: the monitor samples it as well
    results = {r.request_id: r for r in eng.run_quality_checks()}
    result = results[out.request_id]
    assert len(results) == 2 and result.num_tokens == ANSWER_TOKENS
    assert not eng.has_unfinished_requests() and not mon.pending
    eng.check_integrity()
    assert result.top1 == bench.top1
    assert result.kl == pytest.approx(bench.kl, rel=1e-3, abs=1e-7)
    assert result.kl > 0            # a blend, not an exact copy
    st = eng.stats()
    assert (st.quality_sampled, st.quality_compared) == (mon.num_sampled, mon.num_compared)


@pytest.mark.model
def test_nothing_is_scored_while_a_request_waits_and_an_arrival_drops_the_score(llm_q, passages):
    eng = llm_q.llm_engine
    eng.reset_cache()
    mon = eng.quality_monitor
    _serve_blended(eng, passages)
    assert len(mon.pending) == 1
    eng.add_request("waiting", "Hello", SamplingParams(max_tokens=1))
    assert eng.run_quality_checks() == [] and len(mon.pending) == 1      # a request is here: nothing runs
    while eng.has_unfinished_requests():
        eng.step()
    # a request "arrives" after the scoring's first engine step: the score is aborted and counted
    polls = iter([False, False, True])
    dropped, compared = mon.num_dropped, mon.num_compared
    assert eng.run_quality_checks(should_yield=lambda: next(polls, True)) == []
    assert (mon.num_dropped, mon.num_compared, len(mon.pending)) == (dropped + 1, compared, 0)
    assert not eng.has_unfinished_requests()
    eng.check_integrity()


@pytest.mark.unit
def test_the_pending_queue_is_bounded_and_overflow_is_counted():
    mon = QualityMonitor(1.0, max_pending=2)
    record = SimpleNamespace(num_reused_tokens=100, skipped=None)
    for i in range(5):
        mon.offer(_fake_request(f"r{i}", record))
    assert [s.request_id for s in mon.pending] == ["r3", "r4"]
    assert (mon.num_sampled, mon.num_dropped) == (5, 3)
    # not blended (nothing reused, or served exact below min_blend_tokens): never sampled
    mon.offer(_fake_request("exact", SimpleNamespace(num_reused_tokens=0, skipped=None)))
    mon.offer(_fake_request("skipped", SimpleNamespace(num_reused_tokens=0, skipped="min_blend_tokens")))
    assert mon.num_sampled == 5
    with pytest.raises(ValueError, match="quality_sample must be in"):
        QualityMonitor(0.0)


def _fake_request(rid, record):
    from sparsex.config import ReuseConfig
    return SimpleNamespace(request_id=rid, reuse_record=record, reuse=ReuseConfig(), output_token_ids=[1, 2],
                           prompt_token_ids=[3, 4], segments=[], cache_salt=None)


@pytest.mark.unit
def test_a_share_samples_about_that_share():
    mon = QualityMonitor(0.25, seed=1, max_pending=10_000)
    record = SimpleNamespace(num_reused_tokens=100, skipped=None)
    for i in range(4000):
        mon.offer(_fake_request(f"r{i}", record))
    assert 800 < mon.num_sampled < 1200


@pytest.mark.model
def test_off_there_is_no_monitor_and_no_scoring(smollm2, passages):
    llm = LLM(**KNOBS)
    eng = llm.llm_engine
    assert eng.quality_monitor is None and eng.run_quality_checks() == []
    _serve_blended(eng, passages)
    st = eng.stats()
    assert (st.quality_sampled, st.quality_compared, st.quality_dropped) == (0, 0, 0)
    with pytest.raises(ValueError, match="quality_sample scores segment reuse: it needs cache='sparsex'"):
        EngineConfig(cache="prefix", quality_sample=0.5)


@pytest.mark.model
def test_the_server_loop_scores_in_idle_time_and_exports_histograms(smollm2, passages):
    """Also `quality_target`: a target below any blend's KL makes the first score raise the ratio one step,
    for requests without a ratio or profile of their own, and the gauge shows it."""
    llm = AsyncLLM.from_config(EngineConfig.from_knobs(quality_sample=1.0, quality_target=1e-9, **KNOBS))
    try:
        eng_tokenize = lambda e: _prompt(e, HEAD, passages)                           # noqa: E731
        other = lambda e: _prompt(e, "Another system prompt, so no prefix hit.\n", passages[::-1])   # noqa: E731

        async def serve():
            for source in (eng_tokenize, other):
                async for _ in llm.generate(source, SamplingParams(temperature=0, max_tokens=4)):
                    pass
        asyncio.run(serve())
        # polled on the registry, not through the engine: a command for the engine thread is an arrival
        # the monitor gives way to
        deadline = time.time() + 300          # guards a hang only; no performance threshold

        def sample(name):
            lines = [ln for ln in llm.metrics.render().decode().splitlines() if ln.startswith(name)]
            return float(lines[0].split()[-1]) if lines else 0.0
        while sample("sparsex:reuse_quality_compared_total") < 1 and time.time() < deadline:
            time.sleep(0.05)
        assert sample("sparsex:reuse_kl_count") == sample("sparsex:reuse_top1_count") == 1.0
        assert sample("sparsex:reuse_quality_sampled_total") == 1.0      # the first request blended nothing
        assert sample("sparsex:reuse_kl_sum") > 0
        assert llm.call_sync(lambda e: (len(e.quality_monitor.pending), e.stats().quality_dropped)) == (0, 0)
        # quality_target: 0.125 (the default) raised by one step, applied where a request sets no ratio of its own
        assert sample("sparsex:reuse_recompute_ratio") == 0.125 * STEP
        planned = llm.call_sync(lambda e: [e._reuse_for(o).recompute_ratio for o in
                                           (None, {"selector": "kv_deviation"}, {"recompute_ratio": 0.3},
                                            {"reuse_profile": "fast"})])
        assert planned == [0.125 * STEP, 0.125 * STEP, 0.3, 0.125]
    finally:
        asyncio.run(llm.shutdown())


@pytest.mark.unit
def test_the_reuse_config_info_names_the_profile_in_force():
    from prometheus_client.parser import text_string_to_metric_families

    from sparsex.config import ReuseConfig
    from sparsex.metrics import ServerMetrics
    reuse = ReuseConfig().with_overrides({"reuse_profile": "quality", "selector": "kv_deviation"})
    text = ServerMetrics("m", reuse=reuse).render().decode()
    [info] = [s for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "sparsex:reuse_config_info"]
    assert info.labels == {"model_name": "m", "reuse_profile": "quality", "full_layers": "2",
                           "recompute_ratio": "0.5", "selector": "kv_deviation", "rescore_layers": "auto",
                           "profile_source": "built-in"}
    no_reuse = ServerMetrics("m").render().decode()            # cache="prefix"/"none": no reuse, no info
    assert "reuse_config_info" not in no_reuse


@pytest.mark.unit
def test_the_ratio_controller_holds_the_target_within_its_bounds():
    c = RatioController(target=0.01, ratio=0.125)
    assert c.observe(0.02) == 0.125 * STEP and c.num_raised == 1             # above the target: up a step
    assert c.observe(0.02) == 0.125 * STEP ** 2
    for _ in range(20):
        c.observe(0.05)
    assert c.ratio == c.hi == 0.5                                              # never past the upper bound
    # the weighted mean, not the last score, decides: one low score after high ones does not lower it
    c.observe(0.0)
    assert c.ratio == 0.5 and c.kl_mean > c.target
    for _ in range(30):
        c.observe(0.001)                                                       # well below: down to the floor
    assert c.ratio == c.lo == 0.0625 and c.num_lowered > 0
    # inside the band (between LOWER_BELOW x target and the target) the ratio holds still
    held = RatioController(target=0.01, ratio=0.2, kl_mean=0.75 * 0.01)
    assert LOWER_BELOW * 0.01 < 0.0075 < 0.01
    assert held.observe(0.0075) == 0.2 and (held.num_raised, held.num_lowered) == (0, 0)
    assert RatioController(target=0.01, ratio=0.9).ratio == 0.5                 # a start outside: clamped
    for bad in (dict(target=0.0, ratio=0.1), dict(target=0.01, ratio="auto")):
        with pytest.raises(ValueError, match="quality_target"):
            RatioController(**bad)
    with pytest.raises(ValueError, match="monitored KL"):
        c.observe(float("nan"))


@pytest.mark.unit
def test_quality_target_needs_the_monitor_and_a_fixed_ratio():
    with pytest.raises(ValueError, match="needs quality_sample > 0"):
        EngineConfig(model="dummy:llama-tiny", quality_target=0.01)
    with pytest.raises(ValueError, match="cannot be combined with recompute_ratio='auto'"):
        EngineConfig.from_knobs(model="dummy:llama-tiny", quality_sample=0.5, quality_target=0.01,
                                recompute_ratio="auto")
    with pytest.raises(ValueError, match="quality_target must be"):
        EngineConfig(model="dummy:llama-tiny", quality_sample=0.5, quality_target=-1.0)
    EngineConfig(model="dummy:llama-tiny", quality_sample=0.5, quality_target=0.01)


@pytest.mark.unit
def test_the_ratio_gauge_shows_the_controlled_ratio():
    from sparsex.engine.llm_engine import EngineStats
    from sparsex.metrics import ServerMetrics
    m = ServerMetrics("m")
    m.on_stats(EngineStats(0, 0, 0.0, 1, 0, 0, controlled_ratio=0.15625))
    assert 'sparsex:reuse_recompute_ratio{model_name="m"} 0.15625' in m.render().decode()
