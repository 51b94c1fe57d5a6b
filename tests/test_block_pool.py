"""Block pool, block hashing and prefix-cache lookups, without a model."""
from __future__ import annotations

import pytest

from sparsex.cache import block_hash as bh
from sparsex.cache.block_pool import BlockPool
from sparsex.cache.kv_cache_manager import KVCacheManager
from sparsex.config import ReuseConfig
from sparsex.request import Request
from sparsex.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), 0.0, cache_salt=salt)


def test_allocation_free_and_integrity():
    pool = BlockPool(8, enable_caching=True)
    a = pool.get_new_blocks(3)
    assert pool.usage().num_in_use == 3 and pool.num_free_blocks == 5
    pool.check_integrity({b.block_id: 1 for b in a})
    with pytest.raises(ValueError, match="cannot allocate 6"):
        pool.get_new_blocks(6)
    pool.free_blocks(a)
    pool.check_integrity({})
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks(a[:1])


def test_integrity_detects_refcount_mismatch():
    pool = BlockPool(4, enable_caching=True)
    a = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="holders"):
        pool.check_integrity({a[0].block_id: 1})          # a[1] is held by nobody we know of


def test_prefix_hit_needs_same_tokens_salt_and_parent():
    kv = KVCacheManager(BlockPool(16, enable_caching=True), 4)
    toks = list(range(100, 113))                          # 3 full blocks + 1 token
    r1 = _req("a", toks)
    assert kv.allocate_slots(r1, len(toks))
    r1.num_computed_tokens = len(toks)
    kv.cache_blocks(r1, len(toks))
    first_three = [b.block_id for b in r1.blocks[:3]]
    kv.free(r1)
    kv.pool.check_integrity({})

    hits, n = kv.get_computed_blocks(_req("b", toks))
    assert n == 12 and [b.block_id for b in hits] == first_three
    assert kv.get_computed_blocks(_req("c", toks, salt="tenant-2"))[1] == 0          # salt isolates
    assert kv.get_computed_blocks(_req("d", [7] + toks[1:]))[1] == 0                 # first block differs
    assert kv.get_computed_blocks(_req("e", toks[:8] + [0] * 5))[1] == 8             # 2 blocks shared
    # a whole-prompt hit still leaves one token to compute
    assert kv.get_computed_blocks(_req("f", toks[:12]))[1] == 8


def test_forced_hash_collision_never_reuses(monkeypatch):
    kv = KVCacheManager(BlockPool(16, enable_caching=True), 4)
    monkeypatch.setattr(bh, "_digest", lambda *a: b"\x01" * 16)     # every block hashes alike
    r1 = _req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.allocate_slots(r1, 9)
    r1.num_computed_tokens = 9
    kv.cache_blocks(r1, 9)
    kv.free(r1)
    assert kv.get_computed_blocks(_req("b", [9, 9, 9, 9, 5, 6, 7, 8, 1]))[1] == 0
    assert kv.get_computed_blocks(_req("c", [1, 2, 3, 4, 5, 6, 7, 8, 1]))[1] == 4   # verified tokens + parent


def test_eviction_is_lru_and_only_of_unreferenced_blocks():
    kv = KVCacheManager(BlockPool(4, enable_caching=True), 2)
    a, b = _req("a", [1, 2, 3]), _req("b", [4, 5, 6])
    for r in (a, b):
        assert kv.allocate_slots(r, 3)
        r.num_computed_tokens = 3
        kv.cache_blocks(r, 3)
    kv.free(a)                                            # a's blocks: cached, evictable
    assert kv.get_computed_blocks(_req("a2", [1, 2, 3]))[1] == 2
    c = _req("c", [9, 9, 9])
    assert kv.allocate_slots(c, 3)                        # needs 2 blocks: evicts a's
    assert kv.get_computed_blocks(_req("a3", [1, 2, 3]))[1] == 0
    assert kv.get_computed_blocks(_req("b2", [4, 5, 6]))[1] == 2    # b still running: never evicted
    assert not kv.allocate_slots(_req("d", [0] * 5), 5)   # pool exhausted: refuses, changes nothing
    kv.pool.check_integrity({blk.block_id: 1 for r in (b, c) for blk in r.blocks})


