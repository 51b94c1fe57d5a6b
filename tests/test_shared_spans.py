"""Spans found by content shared between replicas (segment_store_spans) on one real Redis server: a
passage one replica computed inside a one-message prompt is found, fetched and blended by another
replica that never computed it; a stretch a replica reuses by content (it recurred) is published
too; a forced anchor collision never reuses wrong KV; tenants never meet; Redis down recomputes."""
from __future__ import annotations

import numpy as np
import pytest

from sparsex import LLM, SamplingParams
from sparsex.kvstore.anchor_index import ANCHOR_TAG, record_prefix
from sparsex.segment.span_index import anchors

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _intro(i: int) -> str:
    # > min_context_tokens before the passage: its KV is not an early encoding
    return f"Note {i}: read the passage below with care before you answer. " * 14 + "\n\n"


def _message(i: int, passage: str, question: str) -> str:
    return f"{_intro(i)}Passage:\n{passage}\n\nQuestion {i}: {question}"


def replica(url: str | None, **kw) -> LLM:
    store = dict(segment_store=url, segment_store_fetch="always", segment_store_spans=True) if url else {}
    return LLM(**{"cache": "sparsex", "dtype": "float32", "num_blocks": 300, "min_blend_tokens": 0, **store, **kw})


def _chat(llm: LLM, text: str, salt: str | None = None):
    return llm.chat([{"role": "user", "content": text}], GREEDY, use_tqdm=False, cache_salt=salt)[0]


@pytest.fixture(scope="module")
def passage(wiki_texts):
    return wiki_texts[5][:800]


def _reused_from_store(out) -> int:
    return sum(s.end - s.start for s in out.reused_spans if s.source == "indexed")


def test_a_passage_one_replica_computed_is_blended_by_another(smollm2, redis_server, passage):
    a, b = replica(redis_server.url()), replica(redis_server.url())
    _chat(a, _message(1, passage, "Who is it about?"))
    assert a.llm_engine.store.flush()
    st = a.llm_engine.stats().store
    assert st.span_records_published >= 1 and st.span_anchors_published > 20
    p3 = _message(3, "Some more words first. " * 5 + passage, "When did it happen?")
    out = _chat(b, p3)
    st = b.llm_engine.stats().store
    assert st.span_lookups == 1 and st.span_installed == 1 and st.span_rejected == 0
    assert out.num_reused_tokens > 120 and _reused_from_store(out) > 120
    # the positive control: the same replica computing the passage itself, then the same prompt
    local = replica(None)
    _chat(local, _message(1, passage, "Who is it about?"))
    want = _chat(local, p3)
    assert want.num_reused_tokens == out.num_reused_tokens
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    b.llm_engine.check_integrity()
    for e in (a, b, local):
        e.llm_engine.close()


def test_a_recurring_stretch_is_published_once_it_recurs(smollm2, redis_server, passage):
    """Plain-text prompts carry no segment: a replica publishes the stretch it reused by content."""
    a, b = replica(redis_server.url()), replica(redis_server.url())
    tok = a.llm_engine.tokenizer
    p1 = tok.apply_chat_template([{"role": "user", "content": _message(1, passage, "Who?")}], tokenize=False,
                                 add_generation_prompt=True)
    a.generate(p1, GREEDY, use_tqdm=False)
    assert a.llm_engine.store.flush() and a.llm_engine.stats().store.span_records_published == 0
    p2 = p1.replace(_intro(1), _intro(2) + "Another line. " * 3).replace("Who?", "Where?")
    assert a.generate(p2, GREEDY, use_tqdm=False)[0].num_reused_tokens > 120        # it recurred here
    # the stretch it reused (the passage and the glue around it), and the stretches it computed in full there
    assert a.llm_engine.store.flush() and a.llm_engine.stats().store.span_records_published >= 1
    p3 = p1.replace(_intro(1), _intro(3) + "A third line. " * 7).replace("Who?", "When?")
    out = b.generate(p3, GREEDY, use_tqdm=False)[0]
    assert b.llm_engine.stats().store.span_installed >= 1 and _reused_from_store(out) > 120
    b.llm_engine.check_integrity()
    a.llm_engine.close(), b.llm_engine.close()


