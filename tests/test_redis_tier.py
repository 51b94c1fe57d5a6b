"""The Redis tier (sparsex/kvstore/redis_tier.py) against a real redis-server (sparsex/bench/redis_server.py), the
anchor index's removal of stale references (sparsex/kvstore/anchor_index.py), and the fetch-or-recompute
policy (sparsex/kvstore/fetch_policy.py). No mocks: crashes are SIGKILLs, a hung server is a SIGSTOPped one,
eviction is the server's own maxmemory policy, a race is two real clients racing."""
from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch

from sparsex.bench import redis_server as rs
from sparsex.kvstore import record
from sparsex.kvstore.anchor_index import ANCHOR_TAG, AnchorIndex, record_prefix
from sparsex.kvstore.fetch_policy import FetchDecision, FetchPolicy
from sparsex.kvstore.redis_tier import RedisTier, RedisTierStats
from sparsex.segment.span_index import anchors

pytestmark = pytest.mark.unit

needs_redis = pytest.mark.skipif(not rs.available(), reason="redis-server not installed (make install)")

FP = "0123456789abcdef"


def make_record(n: int = 8, *, seed: int = 0, salt: str | None = None, num_encodings: int = 1,
                layers: int = 2, heads: int = 2, head_dim: int = 8) -> record.SegmentRecord:
    g = torch.Generator().manual_seed(seed)
    tokens = np.arange(seed * 1000, seed * 1000 + n, dtype=np.int32)
    kv = torch.randn(layers, 2, n, heads, head_dim, generator=g).to(torch.bfloat16)
    return record.SegmentRecord(tokens, salt, start_pos=3, num_encodings=num_encodings, explicit=True, kv=kv)


def key_of(rec: record.SegmentRecord) -> str:
    return record.record_key(rec.token_ids, rec.cache_salt, FP, rec.kv.dtype)


@pytest.fixture
def tier(redis_server):
    t = RedisTier(redis_server.url(), timeout_s=0.3, reconnect_s=0.2)
    yield t
    t.close()


@needs_redis
def test_put_get_round_trip_of_an_encoded_record(tier, redis_server):
    rec = make_record(seed=1)
    key, blob = key_of(rec), record.encode(rec)
    tier.put(key, blob)
    assert tier.flush(5)
    assert redis_server.client().get(key) == blob
    (got,) = tier.get_many([key])
    back = record.decode(got, None)
    assert np.array_equal(back.token_ids, rec.token_ids) and torch.equal(back.kv, rec.kv)
    assert (back.start_pos, back.num_encodings, back.explicit) == (3, 1, True)
    s = tier.stats()
    assert isinstance(s, RedisTierStats)
    assert (s.gets, s.hits, s.misses, s.errors) == (1, 1, 0, 0) and s.up
    assert s.bytes_read == s.bytes_written == len(blob) and s.fetch_seconds_total > 0
    assert tier.latency() is not None and tier.bandwidth() is not None and tier.bandwidth() > 0


@needs_redis
def test_only_if_absent_keeps_the_first_value(tier):
    tier.put("sparsex:shared:k", b"first")
    tier.put("sparsex:shared:k", b"second")                       # SET NX: not written
    assert tier.flush(5)
    assert tier.get_many(["sparsex:shared:k"]) == [b"first"]
    tier.put("sparsex:shared:k", b"third", only_if_absent=False)  # plain SET overwrites
    assert tier.flush(5)
    assert tier.get_many(["sparsex:shared:k"]) == [b"third"]


