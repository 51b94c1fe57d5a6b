"""The span index on its own (no model): content-defined anchors, maximal runs at any offset, overlap
resolution, hash collisions, tenant isolation, and anchors that follow the block pool."""
from __future__ import annotations

import numpy as np
import pytest

from sparsex.cache.block_pool import BlockPool
from sparsex.cache.kv_cache_manager import KVCacheManager
from sparsex.request import Request
from sparsex.sampling_params import SamplingParams
from sparsex.segment import span_index as si
from sparsex.segment.segment_index import SegmentIndex
from sparsex.segment.span_index import GUARANTEED_TOKENS, SpanIndex, anchors

pytestmark = pytest.mark.unit

BS = 16
rng = np.random.default_rng(7)


def toks(n: int) -> list[int]:
    return rng.integers(100, 30000, size=n).tolist()


def make(num_blocks: int = 256):
    spans = SpanIndex(BS)
    pool = BlockPool(num_blocks, enable_caching=True, on_evict=spans.on_evict)
    index = SegmentIndex(pool, BS, "lru", spans=spans)
    kv = KVCacheManager(pool, BS, on_exact_run=spans.add_request_run)
    return kv, spans, index


def add_entry(kv, index, tokens: list[int], salt=None, start_pos: int = 200):
    """An entry computed at `start_pos` (its blocks allocated as a request's would be)."""
    first, last = start_pos // BS, (start_pos + len(tokens) - 1) // BS
    blocks = [None] * first + kv.pool.get_new_blocks(last - first + 1)
    entry = index.insert(tokens, salt, blocks, start_pos)
    kv.pool.free_blocks([b for b in blocks if b is not None])      # the entry alone holds them now
    return entry


def run_request(kv, tokens: list[int], salt=None, rid="r") -> Request:
    """A request computed exactly to completion: its full blocks go on the exact prefix chain."""
    req = Request(rid, list(tokens), SamplingParams(max_tokens=1), 0.0, cache_salt=salt)
    assert kv.allocate_slots(req, len(tokens))
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req, len(tokens))
    kv.free(req)
    return req


def find(spans, prompt, salt=None, min_tokens=16, **kw):
    arr = np.asarray(prompt, dtype=np.int32)
    return [(m.start, m.end, m.source.kind, m.offset) for m in spans.find(arr, 0, len(arr), salt, min_tokens, **kw)]


def test_anchors_depend_on_content_not_offset():
    body = np.asarray(toks(200), dtype=np.int32)
    a = np.concatenate([np.asarray(toks(37), dtype=np.int32), body])
    b = np.concatenate([np.asarray(toks(5), dtype=np.int32), body, np.asarray(toks(9), dtype=np.int32)])
    pa, ha = anchors(a)
    pb, hb = anchors(b)
    # anchors whose winnowing windows lie inside the body are the same, shifted by the offset
    inner_a = {(int(p) - 37, int(h)) for p, h in zip(pa, ha) if 37 + GUARANTEED_TOKENS <= p < 37 + 200 - GUARANTEED_TOKENS}
    inner_b = {(int(p) - 5, int(h)) for p, h in zip(pb, hb) if 5 + GUARANTEED_TOKENS <= p < 5 + 200 - GUARANTEED_TOKENS}
    assert inner_a and inner_a == inner_b
    # every window of WINDOW k-grams holds an anchor
    assert np.max(np.diff(pa)) <= si.WINDOW


def test_finds_every_run_at_any_offset_with_its_source_offset():
    kv, spans, index = make()
    p1, p2 = toks(120), toks(90)
    add_entry(kv, index, p1)
    add_entry(kv, index, p2)
    noise = [toks(7), toks(30), toks(11)]
    prompt = noise[0] + p2[10:80] + noise[1] + p1 + noise[2]
    got = find(spans, prompt)
    assert got == [(7, 77, "entry", 10), (107, 227, "entry", 0)]
    index.check_integrity()


def test_repeated_passage_and_a_run_crossing_two_sources():
    kv, spans, index = make()
    p1, p2 = toks(100), toks(100)
    add_entry(kv, index, p1)
    add_entry(kv, index, p2)
    prompt = toks(20) + p1 + toks(20) + p1[:60] + p1[60:] + toks(3) + p1[50:] + p2[:40]
    got = find(spans, prompt)
    assert [(s, e, off) for s, e, _, off in got] == [(20, 120, 0), (140, 240, 0), (243, 293, 50), (293, 333, 0)]


def test_shortest_guaranteed_run_is_found_and_shorter_are_not_returned():
    kv, spans, index = make()
    p = toks(200)
    add_entry(kv, index, p)
    for n in (GUARANTEED_TOKENS, 40):
        got = find(spans, toks(9) + p[50:50 + n] + toks(9))
        assert got == [(9, 9 + n, "entry", 50)]
    assert find(spans, toks(9) + p[50:50 + 15] + toks(9)) == []        # under min_tokens


def test_overlapping_candidates_resolve_longest_first_and_respect_taken():
    kv, spans, index = make()
    p1 = toks(100)
    p2 = p1[60:] + toks(60)              # p2 opens with p1's last 40 tokens
    add_entry(kv, index, p1)
    add_entry(kv, index, p2)
    prompt = toks(10) + p1 + p2[40:]
    got = find(spans, prompt)
    assert [(s, e) for s, e, _, _ in got] == [(10, 110), (110, 170)]    # no position served twice
    got = find(spans, prompt, taken=[(30, 60)])
    assert [(s, e) for s, e, _, _ in got] == [(10, 30), (60, 110), (110, 170)]
    got = find(spans, prompt, taken=[(20, 100)])                       # leftover under 16 tokens dropped
    # p1 keeps only 10-token pieces ([10, 20), [100, 110)): dropped, they serve nothing, so p2 (found
    # from position 70 on) serves [100, 170) where a leftover that claimed its positions would cut it to 110
    assert [(s, e) for s, e, _, _ in got] == [(100, 170)]


