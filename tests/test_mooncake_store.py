"""The Mooncake tier (sparsex/kvstore/mooncake_tier.py) against a real mooncake_master
(sparsex/bench/mooncake_server.py) and a real redis-server for its index, then two engines (replicas)
sharing segments through it. No mocks: a crash is a SIGKILL, a hung master a SIGSTOPped one, an
evicted payload one removed from the store behind the index's back."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch

from sparsex import LLM, SamplingParams
from sparsex.bench.fidelity import pieces_prompt, run_to_completion
from sparsex.config import EngineConfig
from sparsex.kvstore import record
from sparsex.kvstore.mooncake_tier import MooncakeTier, MooncakeTierStats, parse_url

FP = "0123456789abcdef"


def make_record(n: int = 8, *, seed: int = 0, salt: str | None = None, num_encodings: int = 1) -> record.SegmentRecord:
    g = torch.Generator().manual_seed(seed)
    tokens = np.arange(seed * 1000, seed * 1000 + n, dtype=np.int32)
    kv = torch.randn(2, 2, n, 2, 8, generator=g).to(torch.bfloat16)
    return record.SegmentRecord(tokens, salt, start_pos=3, num_encodings=num_encodings, explicit=True, kv=kv)


def key_of(rec: record.SegmentRecord) -> str:
    return record.record_key(rec.token_ids, rec.cache_salt, FP, rec.kv.dtype)


def new_tier(master, redis_server, *, part: str | None = None, **kw) -> MooncakeTier:
    options = {"segment": "32M", "timeout": "0.5"} | ({"part": part} if part else {})
    return MooncakeTier(master.url(**options), index_url=redis_server.url(), reconnect_s=0.3, **kw)


@pytest.fixture
def tiers(mooncake_master, redis_server):
    made: list[MooncakeTier] = []

    def make(**kw) -> MooncakeTier:
        made.append(new_tier(mooncake_master, redis_server, **kw))
        return made[-1]
    yield make
    for t in made:
        t.close()


# ---- urls and configuration (no server) ---------------------------------------------------------
@pytest.mark.unit
@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0",
    "mooncake://127.0.0.1:50051",                                               # no metadata server
    "mooncake://127.0.0.1:50051?metadata=etcd://h:2379",
    "mooncake://127.0.0.1:50051?metadata=http://h:8080/metadata&protocol=udp",
    "mooncake://127.0.0.1:50051?metadata=http://h:8080/metadata&device=mlx5_0",  # device without rdma
    "mooncake://127.0.0.1:50051?metadata=http://h:8080/metadata&segment=lots",
    "mooncake://127.0.0.1:50051?metadata=http://h:8080/metadata&timeout=0",
    "mooncake://127.0.0.1:50051?metadata=http://h:8080/metadata&part=64K",      # parts of at least 1M
    "mooncake://127.0.0.1:50051?metadata=http://h:8080/metadata&colour=red",
    "mooncake://:50051?metadata=http://h:8080/metadata",
])
def test_bad_mooncake_url_is_a_value_error_naming_it(url):
    with pytest.raises(ValueError, match="bad Mooncake url"):
        parse_url(url)


@pytest.mark.unit
def test_mooncake_url_options():
    cfg = parse_url("mooncake://10.0.0.7?metadata=http://10.0.0.7:8080/metadata&protocol=rdma&device=mlx5_0,mlx5_1"
                    "&segment=4G&buffer=64M&host=10.0.0.9&timeout=2.5&part=32M")
    assert cfg["master"] == "10.0.0.7:50051" and cfg["protocol"] == "rdma" and cfg["device"] == "mlx5_0,mlx5_1"
    assert (cfg["segment"], cfg["buffer"], cfg["host"], cfg["timeout"], cfg["part"]) == \
        (4 << 30, 64 << 20, "10.0.0.9", 2.5, 32 << 20)
    assert parse_url("mooncake://h?metadata=http://h:8080/metadata")["part"] == 16 << 20


@pytest.mark.unit
def test_engine_config_checks_the_store_and_index_urls():
    good = "mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata&protocol=tcp"
    EngineConfig(segment_store=good, segment_index="redis://127.0.0.1:6379/0")        # valid, nothing started
    with pytest.raises(ValueError, match="needs segment_index"):
        EngineConfig(segment_store=good)
    with pytest.raises(ValueError, match="index of a mooncake:// segment_store"):
        EngineConfig(segment_store="redis://127.0.0.1:6379/0", segment_index="redis://127.0.0.1:6379/1")
    with pytest.raises(ValueError, match="bad Redis url"):
        EngineConfig(segment_store=good, segment_index="http://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="bad Mooncake url 'mooncake://127.0.0.1:50051'"):
        EngineConfig(segment_store="mooncake://127.0.0.1:50051", segment_index="redis://127.0.0.1:6379/0")
    with pytest.raises(ValueError, match="redis://, rediss:// or mooncake://"):
        EngineConfig(segment_store="memcached://127.0.0.1:11211")


# ---- the tier against a real master and a real Redis -------------------------------------------
@pytest.mark.unit
def test_put_get_round_trip_zero_copy(tiers, mooncake_master, redis_server):
    a, b = tiers(), tiers()
    recs = [make_record(seed=i) for i in range(4)]
    for r in recs[::2]:
        a.put_record(key_of(r), r)                       # encoded straight into a's registered buffer
    a.put("sparsex:shared:raw", b"raw bytes")
    assert a.flush(5)
    entry = json.loads(redis_server.client().get(key_of(recs[0])))
    assert entry["p"] in mooncake_master.keys() and entry["n"] == len(record.encode(recs[0]))
    got = b.get_many([key_of(r) for r in recs] + ["sparsex:shared:raw"])
    assert [g is not None for g in got] == [True, False, True, False, True]
    assert bytes(got[4]) == b"raw bytes"
    for r, g in zip(recs[::2], got[:4:2]):
        back = record.decode(g, None, copy=False)        # a view of b's read buffer: no copy
        assert torch.equal(back.kv, r.kv) and np.array_equal(back.token_ids, r.token_ids)
        assert back.kv.data_ptr() != r.kv.data_ptr()
    s = b.stats()
    assert isinstance(s, MooncakeTierStats)
    assert (s.gets, s.hits, s.misses, s.stale, s.errors) == (5, 3, 2, 0, 0) and s.up
    assert s.bytes_read == sum(len(record.encode(r)) for r in recs[::2]) + 9
    assert b.latency() > 0 and b.bandwidth() > 0
    a.put_record(key_of(recs[0]), make_record(seed=9))    # only_if_absent: the first record stays
    assert a.flush(5)
    (again,) = b.get_many([key_of(recs[0])])
    assert torch.equal(record.decode(again, None).kv, recs[0].kv)
    assert b.get_many([]) == []


@pytest.mark.unit
def test_a_payload_larger_than_a_part_is_stored_in_parts_and_each_path_handles_them(tiers, mooncake_master,
                                                                                   redis_server):
    """part=1M: a 3.6 MB record is 4 objects (payload#0..#3), written in one batch and read back whole by
    another replica; a merge reads the parts and replaces them all; one part gone makes the record a
    stale miss whose entry and remaining parts are removed."""
    a, b = tiers(part="1M"), tiers(part="1M")
    rec = make_record(n=28_000, seed=11)                  # 128 bytes a token: 3.6 MB
    key = key_of(rec)
    a.put_record(key, rec)
    assert a.flush(10)
    entry = json.loads(redis_server.client().get(key))
    objects = sorted(k for k in mooncake_master.keys() if k.startswith(key + "@"))
    assert entry["s"] == 1 << 20 and objects == [f"{entry['p']}#{i}" for i in range(4)]
    (got,) = b.get_many([key])
    back = record.decode(got, None, copy=False)
    assert torch.equal(back.kv, rec.kv) and np.array_equal(back.token_ids, rec.token_ids)
    assert b.stats().bytes_read == entry["n"] == len(record.encode(rec))

    def bump(cur) -> bytes:
        old = record.decode(cur, None)                    # the merge read every part
        return record.encode(make_record(n=28_000, seed=11, num_encodings=old.num_encodings + 1))
    b.merge(key, bump)
    assert b.flush(10)
    new = json.loads(redis_server.client().get(key))
    assert new["v"] == 2 and new["p"] != entry["p"]
    (got,) = a.get_many([key])
    assert record.decode(got, None).num_encodings == 2
    deadline = time.monotonic() + 10                      # the old parts go once their leases end
    while time.monotonic() < deadline and any(k.startswith(entry["p"]) for k in mooncake_master.keys()):
        time.sleep(0.2)
    assert sorted(k for k in mooncake_master.keys() if k.startswith(key + "@")) == \
        [f"{new['p']}#{i}" for i in range(4)]
    assert a._client.remove(f"{new['p']}#2", True) == 0   # one part evicted behind the index's back
    assert b.get_many([key]) == [None] and b.stats().stale == 1
    assert b.flush(5) and redis_server.client().get(key) is None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(k.startswith(key + "@") for k in mooncake_master.keys()):
        time.sleep(0.2)
    assert not any(k.startswith(key + "@") for k in mooncake_master.keys())


@pytest.mark.unit
def test_concurrent_merges_from_two_writers_lose_no_update(tiers, mooncake_master, redis_server):
    """Two replicas fold 20 encodings each into one record: every merge counts (num_encodings 40), and
    the payloads the index no longer names are removed from the store."""
    rec = make_record(seed=3)
    key = key_of(rec)

    def add_one(cur) -> bytes:
        old = record.decode(cur, None) if cur is not None else None
        time.sleep(0.001)                                 # widen the WATCH..EXEC window: real races
        return record.encode(make_record(seed=3, num_encodings=1 if old is None else old.num_encodings + 1))

    writers = [tiers(), tiers()]
    threads = [threading.Thread(target=lambda t=t: [t.merge(key, add_one) for _ in range(20)]) for t in writers]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert all(t.flush(30) for t in writers)
    (got,) = writers[0].get_many([key])
    assert record.decode(got, None).num_encodings == 40
    stats = [t.stats() for t in writers]
    assert all(s.errors == 0 and s.writes_dropped == 0 for s in stats)
    print("cas_retries", [s.cas_retries for s in stats])
    current = json.loads(redis_server.client().get(key))["p"]
    deadline = time.monotonic() + 10                       # superseded payloads go once their leases end
    while time.monotonic() < deadline:
        left = [k for k in mooncake_master.keys() if k.startswith(key + "@")]
        if left == [current]:
            break
        time.sleep(0.2)
    assert left == [current]


@pytest.mark.unit
def test_payload_gone_between_lookup_and_fetch_is_a_counted_miss(tiers, mooncake_master, redis_server):
    a, b = tiers(), tiers()
    rec = make_record(seed=4)
    admin, seen = redis_server.client(), []
    a.put_record(key_of(rec), rec, on_stored=lambda: seen.append(("stored", admin.exists(key_of(rec)))))
    assert a.flush(5)
    payload = json.loads(admin.get(key_of(rec)))["p"]
    client = a._client                                    # the store evicts it: the index still names it
    assert client.remove(payload, True) == 0
    assert b.get_many([key_of(rec)]) == [None]
    s = b.stats()
    assert (s.misses, s.stale, s.errors) == (1, 1, 0) and s.up
    # what follows the drop of the stale entry (the anchor index's removals) runs after it
    assert b.after_writes(lambda: seen.append(("after the drop", admin.exists(key_of(rec)))))
    assert b.flush(5) and admin.get(key_of(rec)) is None  # the stale entry is dropped
    assert seen == [("stored", 1), ("after the drop", 0)]
    a.put_record(key_of(rec), rec)                        # and the next writer stores it again
    assert a.flush(5)
    (got,) = b.get_many([key_of(rec)])
    assert torch.equal(record.decode(got, None).kv, rec.kv)


@pytest.mark.unit
def test_truncated_or_corrupt_payload_is_rejected_and_dropped(tiers, mooncake_master, redis_server):
    a = tiers()
    recs = [make_record(seed=5), make_record(seed=6)]
    blobs = [record.encode(r) for r in recs]
    a.put(key_of(recs[0]), blobs[0][:-7])                 # truncated
    flipped = bytearray(blobs[1])
    flipped[-3] ^= 0xFF                                   # one corrupt byte
    a.put(key_of(recs[1]), bytes(flipped))
    assert a.flush(5)
    got = a.get_many([key_of(r) for r in recs])
    for g in got:
        with pytest.raises(record.CorruptRecord):
            record.decode(g, None)
    for r in recs:
        a.count_corrupt(key_of(r))
    assert a.flush(5)
    assert a.stats().corrupt == 2
    assert redis_server.client().get(key_of(recs[0])) is None and redis_server.client().get(key_of(recs[1])) is None
    assert a.get_many([key_of(r) for r in recs]) == [None, None]


@pytest.mark.unit
def test_master_killed_mid_run_fails_soft_then_serves_again(tiers, mooncake_master):
    a = tiers()
    rec = make_record(seed=7)
    a.put_record(key_of(rec), rec)
    assert a.flush(5) and a.get_many([key_of(rec)])[0] is not None

    mooncake_master.kill()
    t0 = time.perf_counter()
    assert a.get_many([key_of(rec), "sparsex:shared:none"]) == [None, None]
    assert time.perf_counter() - t0 < 0.5 + 0.3            # within the tier's timeout
    s = a.stats()
    assert s.errors >= 1 and not s.payload_up and s.index_up and s.misses == 2
    for i in range(3):                                      # never raises, never blocks
        a.put_record(f"sparsex:shared:p{i}", rec)
        a.merge("sparsex:shared:m", lambda cur: b"1")
    assert a.flush(5)
    assert a.stats().writes_dropped >= 6 and a.stats().bytes_written == s.bytes_written

    mooncake_master.start()                                 # the same ports, empty: what it held is gone
    deadline = time.monotonic() + 20                        # the client re-registers with the new master
    while time.monotonic() < deadline:
        time.sleep(0.35)                                    # past reconnect_s
        a.put_record(key_of(make_record(seed=8)), make_record(seed=8))
        a.flush(5)
        if a.get_many([key_of(make_record(seed=8))])[0] is not None:
            break
    assert a.stats().payload_up
    assert a.get_many([key_of(rec)]) == [None]              # its index entry outlived the payload: stale
    assert a.stats().stale >= 1


@pytest.mark.unit
def test_hung_master_times_out(tiers, mooncake_master):
    a = tiers()
    rec = make_record(seed=10)
    a.put_record(key_of(rec), rec)
    assert a.flush(5)
    mooncake_master.pause()
    try:
        t0 = time.perf_counter()
        assert a.get_many([key_of(rec)]) == [None]
        assert time.perf_counter() - t0 < 0.5 + 0.5        # the read timeout, not the master's
        s = a.stats()
        assert s.timeouts == 1 and not s.payload_up
        t0 = time.perf_counter()
        assert a.get_many([key_of(rec)]) == [None]         # down: not even tried
        assert time.perf_counter() - t0 < 0.1
    finally:
        mooncake_master.resume()
    deadline = time.monotonic() + 10                       # the stuck call returns, the tier serves again
    while a.get_many([key_of(rec)])[0] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert a.stats().payload_up and a.stats().hits == 1


@pytest.mark.unit
def test_index_down_is_a_miss_and_payloads_are_untouched(tiers, mooncake_master, redis_server):
    a = tiers()
    rec = make_record(seed=11)
    a.put_record(key_of(rec), rec)
    assert a.flush(5)
    before = mooncake_master.keys()
    redis_server.kill()
    assert a.get_many([key_of(rec)]) == [None]
    s = a.stats()
    assert s.errors == 1 and not s.index_up and s.payload_up and not s.up
    a.put_record(key_of(make_record(seed=12)), make_record(seed=12))
    assert a.flush(5) and a.stats().writes_dropped == 1
    assert mooncake_master.keys() == before


# ---- two engines (replicas) on one master ------------------------------------------------------
ONE = SamplingParams(temperature=0.0, max_tokens=1)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
HEAD = "System: answer from the passages.\n\n" * 20
Q = "\nQuestion: which passage is the oldest? Answer:"


@pytest.fixture(scope="module")
def passages(wiki_texts):
    return [t[:700] for t in wiki_texts[20:24]]


def replica(master, redis_server, **kw) -> LLM:
    return LLM(cache="sparsex", num_blocks=400, segment_store=master.url(segment="128M", timeout="0.5"),
               segment_index=redis_server.url(), segment_store_fetch="always", min_blend_tokens=0,
               **{"dtype": "float32", "transparent_segments": False, **kw})


def _prompt(eng, head, passages, salt=None):
    p = pieces_prompt(eng, [head, *passages, Q], [True] * (len(passages) + 1) + [False])
    p.cache_salt = salt
    return p


def _run(eng, prompt, params=ONE, reuse=None):
    out, _ = run_to_completion(eng, prompt, params, reuse=reuse)
    return out


@pytest.mark.model
def test_a_segment_computed_on_one_replica_is_served_to_a_cold_one(smollm2, mooncake_master, redis_server, passages):
    a, b = replica(mooncake_master, redis_server), replica(mooncake_master, redis_server)
    ea, eb = a.llm_engine, b.llm_engine
    try:
        assert eb.store.remote_kind == "mooncake"
        _run(ea, _prompt(ea, HEAD, passages[:3]))
        assert ea.store.flush() and ea.stats().store.remote_bytes_written > 0
        assert len([k for k in mooncake_master.keys() if k.startswith("sparsex:")]) >= 3
        p = _prompt(eb, "Another head.\n" * 12, passages[:3][::-1])
        out = _run(eb, p, GREEDY, reuse={"selector": "all"})
        st = eb.stats().store
        assert st.remote_hits >= 3 and st.installed_tokens > 300 and out.num_reused_tokens > 300
        assert eb.store.policy.load_bytes_per_s() > 0 and eb.store.remote.bandwidth() > 0
        want = _run(ea, p, GREEDY, reuse={"selector": "all"})
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        eb.check_integrity()
    finally:
        ea.close(), eb.close()


@pytest.mark.model
def test_tenants_never_meet_and_another_model_layout_is_never_used(smollm2, mooncake_master, redis_server, passages):
    a, b = replica(mooncake_master, redis_server), replica(mooncake_master, redis_server)
    c = replica(mooncake_master, redis_server, dtype="bfloat16")         # another KV layout under the same index
    ea, eb, ec = a.llm_engine, b.llm_engine, c.llm_engine
    try:
        _run(ea, _prompt(ea, HEAD, passages[:2], salt="tenant-1"))
        _run(ec, _prompt(ec, HEAD, passages[2:4]))
        assert ea.store.flush() and ec.store.flush()
        other = _run(eb, _prompt(eb, "Another head.\n" * 12, passages[:2][::-1], salt="tenant-2"))
        assert other.num_reused_tokens == 0 and eb.stats().store.remote_hits == 0
        same = _run(eb, _prompt(eb, "A third head.\n" * 12, passages[:2][::-1], salt="tenant-1"))
        assert same.num_reused_tokens > 200 and eb.stats().store.remote_hits >= 2      # the positive control
        # the bfloat16 replica's records live under its own keys: the float32 replica never fetches them ...
        hits = eb.stats().store.remote_hits
        plain = _run(eb, _prompt(eb, "A fourth head.\n" * 12, passages[2:3]))
        assert plain.num_reused_tokens == 0 and eb.stats().store.remote_hits == hits
        # ... and one forged under a float32 key (a colliding or misconfigured publisher) is rejected, not loaded
        admin = redis_server.client()
        tok = eb.tokenizer
        ids = tok.encode(passages[3], add_special_tokens=False)
        admin.set(eb.store.key(ids, None), admin.get(ec.store.key(ids, None)))
        out = _run(eb, _prompt(eb, "A fifth head.\n" * 12, passages[3:4]), GREEDY)
        assert len(out.outputs[0].token_ids) == 8 and out.num_reused_tokens == 0
        assert eb.stats().store.remote_corrupt == 1
    finally:
        ea.close(), eb.close(), ec.close()


@pytest.mark.model
def test_master_killed_mid_run_never_fails_a_request(smollm2, mooncake_master, redis_server, passages):
    a, b = replica(mooncake_master, redis_server), replica(mooncake_master, redis_server)
    ea, eb = a.llm_engine, b.llm_engine
    try:
        _run(ea, _prompt(ea, HEAD, passages[:2]))
        assert ea.store.flush()
        mooncake_master.kill()
        for i in range(2):
            out = _run(eb, _prompt(eb, f"Head {i}.\n" * 12, passages[i:i + 2]), GREEDY)
            assert len(out.outputs[0].token_ids) == 8
        st = eb.stats().store
        assert st.remote_errors > 0 and not st.remote_up and st.remote_hits == 0
        out = _run(eb, _prompt(eb, "Head again.\n" * 12, passages[1:3][::-1]))      # its own pool still serves
        assert out.num_reused_tokens > 200
    finally:
        mooncake_master.start()                 # a live master lets both clients leave at once
        ea.close(), eb.close()


@pytest.mark.model
def test_a_span_one_replica_computed_is_blended_by_another_through_mooncake(smollm2, mooncake_master, redis_server,
                                                                           wiki_texts):
    """segment_store_spans over mooncake://: the anchors in the Redis index, the payload in Mooncake.
    Replica a computes a passage inside a one-message prompt; replica b finds it by content inside
    another, fetches it from Mooncake, verifies and blends it, and answers as a replica that computed
    the passage itself."""
    passage = wiki_texts[5][:800]

    def message(i: int, text: str, question: str) -> list[dict]:
        intro = f"Note {i}: read the passage below with care before you answer. " * 14
        return [{"role": "user", "content": f"{intro}\n\nPassage:\n{text}\n\nQuestion {i}: {question}"}]
    first = message(1, passage, "Who is it about?")
    later = message(3, "Some more words first. " * 5 + passage, "When did it happen?")
    spans = dict(segment_store_spans=True, transparent_segments=True)
    a, b = replica(mooncake_master, redis_server, **spans), replica(mooncake_master, redis_server, **spans)
    local = LLM(cache="sparsex", dtype="float32", num_blocks=400, min_blend_tokens=0)
    try:
        a.chat(first, GREEDY, use_tqdm=False)
        assert a.llm_engine.store.flush() and a.llm_engine.stats().store.span_anchors_published > 20
        out = b.chat(later, GREEDY, use_tqdm=False)[0]
        st = b.llm_engine.stats().store
        assert st.remote_kind == "mooncake" and st.span_installed == 1 and st.span_rejected == 0
        assert st.remote_hits >= 1 and st.remote_errors == 0
        assert sum(s.end - s.start for s in out.reused_spans if s.source == "indexed") > 120
        local.chat(first, GREEDY, use_tqdm=False)            # the positive control: computed here
        want = local.chat(later, GREEDY, use_tqdm=False)[0]
        assert out.num_reused_tokens == want.num_reused_tokens > 120
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        b.llm_engine.check_integrity()
    finally:
        for e in (a, b, local):
            e.llm_engine.close()