@needs_redis
def test_get_many_mixes_hits_and_misses_in_one_round_trip(tier, redis_server):
    recs = [make_record(seed=i) for i in range(6)]
    for r in recs[::2]:
        tier.put(key_of(r), record.encode(r))
    assert tier.flush(5)
    admin = redis_server.client()
    admin.config_resetstat()
    got = tier.get_many([key_of(r) for r in recs])
    assert [g is not None for g in got] == [True, False] * 3
    for r, g in zip(recs[::2], got[::2]):
        assert torch.equal(record.decode(g, None).kv, r.kv)
    stats = admin.info("commandstats")
    assert stats["cmdstat_mget"]["calls"] == 1 and "cmdstat_get" not in stats
    assert tier.get_many([]) == []
    s = tier.stats()
    assert (s.gets, s.hits, s.misses) == (6, 3, 3)


@needs_redis
def test_server_killed_mid_run_fails_soft_then_reconnects(redis_server):
    tier = RedisTier(redis_server.url(), timeout_s=0.3, reconnect_s=0.5)
    try:
        _killed_mid_run(tier, redis_server)
    finally:
        tier.close()


def _killed_mid_run(tier: RedisTier, redis_server: rs.RedisServer) -> None:
    tier.put("sparsex:shared:a", b"A")
    assert tier.flush(5) and tier.get_many(["sparsex:shared:a"]) == [b"A"]

    redis_server.kill()
    t0 = time.perf_counter()
    assert tier.get_many(["sparsex:shared:a", "sparsex:shared:b"]) == [None, None]
    assert time.perf_counter() - t0 < 0.3 + 0.2            # within one timeout (refused: at once)
    s = tier.stats()
    assert s.errors == 1 and not s.up and s.misses == 2
    assert tier.get_many(["sparsex:shared:a"]) == [None]    # down: not even tried
    assert tier.stats().errors == 1
    for i in range(5):
        tier.put(f"sparsex:shared:p{i}", b"x" * 100)        # never raises, never blocks
        tier.merge("sparsex:shared:m", lambda cur: b"1")
    tier.count_corrupt("sparsex:shared:a")
    assert tier.flush(5)
    assert tier.stats().writes_dropped == 11

    redis_server.start()                                     # the same port, empty (no persistence)
    time.sleep(0.55)                                         # past reconnect_s
    assert tier.get_many(["sparsex:shared:a"]) == [None]     # a real miss now: the server answered
    assert tier.stats().up and tier.stats().errors == 1
    tier.put("sparsex:shared:a", b"again")
    assert tier.flush(5)
    assert tier.get_many(["sparsex:shared:a"]) == [b"again"]


@needs_redis
def test_writes_to_a_dead_server_are_counted_by_the_writer(redis_server):
    """The server dies while the tier still thinks it is up: the writer's own attempt fails, counts."""
    tier = RedisTier(redis_server.url(), timeout_s=0.3, reconnect_s=60)
    try:
        assert tier.get_many(["x"]) == [None]
        redis_server.kill()
        tier.put("sparsex:shared:x", b"v")                   # queued (up), the send fails
        tier.put("sparsex:shared:y", b"v")                   # dropped: down by then, or queued and skipped
        assert tier.flush(5)
        s = tier.stats()
        assert s.writes_dropped == 2 and s.errors == 1 and not s.up and s.bytes_written == 0
    finally:
        tier.close()


@needs_redis
def test_hung_server_times_out(redis_server):
    tier = RedisTier(redis_server.url(), timeout_s=0.2, reconnect_s=0.1)
    pid = redis_server.proc.pid
    try:
        assert tier.get_many(["k"]) == [None]
        os.kill(pid, signal.SIGSTOP)                         # accepts nothing, answers nothing
        t0 = time.perf_counter()
        assert tier.get_many(["k"]) == [None]
        assert 0.15 < time.perf_counter() - t0 < 1.0
        assert tier.stats().errors == 1
    finally:
        os.kill(pid, signal.SIGCONT)
        tier.close()