def test_block_hashes_are_domain_separated_from_segments():
    h = bh.compute_block_hashes(list(range(16)), 16, None)[0]
    assert h.value != bh.hash_segment(list(range(16)), None)
    assert bh.hash_segment([1, 2], "x") != bh.hash_segment([1, 2], None)


def test_allocation_recounts_hit_blocks_released_by_reclaim():
    """A prefix-hit block pinned only by a segment entry: reclaiming the entry moves it into the free
    queue, where it must count as ours, not as free room (it used to make get_new_blocks raise)."""
    released = []

    def reclaim(n: int) -> int:                            # the segment index's role
        if released:
            return 0
        released.append(pinned)
        kv.pool.free_blocks([pinned])
        return 1

    kv = KVCacheManager(BlockPool(4, enable_caching=True), 2, reclaim=reclaim)
    a = _req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_blocks(a, 4)                                  # blocks 0, 1 become prefix-cached
    pinned = a.blocks[0]
    kv.pool.touch([pinned])                                # a segment entry pins block 0
    kv.free(a)
    holder = kv.pool.get_new_blocks(1)                     # someone else holds a block: 2 free left
    b = _req("b", [1, 2, 3, 4, 9, 9, 9, 9])
    hits, _ = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [pinned.block_id, hits[1].block_id]
    assert kv.allocate_slots(b, 4, hits) is False          # 2 hits + 2 new > 4 blocks - 1 held
    assert released and b.blocks == []
    kv.pool.check_integrity({holder[0].block_id: 1})
    kv.pool.free_blocks(holder)
    assert kv.allocate_slots(b, 4, hits)                   # with the holder gone it fits
    kv.pool.check_integrity({blk.block_id: 1 for blk in b.blocks})


@pytest.mark.parametrize("salt,approx_key", [(None, None), ("tenant-a", None), ("tenant-a", ReuseConfig().kv_key)])
def test_chunked_chain_hashing_equals_block_by_block(salt, approx_key):
    """iter_block_hashes converts tokens to bytes a chunk at a time; the chain must be the one
    hashing block by block gives, across chunk edges, from any block-aligned start."""
    tokens = [(7919 * i) % 50_000 for i in range(16 * 150 + 5)]      # 150 full blocks, a partial one
    ref, parent = [], None
    for i in range(150):                                 # one block at a time: the salt goes with block 0
        (parent,) = bh.compute_block_hashes(tokens[16 * i:16 * i + 16], 16, salt if i == 0 else None,
                                            parent=parent, approx_key=approx_key)
        ref.append(parent)
    assert bh.compute_block_hashes(tokens, 16, salt, approx_key=approx_key) == ref
    tail = bh.compute_block_hashes(tokens, 16, salt, parent=ref[69], start=70 * 16, approx_key=approx_key)
    assert tail == ref[70:]
    assert len({h.value for h in ref}) == 150


def test_approximate_chains_are_keyed_by_the_reuse_config():
    """Blended KV depends on the reuse knobs: the same tokens on the approximate chain of another
    config hash differently (so it is never found), while configs equal up to number type and
    `approx_prefix` share one chain; neither chain meets the exact one."""
    tokens = list(range(16 * 4))
    chain = lambda key: [h.value for h in bh.compute_block_hashes(tokens, 16, None, approx_key=key)]
    default = chain(ReuseConfig().kv_key)
    assert chain(ReuseConfig(recompute_ratio=0.125, approx_prefix=False).kv_key) == default
    assert chain(ReuseConfig(recompute_ratio=0, selector="none").kv_key) == chain(
        ReuseConfig(recompute_ratio=0.0, selector="none").kv_key)
    # what the index keeps and whether a request blends do not change a blend's KV
    assert chain(ReuseConfig(merge_encodings=1, blend=False).kv_key) == default
    for other in (ReuseConfig(recompute_ratio=0.3), ReuseConfig(selector="none"), ReuseConfig(full_layers=2),
                  ReuseConfig(rescore_layers=0)):
        assert not set(chain(other.kv_key)) & set(default)
    assert not set(chain(None)) & set(default)