def test_a_forced_anchor_collision_never_reuses_wrong_kv(smollm2, redis_server, passage, wiki_texts):
    a, b = replica(redis_server.url()), replica(redis_server.url())
    other = wiki_texts[9][:800]
    _chat(a, other + "\n\nSummarize this.")                 # a record of other tokens, none in common
    assert a.llm_engine.store.flush()
    client = redis_server.client()
    rec_key = next(k.decode() for k in client.keys("sparsex:*") if ANCHOR_TAG not in k.decode())
    prefix, seg = record_prefix(rec_key)
    # every anchor of the passage's prompt points at that record, all at one alignment (as a record holding
    # the whole prompt would): the strongest proposal a forged index can make
    p3 = _message(3, passage, "When did it happen?")
    ids = b.llm_engine.tokenizer.encode(p3, add_special_tokens=False)
    pos, hashes = anchors(np.asarray(ids, dtype=np.int32))
    for p, h in zip(pos.tolist(), hashes.tolist()):
        client.lpush(f"{prefix}{ANCHOR_TAG}{h:016x}", f"{seg}:{p - int(pos[0])}:1000")
    out = _chat(b, p3)
    st = b.llm_engine.stats().store
    assert st.span_candidates == 1 and st.span_rejected == 1 and st.span_installed == 0
    assert out.num_reused_tokens == 0
    plain = LLM(cache="none", dtype="float32", num_blocks=300)
    assert out.outputs[0].token_ids == _chat(plain, p3).outputs[0].token_ids
    for e in (a, b, plain):
        e.llm_engine.close()


def test_tenants_never_meet_through_the_anchor_index(smollm2, redis_server, passage):
    a, b = replica(redis_server.url()), replica(redis_server.url())
    _chat(a, _message(1, passage, "Who is it about?"), salt="tenant-1")
    assert a.llm_engine.store.flush()
    out = _chat(b, _message(3, passage, "When did it happen?"), salt="tenant-2")
    st = b.llm_engine.stats().store
    assert out.num_reused_tokens == 0 and st.span_candidates == 0 and st.remote_hits == 0
    same = _chat(b, _message(4, passage, "Where is it?"), salt="tenant-1")        # the positive control
    assert b.llm_engine.stats().store.span_installed == 1 and _reused_from_store(same) > 120
    a.llm_engine.close(), b.llm_engine.close()


def test_redis_down_recomputes(smollm2, redis_server, passage):
    a = replica(redis_server.url())
    _chat(a, _message(1, passage, "Who is it about?"))
    assert a.llm_engine.store.flush()
    redis_server.kill()
    b = replica(redis_server.url())
    out = _chat(b, _message(3, passage, "When did it happen?"))
    assert len(out.outputs[0].token_ids) == 8 and out.num_reused_tokens == 0
    st = b.llm_engine.stats().store
    assert st.remote_errors > 0 and not st.remote_up and st.span_installed == 0
    a.llm_engine.close(), b.llm_engine.close()


def test_prometheus_counts_span_records_by_outcome():
    from sparsex.engine.llm_engine import EngineStats
    from sparsex.kvstore.segment_store import StoreStats
    from sparsex.metrics import ServerMetrics
    m = ServerMetrics("m")
    base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=1, prefix_cache_queries=0,
                prefix_cache_hits=0, approx_prefix_hits=0, num_preemptions=0)
    m.on_stats(EngineStats(**base, store=StoreStats(span_records_published=3, span_installed=2, span_rejected=1)))
    text = m.render().decode()
    for outcome, n in (("published", 3), ("installed", 2), ("rejected", 1)):
        line = f'sparsex:segment_store_span_records_total{{model_name="m",outcome="{outcome}"}} {n:.1f}'
        assert line in text, line