@needs_redis
def test_put_over_the_pending_limit_is_dropped(redis_server):
    tier = RedisTier(redis_server.url(), max_pending_bytes=1000)
    try:
        tier.put("sparsex:shared:big", b"x" * 2000)         # alone more than the queue may hold
        tier.put("sparsex:shared:small", b"y" * 100)
        assert tier.flush(5)
        assert tier.stats().writes_dropped == 1
        assert tier.get_many(["sparsex:shared:big", "sparsex:shared:small"]) == [None, b"y" * 100]
    finally:
        tier.close()


@needs_redis
def test_truncated_value_is_rejected_and_deleted(tier, redis_server):
    rec = make_record(seed=2)
    key = key_of(rec)
    blob = record.encode(rec)
    tier.put(key, blob[:-7])
    assert tier.flush(5)
    (got,) = tier.get_many([key])
    with pytest.raises(record.CorruptRecord):
        record.decode(got, None)
    tier.count_corrupt(key)
    assert tier.flush(5)
    assert tier.stats().corrupt == 1
    assert redis_server.client().exists(key) == 0
    assert tier.get_many([key]) == [None]
    tier.count_corrupt()                                     # no key: only counted
    assert tier.stats().corrupt == 2


@needs_redis
def test_on_stored_and_after_writes_run_on_the_writer_in_order(tier, redis_server):
    """What must follow a write (the anchor index's writes) runs after it, and never after a dropped one."""
    admin, seen = redis_server.client(), []
    rec = make_record(seed=20)
    key = key_of(rec)
    tier.put_record(key, rec, on_stored=lambda: seen.append(("stored", admin.exists(key))))
    tier.put_record(key, make_record(seed=21), on_stored=lambda: seen.append(("present", admin.exists(key))))
    tier.count_corrupt(key)                                  # queues the DEL ...
    assert tier.after_writes(lambda: seen.append(("after the DEL", admin.exists(key))))     # ... this runs after it
    assert tier.flush(5)
    assert seen == [("stored", 1), ("present", 1), ("after the DEL", 0)]
    small = RedisTier(redis_server.url(), max_pending_bytes=100)
    try:
        small.put("sparsex:shared:big", b"x" * 200, on_stored=lambda: seen.append("dropped"))
        assert small.flush(5) and "dropped" not in seen and small.stats().writes_dropped == 1
    finally:
        small.close()
    redis_server.kill()
    tier.put("sparsex:shared:k", b"v", on_stored=lambda: seen.append("failed"))   # sent, refused: not run
    assert tier.flush(5) and "failed" not in seen
    assert not tier.after_writes(lambda: seen.append("down"))                   # down: not queued, not a write
    assert tier.flush(5) and "down" not in seen and tier.stats().writes_dropped == 1


def _anchor_refs(admin, prefix: str, seg: str) -> int:
    return sum(v.decode().startswith(seg + ":") for k in admin.keys(prefix + ANCHOR_TAG + "*")
               for v in admin.lrange(k, 0, -1))


