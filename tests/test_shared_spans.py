"""Spans found by content shared between replicas (segment_store_spans) on one real Redis server: a
passage one replica computed inside a one-message prompt is found, fetched and blended by another
replica that never computed it; a stretch a replica reuses by content (it recurred) is published
too; a forced anchor collision never reuses wrong KV; tenants, models and layouts never meet. The
faults of the anchor path (Redis down or hung, a record evicted between lookup and fetch, a
truncated or corrupt one) recompute the request, raise a counter, and remove the references that
led to a record that is gone. No mocks: eviction is a DEL behind the replicas' back, a hung server a
SIGSTOPped one."""
from __future__ import annotations

import time

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


def _first(passage: str) -> str:
    return _message(1, passage, "Who is it about?")


def _later(passage: str) -> str:
    """A prompt holding the passage at another place, after another intro."""
    return _message(3, "Some more words first. " * 5 + passage, "When did it happen?")


@pytest.fixture(scope="module")
def computed_here(smollm2, passage):
    """The positive control: a replica without a store that computed the passage itself, then `_later`."""
    local = replica(None)
    _chat(local, _first(passage))
    out = _chat(local, _later(passage))
    local.llm_engine.close()
    return out


@pytest.fixture(scope="module")
def plain(smollm2):
    """Plain prefill's answer to a prompt (no cache): what a recomputed request must answer."""
    llm, answers = LLM(cache="none", dtype="float32", num_blocks=300), {}

    def answer(text: str) -> list[int]:
        if text not in answers:
            answers[text] = _chat(llm, text).outputs[0].token_ids
        return answers[text]
    yield answer
    llm.llm_engine.close()


def _records(client) -> list[str]:
    return [k.decode() for k in client.keys("sparsex:*") if ANCHOR_TAG not in k.decode()]


def _refs_to(client, record_key: str) -> int:
    """References to the record in the anchor index (every list of its prefix)."""
    prefix, seg = record_prefix(record_key)
    return sum(v.decode().startswith(seg + ":") for k in client.keys(f"{prefix}{ANCHOR_TAG}*")
               for v in client.lrange(k, 0, -1))


def _published(redis_server, passage):
    """Replica A published the passage's record (and its anchors); B is a second replica on the same
    Redis. Returns (a, b, an admin client, the record key, how many references name it)."""
    a, b = replica(redis_server.url()), replica(redis_server.url())
    _chat(a, _first(passage))
    assert a.llm_engine.store.flush()
    admin = redis_server.client()
    (key,) = _records(admin)
    return a, b, admin, key, _refs_to(admin, key)


def test_a_passage_one_replica_computed_is_blended_by_another(smollm2, redis_server, passage, computed_here):
    a, b = replica(redis_server.url()), replica(redis_server.url())
    _chat(a, _first(passage))
    assert a.llm_engine.store.flush()
    st = a.llm_engine.stats().store
    assert st.span_records_published >= 1 and st.span_anchors_published > 20
    out = _chat(b, _later(passage))
    st = b.llm_engine.stats().store
    assert st.span_lookups == 1 and st.span_installed == 1 and st.span_rejected == 0 and st.span_missing == 0
    assert out.num_reused_tokens > 120 and _reused_from_store(out) > 120
    # the positive control: a replica computing the passage itself, then the same prompt
    assert computed_here.num_reused_tokens == out.num_reused_tokens
    assert out.outputs[0].token_ids == computed_here.outputs[0].token_ids
    b.llm_engine.check_integrity()
    a.llm_engine.close(), b.llm_engine.close()


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


