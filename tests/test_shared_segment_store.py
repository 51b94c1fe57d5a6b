"""Two engines (replicas) on one real Redis server: a segment one computes, the other reuses; tenants
never meet; the store going down, a corrupt record and concurrent merges never fail a request or
lose an update."""
from __future__ import annotations

import time

import pytest

from sparsex import LLM, SamplingParams
from sparsex.bench.fidelity import pieces_prompt, run_to_completion
from sparsex.kvstore.record import decode

pytestmark = pytest.mark.model

ONE = SamplingParams(temperature=0.0, max_tokens=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
HEAD = "System: answer from the passages.\n\n" * 20         # > min_context_tokens: the passages are not early
Q = "\nQuestion: which passage is the oldest? Answer:"


def replica(url: str, **kw) -> LLM:
    return LLM(cache="sparsex", dtype="float32", num_blocks=400, segment_store=url, segment_store_fetch="always",
               min_blend_tokens=0, transparent_segments=False, **kw)


@pytest.fixture(scope="module")
def passages(wiki_texts):
    return [t[:700] for t in wiki_texts[20:24]]


def _prompt(eng, head, passages, salt=None):
    p = pieces_prompt(eng, [head, *passages, Q], [True] * (len(passages) + 1) + [False])
    p.cache_salt = salt
    return p


def _run(eng, prompt, params=ONE, reuse=None):
    out, _ = run_to_completion(eng, prompt, params, reuse=reuse)
    return out


def test_a_segment_computed_on_one_replica_is_reused_by_a_cold_one(smollm2, redis_server, passages):
    a, b = replica(redis_server.url()), replica(redis_server.url())
    ea, eb = a.llm_engine, b.llm_engine
    _run(ea, _prompt(ea, HEAD, passages[:3]))
    assert ea.store.flush() and ea.stats().store.remote_bytes_written > 0
    p = _prompt(eb, "Another head.\n" * 12, passages[:3][::-1])
    out = _run(eb, p, GREEDY, reuse={"selector": "all"})
    st = eb.stats().store
    assert st.remote_hits >= 3 and st.installed_tokens > 300 and out.num_reused_tokens > 300
    assert eb.store.policy.load_bytes_per_s() > 0          # decode + install measured for the next decision
    # selector="all" recomputes every reused token: B's answer is A's on the same prompt
    want = _run(ea, p, GREEDY, reuse={"selector": "all"})
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    eb.check_integrity()
    ea.close(), eb.close()


def test_tenants_never_meet_through_the_store(smollm2, redis_server, passages):
    a, b = replica(redis_server.url()), replica(redis_server.url())
    ea, eb = a.llm_engine, b.llm_engine
    _run(ea, _prompt(ea, HEAD, passages[:2], salt="tenant-1"))
    ea.store.flush()
    other = _run(eb, _prompt(eb, "Another head.\n" * 12, passages[:2][::-1], salt="tenant-2"))
    assert other.num_reused_tokens == 0 and eb.stats().store.remote_hits == 0
    same = _run(eb, _prompt(eb, "A third head.\n" * 12, passages[:2][::-1], salt="tenant-1"))
    assert same.num_reused_tokens > 200 and eb.stats().store.remote_hits >= 2      # the positive control
    ea.close(), eb.close()


def test_store_down_never_fails_a_request(smollm2, redis_server, passages, wiki_texts):
    a = replica(redis_server.url())
    ea = a.llm_engine
    _run(ea, _prompt(ea, HEAD, passages[:2]))
    ea.store.flush()
    redis_server.kill()
    b = replica(redis_server.url())                  # starts against a dead store
    eb = b.llm_engine
    for i in range(3):
        out = _run(eb, _prompt(eb, f"Head {i}.\n" * 12, passages[i:i + 2]), GREEDY)
        assert len(out.outputs[0].token_ids) == 8
    st = eb.stats().store
    assert st.remote_errors > 0 and not st.remote_up and st.remote_hits == 0
    # the replica's own tiers still serve: these passages were computed here
    out = _run(eb, _prompt(eb, "Head again.\n" * 12, passages[2:4][::-1]))
    assert out.num_reused_tokens > 200
    # the store comes back: another replica writes to it, and b reconnects and reads from it
    redis_server.restart()
    fresh = [t[:700] for t in wiki_texts[26:28]]
    c = replica(redis_server.url())
    _run(c.llm_engine, _prompt(c.llm_engine, HEAD, fresh))
    assert c.llm_engine.store.flush()
    time.sleep(1.2)                                  # past the tier's reconnect back-off
    out = _run(eb, _prompt(eb, "Head after the restart.\n" * 12, fresh[::-1]))
    assert out.num_reused_tokens > 200 and eb.stats().store.remote_up and eb.stats().store.remote_hits >= 2
    eb.check_integrity()
    a.llm_engine.close(), eb.close(), c.llm_engine.close()


def test_a_truncated_record_is_dropped_not_loaded(smollm2, redis_server, passages):
    a, b = replica(redis_server.url()), replica(redis_server.url())
    ea, eb = a.llm_engine, b.llm_engine
    _run(ea, _prompt(ea, HEAD, passages[:2]))
    ea.store.flush()
    client = redis_server.client()
    keys = sorted(k.decode() for k in client.keys("sparsex:*"))
    assert len(keys) >= 2
    victim = keys[0]
    client.set(victim, client.get(victim)[:-100])     # truncated
    out = _run(eb, _prompt(eb, "Another head.\n" * 12, passages[:2][::-1]))
    st = eb.stats().store
    assert st.remote_corrupt == 1 and st.remote_hits >= 1
    assert 0 < out.num_reused_tokens < 2 * 150 + 50    # the intact passage only
    eb.store.flush()
    assert client.get(victim) is None or decode(client.get(victim), None)   # deleted (or rewritten whole)
    ea.close(), eb.close()


def test_two_replicas_merging_one_segment_keep_a_consistent_count(smollm2, redis_server, passages):
    a, b = replica(redis_server.url()), replica(redis_server.url())
    ea, eb = a.llm_engine, b.llm_engine
    _run(ea, _prompt(ea, HEAD, passages[:1]))                      # encoding 1, written to the store
    ea.store.flush()
    _run(eb, _prompt(eb, "Warm head.\n" * 12, passages[:1] + passages[1:2]))   # b fetches it
    exact = {"blend": False}
    # each replica computes passage 0 exactly once more, elsewhere: each folds it into the stored record
    _run(ea, _prompt(ea, "Replica A's head.\n" * 12, passages[2:3] + passages[:1]), reuse=exact)
    _run(eb, _prompt(eb, "Replica B's head.\n" * 12, passages[3:4] + passages[:1]), reuse=exact)
    assert ea.store.flush() and eb.store.flush()
    client = redis_server.client()
    key = ea.store.key(eb.tokenizer.encode(passages[0], add_special_tokens=False), None)
    record = decode(client.get(key), None)
    local = ea.segment_index.lookup(record.token_ids.tolist(), None, count=False)
    assert record.num_encodings == 3 and local.num_encodings == 2
    ea.close(), eb.close()