@needs_redis
def test_references_to_a_gone_record_are_removed_unless_it_is_back(redis_server):
    admin = redis_server.client()
    index = AnchorIndex(redis_server.url())
    tokens = [np.random.default_rng(i).integers(0, 30000, 200, dtype=np.int32) for i in range(2)]
    keys = [record.record_key(t, None, FP, torch.float32) for t in tokens]
    prefix, seg = record_prefix(keys[0])
    try:
        for key, toks in zip(keys, tokens):
            admin.set(key, b"record")
            index.publish(key, toks)
        hashes = anchors(tokens[0])[1].tolist()
        found = index.lookup(prefix, hashes)
        followed = [(h, r) for h, refs in zip(hashes, found) for r in refs if r.segment_hash == seg]
        assert len(followed) == len(hashes) > 10 and _anchor_refs(admin, prefix, seg) == len(hashes)
        assert index.forget(keys[0], followed) == 0                  # the record is there: nothing removed
        assert index.stats().kept_refs == len(followed) and _anchor_refs(admin, prefix, seg) == len(hashes)
        admin.delete(keys[0])                                         # evicted
        half = followed[: len(followed) // 2]                         # the anchors one prompt followed
        assert index.forget(keys[0], half) == len(half)
        assert _anchor_refs(admin, prefix, seg) == len(hashes) - len(half)
        other = _anchor_refs(admin, prefix, record_prefix(keys[1])[1])
        assert other == len(anchors(tokens[1])[1])                   # another record's references stay
        s = index.stats()
        assert (s.forgotten_records, s.removed_refs, s.errors) == (1, len(half), 0)
    finally:
        index.close()


@needs_redis
def test_a_record_stored_again_during_a_removal_keeps_its_references(redis_server):
    """A replica finds a record gone and removes its references while another stores it again (the
    tier's order: the record, then its anchors): wherever the record ends up present, its references are
    there too (WATCH on the record aborts a removal that a concurrent store overtakes)."""
    admin = redis_server.client()
    toks = np.random.default_rng(7).integers(0, 30000, 64, dtype=np.int32)
    key = record.record_key(toks, None, FP, torch.float32)
    prefix, seg = record_prefix(key)
    hashes = anchors(toks)[1].tolist()
    publisher, remover = AnchorIndex(redis_server.url()), AnchorIndex(redis_server.url())
    store = redis_server.client()
    try:
        publisher.publish(key, toks)
        followed = [(h, r) for h, refs in zip(hashes, publisher.lookup(prefix, hashes)) for r in refs]
        for _ in range(400):
            admin.delete(key)                                        # evicted, its references still there
            go = threading.Barrier(2)

            def store_again():
                go.wait()
                time.sleep(random.uniform(0, 0.0004))                 # either may go first
                store.set(key, b"record")
                publisher.publish(key, toks)
            th = threading.Thread(target=store_again)
            th.start()
            go.wait()
            remover.forget(key, followed)
            th.join()
            assert admin.exists(key) and _anchor_refs(admin, prefix, seg) == len(hashes)
        s = remover.stats()
        print("removals", s.forgotten_records, "kept", s.kept_refs // len(followed))
        assert s.errors == 0 and s.forgotten_records + s.kept_refs // len(followed) == 400
    finally:
        publisher.close(), remover.close()


@needs_redis
def test_maxmemory_evicts_older_keys_and_an_evicted_key_is_a_plain_miss():
    with rs.RedisServer(maxmemory="2mb", policy="allkeys-lru") as srv:
        tier = RedisTier(srv.url())
        try:
            keys = [f"sparsex:shared:seg{i}" for i in range(48)]
            for i, k in enumerate(keys):                         # 48 x 64 KiB = 3 MiB into 2 MB
                tier.put(k, bytes([i]) * (64 << 10))
                assert tier.flush(5)                             # in order: older keys are less recent
            got = tier.get_many(keys)
            present = [g is not None for g in got]
            assert not present[0] and present[-1]
            assert got[-1] == bytes([47]) * (64 << 10)
            assert srv.client().info("stats")["evicted_keys"] > 0
            s = tier.stats()
            assert s.errors == 0 and s.writes_dropped == 0 and s.misses == present.count(False) > 0
        finally:
            tier.close()


@needs_redis
def test_concurrent_merges_lose_no_update(redis_server):
    """Two replicas fold 50 encodings each into one record: every merge counts (num_encodings 100)."""
    rec = make_record(seed=3)
    key = key_of(rec)

    def add_one(cur: bytes | None) -> bytes:
        old = record.decode(cur, None) if cur is not None else None
        time.sleep(0.0005)                                   # widen the WATCH..EXEC window: real races
        n = 1 if old is None else old.num_encodings + 1
        return record.encode(make_record(seed=3, num_encodings=n))

    tiers = [RedisTier(redis_server.url(), timeout_s=1.0) for _ in range(2)]
    try:
        def replica(t: RedisTier) -> None:
            for _ in range(50):
                t.merge(key, add_one)
        threads = [threading.Thread(target=replica, args=(t,)) for t in tiers]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert all(t.flush(20) for t in tiers)
        assert record.decode(redis_server.client().get(key), None).num_encodings == 100
        stats = [t.stats() for t in tiers]
        assert all(s.errors == 0 and s.writes_dropped == 0 for s in stats)
        print("cas_retries", [s.cas_retries for s in stats])
    finally:
        for t in tiers:
            t.close()


@needs_redis
def test_merge_update_returning_none_writes_nothing(tier, redis_server):
    tier.merge("sparsex:shared:m", lambda cur: None)
    tier.merge("sparsex:shared:n", lambda cur: b"1" if cur is None else None)
    tier.merge("sparsex:shared:n", lambda cur: b"1" if cur is None else None)
    assert tier.flush(5)
    assert redis_server.client().exists("sparsex:shared:m") == 0
    assert redis_server.client().get("sparsex:shared:n") == b"1"
    assert tier.stats().bytes_written == 1


@needs_redis
def test_password_protected_server_and_acl_user():
    users = {"tenant": ("tpw", "~sparsex:shared:* +@all")}
    with rs.RedisServer(password="s3cret pass".replace(" ", "-"), acl_users=users) as srv:
        good = RedisTier(srv.url(), timeout_s=0.3)
        anon = RedisTier(srv.url(password=None), timeout_s=0.3)
        wrong = RedisTier(srv.url(password="nope"), timeout_s=0.3)
        acl = RedisTier(srv.url(user="tenant", password="tpw"), timeout_s=0.3)
        try:
            good.put("sparsex:shared:k", b"v")
            assert good.flush(5) and good.get_many(["sparsex:shared:k"]) == [b"v"]
            for bad in (anon, wrong):                             # NOAUTH / WRONGPASS: soft, counted
                assert bad.get_many(["sparsex:shared:k"]) == [None]
                bad.put("sparsex:shared:k2", b"v")
                assert bad.flush(5)
                s = bad.stats()
                assert s.errors == 1 and not s.up and s.writes_dropped == 1
            assert acl.get_many(["sparsex:shared:k"]) == [b"v"]
            assert acl.get_many(["sparsex:0badc0ffee0badc0:k"]) == [None]   # another tenant's key: refused
            assert acl.stats().errors == 1 and acl.stats().up        # NOPERM: counted, the tier stays up
            # a refused write is counted and dropped; the next write, to its own prefix, still lands
            acl.put("sparsex:0badc0ffee0badc0:w", b"x")
            assert acl.flush(5)
            acl.put("sparsex:shared:w", b"y")
            assert acl.flush(5)
            s = acl.stats()
            assert (s.errors, s.writes_dropped, s.up) == (2, 1, True)
            assert good.get_many(["sparsex:shared:w", "sparsex:0badc0ffee0badc0:w"]) == [b"y", None]
            assert "s3cret" not in repr(good)
        finally:
            for t in (good, anon, wrong, acl):
                t.close()


@pytest.mark.parametrize("url", ["http://127.0.0.1:6379/0", "redis://:pw@/0", "redis://h:notaport/0",
                                 "redis://h:6379/db1", "", "redis://h:6379/0?ssl=1"])
def test_bad_url_is_a_value_error_naming_it(url):
    with pytest.raises(ValueError, match="bad Redis url"):
        RedisTier(url)


def test_rediss_url_takes_tls_options_and_fails_soft_without_a_server():
    tier = RedisTier("rediss://user:pw@127.0.0.1:1/2?ssl_cert_reqs=none", timeout_s=0.2)
    try:
        assert tier.where == "127.0.0.1:1/2"
        assert tier.get_many(["k"]) == [None] and tier.stats().errors == 1
    finally:
        tier.close()
    with pytest.raises(ValueError, match="rediss:// takes ssl_"):
        RedisTier("rediss://127.0.0.1:6379/0?socket_timeout=30")


def test_bad_url_error_hides_the_password():
    with pytest.raises(ValueError) as e:
        RedisTier("http://user:hunter2@host:6379/0")
    assert "hunter2" not in str(e.value) and "user:***@host" in str(e.value)


@needs_redis
def test_measured_estimates_feed_the_policy(tier):
    tier.get_many(["sparsex:shared:none"])                   # a miss: a latency sample, no bandwidth
    assert tier.latency() is not None and tier.bandwidth() is None
    tier.put("sparsex:shared:big", b"z" * (1 << 20))
    assert tier.flush(5)
    for _ in range(3):
        tier.get_many(["sparsex:shared:big"])
    bw, lat = tier.bandwidth(), tier.latency()
    assert bw is not None and bw > 1e6 and 0 < lat < 0.3
    policy = FetchPolicy("auto")
    policy.observe_prefill(1000, 1.0)                        # a slow prefill: 1000 tok/s
    assert policy.decide(256, 1 << 20, bw, lat).fetch


def test_fetch_policy_modes():
    with pytest.raises(ValueError):
        FetchPolicy("sometimes")
    always, never = FetchPolicy("always"), FetchPolicy("never")
    for _ in range(2):
        assert always.decide(10, 10 << 20, 1.0, 1.0).fetch            # even when absurdly slow
        assert not never.decide(10_000, 10, 1e12, 0.0).fetch
    assert (always.fetched, always.recomputed, never.fetched, never.recomputed) == (2, 0, 0, 2)


def test_fetch_policy_auto_fetches_until_measured_then_flips_on_low_bandwidth():
    p = FetchPolicy("auto")
    d = p.decide(256, 1 << 20, None, None)
    assert isinstance(d, FetchDecision) and d.fetch and "unmeasured" in d.reason
    assert p.decide(256, 1 << 20, 1e9, 0.001).fetch                  # no prefill throughput yet
    p.observe_prefill(2000, 1.0)
    p.observe_prefill(0, 0.0)                                          # ignored
    assert p.prefill_tokens_per_s() == pytest.approx(2000)
    fast = p.decide(256, 1 << 20, bandwidth=1e9, latency=0.001)        # ~2 ms against 128 ms
    assert fast.fetch and fast.est_fetch_s == pytest.approx(0.001 + (1 << 20) / 1e9)
    assert fast.est_recompute_s == pytest.approx(0.128)
    slow = p.decide(256, 1 << 20, bandwidth=1e6, latency=0.001)        # ~1 s against 128 ms
    assert not slow.fetch and slow.est_fetch_s > slow.est_recompute_s
    assert not p.decide(256, 1 << 20, bandwidth=1e9, latency=0.5).fetch   # a far store: latency dominates
    assert (p.fetched, p.recomputed) == (3, 2)
    for _ in range(30):                                                # a faster engine: recompute wins
        p.observe_prefill(200_000, 1.0)
    assert not p.decide(256, 1 << 20, bandwidth=1e8, latency=0.001).fetch


def test_fetch_policy_counts_decode_and_install_once_measured():
    p = FetchPolicy("auto")
    p.observe_prefill(2000, 1.0)                                      # 256 tokens: 128 ms to recompute
    assert p.load_bytes_per_s() is None
    assert p.decide(256, 1 << 20, bandwidth=1e9, latency=0.001).fetch  # transfer alone: ~2 ms
    p.observe_load(1 << 20, 0.2)                                      # decode + install: 200 ms per MB
    p.observe_load(0, 1.0)                                            # ignored
    assert p.load_bytes_per_s() == pytest.approx((1 << 20) / 0.2)
    d = p.decide(256, 1 << 20, bandwidth=1e9, latency=0.001)
    assert not d.fetch and d.est_fetch_s == pytest.approx(0.001 + (1 << 20) / 1e9 + 0.2)