@pytest.mark.parametrize("fault", ["evicted", "corrupt"])
def test_a_record_gone_or_corrupt_at_fetch_is_recomputed_and_its_references_removed(
        smollm2, redis_server, passage, plain, fault):
    """The anchors propose a record that the store evicted after they were published, or whose value
    fails its checksum (one byte flipped; a truncated one fails the same check, tests/test_redis_tier.py):
    the request is computed (plain prefill's answer), a counter rises, and the references the lookup
    followed to it are removed."""
    a, b, admin, key, refs = _published(redis_server, passage)
    assert refs > 20
    if fault == "evicted":
        admin.delete(key)                                   # what allkeys-lru does; the anchors stay
    else:
        value = bytearray(admin.get(key))
        value[len(value) // 2] ^= 0xFF
        admin.set(key, bytes(value))
    out = _chat(b, _later(passage))
    st = b.llm_engine.stats().store
    assert out.num_reused_tokens == 0 and st.span_installed == 0
    assert out.outputs[0].token_ids == plain(_later(passage))
    if fault == "evicted":
        assert st.span_missing == 1 and st.remote_misses >= 1 and st.remote_corrupt == 0
    else:
        assert st.remote_corrupt == 1 and st.span_missing == 0 and st.span_candidates == 0
    assert b.llm_engine.store.flush()                      # the removals follow on the writer thread
    st = b.llm_engine.stats().store
    assert admin.exists(key) == 0                           # a corrupt record is deleted ...
    left = _refs_to(admin, key)                             # ... and the references the prompt followed go
    assert 0 < st.span_refs_removed == refs - left
    assert st.remote_errors == 0 and st.remote_up
    b.llm_engine.check_integrity()
    a.llm_engine.close(), b.llm_engine.close()


def test_a_hung_store_times_out_and_the_request_is_recomputed(smollm2, redis_server, passage, plain):
    """Redis stops answering (SIGSTOP) after a replica published the passage: another replica's request
    waits one timeout per client, is computed (plain prefill's answer), counts the errors and removes
    no reference; once the server answers again (and reconnect_s passed) the replica serves again."""
    a, b, admin, key, refs = _published(redis_server, passage)
    redis_server.pause()                                    # SIGSTOP: the port is open, nothing answers
    try:
        t0 = time.perf_counter()
        out = _chat(b, _later(passage))
        took = time.perf_counter() - t0
    finally:
        redis_server.resume()
    st = b.llm_engine.stats().store
    assert out.num_reused_tokens == 0 and out.outputs[0].token_ids == plain(_later(passage))
    assert st.remote_errors >= 1 and not st.remote_up and st.span_installed == 0 and st.span_missing == 0
    # each client (records, anchors) waits one 0.5 s timeout, then is down and tries nothing
    print(f"hung store: request {took:.2f}s, store round trips {st.fetch_seconds:.2f}s")
    assert st.fetch_seconds < 2 * 0.5 + 0.3, st.fetch_seconds
    assert took < 15, took
    time.sleep(1.0)                                         # past reconnect_s: it serves again
    _chat(b, _message(4, "A short question.", "Is it back?"))
    assert b.llm_engine.stats().store.remote_up
    assert _refs_to(admin, key) == refs                     # a failed read removes nothing
    a.llm_engine.close(), b.llm_engine.close()


def test_another_layout_under_the_same_index_is_never_fetched(smollm2, redis_server, passage, plain, wiki_texts):
    """A bfloat16 replica (another KV layout, the same model) publishes under the same Redis: a float32
    replica's lookup never meets its anchors, while a float32 record in the same prompt is found (the
    positive control); its record and anchors forged under float32 keys are fetched, dropped as corrupt
    (the K/V does not fit), never installed, and their references removed."""
    other = wiki_texts[9][:800]
    head, tail = passage[:400], passage[400:]              # b sees the head, d the tail
    a, c = replica(redis_server.url()), replica(redis_server.url(), dtype="bfloat16")
    _chat(c, _first(passage))
    _chat(a, _first(other))
    assert a.llm_engine.store.flush() and c.llm_engine.store.flush()
    admin = redis_server.client()
    c_key, a_key = (next(k for k in _records(admin) if f":{dtype}:" in k) for dtype in ("bfloat16", "float32"))
    (c_prefix, seg), (a_prefix, _) = record_prefix(c_key), record_prefix(a_key)
    b = replica(redis_server.url())
    both = _message(3, head + "\n\n" + other, "When did it happen?")
    # the bfloat16 index holds this prompt's content: only the key's dtype keeps b from it
    ids = b.llm_engine.tokenizer.encode(both, add_special_tokens=False)
    hashes = anchors(np.asarray(ids, dtype=np.int32))[1].tolist()
    assert sum(admin.exists(f"{c_prefix}{ANCHOR_TAG}{h:016x}") for h in hashes) > 10
    out = _chat(b, both)
    st = b.llm_engine.stats().store
    assert st.span_lookups == 1 and st.span_candidates == 1 and st.span_installed == 1
    assert st.remote_corrupt == 0 and st.span_missing == 0
    assert 120 < _reused_from_store(out) < 260             # the float32 passage only
    # forged: the bfloat16 record and its references copied under float32 keys
    forged = a_prefix + seg
    admin.set(forged, admin.get(c_key))
    for k in admin.keys(f"{c_prefix}{ANCHOR_TAG}*"):
        admin.rpush(a_prefix + k.decode()[len(c_prefix):], *admin.lrange(k, 0, -1))
    d = replica(redis_server.url())
    out = _chat(d, _later(tail))
    st = d.llm_engine.stats().store
    assert st.remote_corrupt == 1 and st.span_installed == 0 and out.num_reused_tokens == 0
    assert out.outputs[0].token_ids == plain(_later(tail))
    assert d.llm_engine.store.flush()
    assert admin.exists(forged) == 0 and d.llm_engine.stats().store.span_refs_removed > 0
    assert admin.exists(c_key) == 1 and _refs_to(admin, c_key) > 20     # the bfloat16 replica's own stay
    for e in (a, b, c, d):
        e.llm_engine.close()


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
    m.on_stats(EngineStats(**base, store=StoreStats(span_records_published=3, span_installed=2, span_rejected=1,
                                                       span_missing=4, span_refs_removed=5)))
    text = m.render().decode()
    for outcome, n in (("published", 3), ("installed", 2), ("rejected", 1), ("missing", 4)):
        line = f'sparsex:segment_store_span_records_total{{model_name="m",outcome="{outcome}"}} {n:.1f}'
        assert line in text, line
    assert 'sparsex:segment_store_span_refs_removed_total{model_name="m"} 5.0' in text