def test_prefix_lookup_hashes_only_what_it_needs():
    kv = KVCacheManager(BlockPool(400, enable_caching=True), 16)
    a = _req("a", list(range(16 * 200)))
    assert kv.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    kv.cache_blocks(a, num_exact_tokens=16 * 3)           # only the first 3 blocks are exact
    assert len(a.block_hashes) == 3
    b = _req("b", list(range(16 * 3)) + [9] * (16 * 197))
    hits, n = kv.get_computed_blocks(b)
    assert n == 16 * 3 and hits == a.blocks[:3]
    assert len(b.block_hashes) < 40                       # not all 200: hashing stopped near the miss
    kv.cache_blocks(a, num_exact_tokens=a.num_tokens)
    assert len(a.block_hashes) == 200


@pytest.mark.parametrize("salt,approx_key", [(None, None), ("tenant-a", None), ("tenant-a", ReuseConfig().kv_key)])
def test_block_hash_values_follow_the_documented_input(salt, approx_key):
    """The digest of a block is xxh3-128 over (domain, parent digest, int64 token bytes, each extra
    key's repr + NUL): recomputed here by hand, so a faster hashing loop cannot change the values
    (or the verification bytes) that cached blocks are found by."""
    import numpy as np
    import xxhash
    tokens = [(104729 * i) % 49_152 for i in range(16 * 3)]
    got = bh.compute_block_hashes(tokens, 16, salt, approx_key=approx_key)
    parent = b"\x00" * 16
    for i, h in enumerate(got):
        extra = ((("cache_salt", salt),) if (i == 0 and salt is not None) else ()) + \
            ((("kv", "blended"), approx_key) if approx_key is not None else ())
        raw = np.asarray(tokens[16 * i:16 * i + 16], dtype=np.int64).tobytes()
        parent = xxhash.xxh3_128_digest(b"sparsex/prefix-block/v1\x00" + parent + raw
                                        + b"".join(repr(k).encode() + b"\x00" for k in extra))
        assert h.value == parent and h.token_bytes == raw and h.extra_keys == extra


def test_segment_copy_on_write_needs_free_blocks_and_leaves_the_old_holders_alone():
    """An entry about to change its KV in place (merged encodings) first gets blocks of its own;
    with no free block the copy is skipped and nothing changes. The old blocks keep their other
    holders (here a running request), and the entry's blocks are then its alone."""
    from sparsex.segment.segment_index import SegmentIndex
    pool = BlockPool(4, enable_caching=True)
    index = SegmentIndex(pool, 16, "lru")
    held = pool.get_new_blocks(4)                          # a request holds every block
    entry = index.insert(list(range(20)), None, held, start_pos=8)   # positions 8..27: blocks 0, 1
    assert entry.blocks == held[:2] and not index.owns_blocks(entry)
    copies = []
    assert not index.copy_on_write(entry, lambda old, new: copies.append((old, new)))
    assert copies == [] and entry.blocks == held[:2]
    pool.free_blocks(list(reversed(held)))                 # the request ends: blocks 2, 3 free
    pool.check_integrity(index.block_refs())
    assert index.copy_on_write(entry, lambda old, new: copies.append((old, new)))
    (old, new), = copies
    assert old == held[:2] and entry.blocks == new and not set(new) & set(held[:2])
    assert index.owns_blocks(entry) and all(b.ref_cnt == 0 for b in held[:2])
    pool.check_integrity(index.block_refs())
    index.lock(entry)
    with pytest.raises(RuntimeError, match="locked"):
        index.copy_on_write(entry, lambda old, new: None)
    index.unlock(entry)
    entry.num_encodings = 2
    index.check_integrity()
    pool.touch(entry.blocks[:1])                           # a merged entry must not share its blocks
    with pytest.raises(RuntimeError, match="shares its blocks"):
        index.check_integrity()
