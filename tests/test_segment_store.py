"""Segment KV below the device: the record format, the host tier, and an engine whose evicted
segment entries come back from host memory, exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsex import LLM, SamplingParams
from sparsex.bench.fidelity import pieces_prompt, run_to_completion
from sparsex.kvstore.host_tier import HostTier
from sparsex.kvstore.record import CorruptRecord, SegmentRecord, decode, encode, record_key, tenant_prefix

ONE = SamplingParams(temperature=0.0, max_tokens=1)


def _record(n=6, salt="t", dtype=torch.float32, start=40, encodings=1) -> SegmentRecord:
    return SegmentRecord(np.arange(100, 100 + n, dtype=np.int32), salt, start, encodings, True,
                         torch.randn(3, 2, n, 2, 8).to(dtype))


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_record_round_trips_and_rejects_damage(dtype):
    r = _record(dtype=dtype)
    data = encode(r)
    back = decode(data, "t")
    assert torch.equal(back.kv, r.kv) and back.kv.dtype == dtype
    assert np.array_equal(back.token_ids, r.token_ids) and (back.start_pos, back.num_encodings) == (40, 1)
    for bad in (data[:-1], data[:20], data[:-8] + b"\0" * 8, b"nope" + data[4:], b""):
        with pytest.raises(CorruptRecord):
            decode(bad, "t")
    with pytest.raises(CorruptRecord, match="another tenant"):
        decode(data, "other")


@pytest.mark.unit
def test_a_record_of_many_checksum_chunks_round_trips_and_a_flipped_byte_in_any_chunk_is_caught(monkeypatch):
    """Checksums per chunk, hashed on a thread pool: the digests are each chunk's own (chunks straddle
    the token ids and the K/V), a reader takes the chunk size from the header, and damage anywhere
    (first, middle or last chunk) is caught."""
    import xxhash

    from sparsex.kvstore import record as rec
    monkeypatch.setattr(rec, "CHECKSUM_CHUNK", 100)
    r = _record(n=10)                                   # 40 bytes of token ids + 3,840 of K/V: 39 chunks
    data = encode(r)
    header = rec.decode_header(data)
    payload = data[8 + rec._HEADER_LEN.unpack_from(data, 4)[0]:]
    assert header["checksum_chunk"] == 100 and len(header["checksums"]) == 39
    assert header["checksums"] == [xxhash.xxh3_64_hexdigest(payload[i:i + 100]) for i in range(0, len(payload), 100)]
    monkeypatch.setattr(rec, "CHECKSUM_CHUNK", 7)       # the writer's chunk size is in the header
    back = decode(data, "t")
    assert torch.equal(back.kv, r.kv) and np.array_equal(back.token_ids, r.token_ids)
    start = len(data) - len(payload)
    for at in (start + 3, start + len(payload) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x10
        with pytest.raises(CorruptRecord, match="checksum"):
            decode(bytes(bad), "t")
    with pytest.raises(CorruptRecord, match="checksum"):
        decode(data[:-100], "t")                        # a whole chunk missing


@pytest.mark.unit
def test_keys_separate_tenants_models_and_dtypes():
    toks = [5, 6, 7]
    keys = {record_key(toks, s, m, d) for s in (None, "a", "b") for m in ("m1", "m2")
            for d in (torch.float32, torch.bfloat16)}
    assert len(keys) == 12
    assert record_key(toks, "a", "m1", torch.float32).startswith(tenant_prefix("a"))
    secret = "tenant-secret-salt"
    assert secret not in record_key(toks, secret, "m1", torch.float32)   # the salt itself never shows in a key
    assert tenant_prefix(None) == "sparsex:shared:"


@pytest.mark.unit
def test_host_tier_keeps_the_most_recent_within_its_budget():
    size = _record().nbytes
    tier = HostTier(3 * size)
    for i in range(4):
        assert tier.put(f"k{i}", _record())
    assert len(tier) == 3 and tier.get("k0") is None                  # the oldest left
    assert tier.get("k1") is not None                                 # k1 is now the most recent
    tier.put("k4", _record())
    assert tier.get("k2") is None and tier.get("k1") is not None
    assert not tier.put("huge", _record(n=200))                       # larger than the whole tier
    st = tier.stats()
    assert (st.hits, st.evictions, st.used_bytes) == (2, 2, 3 * size)
    tier.check_integrity()
    with pytest.raises(ValueError, match="capacity"):
        HostTier(-1)


@pytest.fixture(scope="module")
def passages(wiki_texts):
    return [t[:700] for t in wiki_texts[20:24]]                       # ~150 tokens each


@pytest.mark.model
def test_evicted_entries_come_back_from_host_memory_exactly(smollm2, llm_none, passages, wiki_texts):
    """A pool too small to keep the passages: their entries are evicted to the host tier, and a
    later prompt that reuses them loads them back (counted), with selector="all" equal to plain
    prefill and naive reuse served from the loaded KV."""
    # 80 blocks of 16: the three passages' entries (~30 blocks) and one ~1k-token prompt do not fit together
    host = LLM(cache="sparsex", dtype="float32", num_blocks=80, host_kv_cache_memory=256 << 20,
               min_blend_tokens=0, transparent_segments=False)
    eng = host.llm_engine
    head, q = "System: answer from the passages.\n\n", "\nQuestion: which passage is the oldest? Answer:"
    first = pieces_prompt(eng, [head, *passages[:3], q], [True] * 4 + [False])
    run_to_completion(eng, first, ONE)
    assert len(eng.segment_index) >= 3
    # an unrelated long prompt fills the pool: the passages' entries are evicted into host memory
    run_to_completion(eng, pieces_prompt(eng, [" ".join(wiki_texts[30:36])[:4500]], [False]), ONE)
    st = eng.stats().store
    assert st.host_bytes_in > 0 and st.host_used_bytes > 0
    eng.check_integrity()
    p = pieces_prompt(eng, ["Another system prompt, so no prefix hit.\n", *passages[:3][::-1], q], [True] * 4 + [False])
    n = len(p.token_ids)
    out, got = run_to_completion(eng, p, ONE, reuse={"selector": "all"}, distributions_from=n - 8)
    st2 = eng.stats().store
    assert st2.host_hits > st.host_hits and st2.installed_tokens > 0
    assert out.num_reused_tokens > 300
    _, want = run_to_completion(llm_none.llm_engine, p, ONE, distributions_from=n - 8)
    got_t, want_t = (torch.stack([d[i] for i in range(n - 8, n)]) for d in (got, want))
    assert ((got_t - want_t).norm() / want_t.norm()).item() < 1e-4
    eng.check_integrity()


@pytest.mark.model
def test_without_a_host_tier_evicted_entries_are_gone(smollm2, passages, wiki_texts):
    """The same pressure with no host tier: the evicted passages' entries are gone for good (nothing is
    spilled, nothing loads back), so a later prompt computes those passages afresh and reuses only what
    the pool still holds."""
    eng = LLM(cache="sparsex", dtype="float32", num_blocks=80, min_blend_tokens=0,
              transparent_segments=False).llm_engine
    assert eng.store is None and eng.stats().store is None
    head, q = "System: answer from the passages.\n\n", "\nQuestion: which passage is the oldest? Answer:"
    first = pieces_prompt(eng, [head, *passages[:3], q], [True] * 4 + [False])
    run_to_completion(eng, first, ONE)
    tok = eng.tokenizer
    ids = [tok.encode(t, add_special_tokens=False) for t in passages[:3]]
    assert all(eng.segment_index.lookup(i, None, count=False) is not None for i in ids)
    run_to_completion(eng, pieces_prompt(eng, [" ".join(wiki_texts[30:36])[:4500]], [False]), ONE)
    gone = [i for i in ids if eng.segment_index.lookup(i, None, count=False) is None]
    assert gone and eng.segment_index.num_evicted >= len(gone)
    eng.check_integrity()
    p = pieces_prompt(eng, ["Another system prompt, so no prefix hit.\n", *passages[:3][::-1], q], [True] * 4 + [False])
    out, _ = run_to_completion(eng, p, ONE)
    assert out.reused_spans                                       # what the pool kept is still served
    for g in gone:                                                # the evicted passages are computed afresh
        start = next(i for i in range(len(p.token_ids)) if list(p.token_ids[i:i + len(g)]) == g)
        assert not [s for s in out.reused_spans if s.start < start + len(g) and start < s.end], out.reused_spans
    assert eng.stats().store is None
    eng.check_integrity()
    with pytest.raises(ValueError, match="cache='sparsex'"):
        LLM(cache="prefix", host_kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="redis://"):
        LLM(segment_store="http://localhost:6379")


@pytest.mark.unit
def test_prometheus_counts_each_tier_and_the_fetch_decisions():
    from sparsex.engine.llm_engine import EngineStats
    from sparsex.kvstore.segment_store import StoreStats
    from sparsex.metrics import ServerMetrics
    m = ServerMetrics("m")
    base = dict(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_blocks=1, prefix_cache_queries=0,
                prefix_cache_hits=0, approx_prefix_hits=0, num_preemptions=0)
    m.on_stats(EngineStats(**base, store=StoreStats(host_hits=3, remote_hits=2, remote_misses=5, remote_bytes_read=1000,
                                                    fetch_decisions=4, recompute_decisions=1, fetch_seconds=0.5,
                                                    remote_up=False)))
    m.on_stats(EngineStats(**base, store=StoreStats(host_hits=4, remote_hits=2, remote_misses=5, remote_bytes_read=1000,
                                                    fetch_decisions=4, recompute_decisions=3, fetch_seconds=0.75)))
    text = m.render().decode()
    for line in ('sparsex:segment_store_hits_total{model_name="m",tier="host"} 4.0',
                 'sparsex:segment_store_hits_total{model_name="m",tier="redis"} 2.0',
                 'sparsex:segment_store_misses_total{model_name="m",tier="redis"} 5.0',
                 'sparsex:segment_store_read_bytes_total{model_name="m",tier="redis"} 1000.0',
                 'sparsex:segment_store_decisions_total{decision="fetch",model_name="m"} 4.0',
                 'sparsex:segment_store_decisions_total{decision="recompute",model_name="m"} 3.0',
                 'sparsex:segment_store_fetch_seconds_total{model_name="m"} 0.75',
                 'sparsex:segment_store_up{model_name="m"} 1.0'):
        assert line in text, line