def test_a_merged_entry_serves_its_passage_before_a_longer_single_encoding_run():
    """An earlier request held glue + passage + glue (one encoding); the passage's entry holds the mean
    of two encodings. The passage comes from the entry, the glue around it (if long enough) from the run;
    with a single-encoding entry the longer run wins as before."""
    for encodings, want in ((2, [(0, 40, "request"), (40, 140, "entry"), (140, 170, "request")]),
                            (1, [(0, 170, "request")])):
        kv, spans, index = make()
        glue_a, passage, glue_b = toks(40), toks(100), toks(30)
        run_request(kv, glue_a + passage + glue_b + toks(6))
        entry = add_entry(kv, index, passage, start_pos=400)
        entry.num_encodings = encodings
        got = find(spans, glue_a + passage + glue_b)
        assert [(s, e, k) for s, e, k, _ in got] == want, encodings
        index.check_integrity()


def test_early_source_positions_do_not_serve_late():
    kv, spans, index = make()
    p = toks(200)
    add_entry(kv, index, p, start_pos=40)            # positions 40..239
    prompt = toks(300) + p
    got = find(spans, prompt, min_context_tokens=128)
    assert got == [(300 + 88, 500, "entry", 88)]      # from source position 128 on
    assert find(spans, toks(10) + p, min_context_tokens=128) == [(10, 210, "entry", 0)]   # early serves early


def test_forced_hash_collision_never_aligns_wrong_tokens(monkeypatch):
    kv, spans, index = make()
    monkeypatch.setattr(si, "kgram_hashes", lambda t: np.zeros(max(0, len(t) - si.KGRAM + 1), dtype=np.uint64))
    p = toks(100)
    add_entry(kv, index, p)
    assert find(spans, toks(200)) == []               # every anchor collides; no token run matches
    assert find(spans, toks(20) + p[5:95]) == [(20, 110, "entry", 5)]


def test_a_span_under_one_salt_is_never_found_under_another():
    kv, spans, index = make()
    p = toks(80)
    add_entry(kv, index, p, salt="tenant:a")
    run_request(kv, toks(5) + p + toks(40), salt="tenant:a")
    prompt = toks(30) + p
    assert find(spans, prompt, salt="tenant:b") == []
    assert find(spans, prompt, salt=None) == []
    assert [(s, e) for s, e, _, _ in find(spans, prompt, salt="tenant:a")] == [(30, 110)]
    index.check_integrity()


def test_request_runs_are_found_and_their_anchors_follow_eviction():
    kv, spans, index = make(num_blocks=24)
    doc = toks(320)                                   # 20 full blocks
    run_request(kv, doc)
    index.check_integrity()
    got = find(spans, toks(13) + doc[100:300])
    assert [(s, e, k, off) for s, e, k, off in got] == [(13, 213, "request", 100)]
    anchors_before = spans.num_anchors()
    assert anchors_before > 0
    # another request takes 10 blocks: the pool reallocates the oldest cached ones (tail-first freed)
    other = Request("o", toks(150), SamplingParams(max_tokens=1), 0.0)
    assert kv.allocate_slots(other, 150)
    index.check_integrity()
    assert 0 < spans.num_anchors() < anchors_before
    prompt = toks(13) + doc[100:300]
    found = spans.find(np.asarray(prompt, dtype=np.int32), 0, len(prompt), None, 16)
    assert found and sum(m.num_tokens for m in found) < 200
    for m in found:                                   # only blocks still cached serve, verified token by token
        assert m.source.kind == "request"
        assert m.source.tokens[m.offset:m.offset + m.num_tokens].tolist() == prompt[m.start:m.end]
        pos, blocks = m.source.blocks_for(m.offset, m.num_tokens)
        assert all(b.block_hash is not None for b in blocks)
    kv.free(other)
    kv.pool.reset_prefix_cache()
    assert spans.num_anchors() == 0 and find(spans, doc) == []
    index.check_integrity()


def test_entry_anchors_leave_with_the_entry():
    kv, spans, index = make()
    p = toks(64)
    entry = add_entry(kv, index, p)
    assert find(spans, toks(3) + p)
    index.remove(entry)
    assert spans.num_anchors() == 0 and find(spans, toks(3) + p) == []
    index.check_integrity()


@pytest.mark.parametrize("n", [0, 1, 7, 8, 15])
def test_tiny_inputs(n):
    pos, h = anchors(np.asarray(toks(n), dtype=np.int32))
    assert len(pos) == len(h) and (n < si.KGRAM) == (len(pos) == 0)


def test_span_index_cost_bench_measures_memory_and_finds_the_passages():
    from benchmarks.segment_index_bench import span_index_cost
    rng = np.random.default_rng(3)
    passages = [rng.integers(0, 49152, int(n)).tolist() for n in rng.integers(100, 300, 40)]
    r = span_index_cost(passages, prompt_tokens=(2048,), repeats=2)
    assert r["cached_tokens"] == sum(len(p) // 16 * 16 for p in passages)
    assert r["anchors"] > 0 and 0 < r["bytes_per_token"] < 1000
    sec, share = r["searches"][2048]
    assert sec > 0 and share > 0.8           # the prompt is made of indexed passages: nearly all of it is found
