"""The segment index: token spans whose KV sits in the block pool, found by content wherever they
appear in a later prompt.

Key: xxh3-128 of (cache_salt, token ids), domain-separated from prefix-block hashes; every hit is
verified against the stored token ids, so a forced collision never reuses wrong KV.
Value: the blocks holding the span's KV (pinned through the pool's refcounts, like a running
request), the position its first token was computed at, and counters for eviction.

Eviction (`evict_blocks`) is asked for by the KV-cache manager when the pool's free queue cannot
satisfy an allocation. Policies:
  lru        least recently used entry first;
  frequency  GreedyDual-Size-Frequency: priority = clock + hits * cost / size, with cost = tokens
             (prefill work saved per hit) and size = blocks pinned; evicting raises the clock to
             the victim's priority, so stale popular entries age out while a stream of one-off
             content (1 hit each) cannot push out passages that keep being reused.
"""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from sparsex.cache.block_hash import hash_segment, token_bytes
from sparsex.cache.block_pool import BlockPool, KVCacheBlock
from sparsex.cache.slot_mapping import block_span
from sparsex.config import SEGMENT_EVICTION
from sparsex.segment.span_index import SpanIndex


@dataclass(eq=False)
class SegmentEntry:
    key: bytes
    tokens: bytes                   # int32 token ids, verified on every hit
    cache_salt: str | None
    blocks: list[KVCacheBlock]      # cover positions [start_pos, start_pos + len) of the source sequence
    start_pos: int                  # position the first token was computed at
    block_size: int
    hits: int = 0
    last_access: int = 0
    priority: float = 0.0
    locks: int = 0                  # requests about to copy from it (not evictable meanwhile)
    num_encodings: int = 1          # its KV is the mean of this many encodings (merged encodings)
    explicit: bool = True           # a segment of a prompt (message, ingested passage); False: a stretch a
                                    # blended request computed in full, indexed for transparent reuse
    shared: bool = False            # in the shared store already (published, or fetched from it): a
                                    # local hit on it publishes nothing (kvstore/segment_store.publish_span)

    def __len__(self) -> int:
        return len(self.tokens) // 4


class SegmentIndex:
    def __init__(self, pool: BlockPool, block_size: int, policy: str, spans: SpanIndex | None = None,
                 spill: Callable[[SegmentEntry], None] | None = None):
        """`policy`: one of config.SEGMENT_EVICTION (EngineConfig.segment_eviction). `spans`: the
        span index, to which every entry is a source of transparent reuse. `spill(entry)`: called
        with each entry about to be evicted, its blocks still readable (kvstore: the host tier)."""
        if policy not in SEGMENT_EVICTION:
            raise ValueError(f"segment eviction policy must be one of {SEGMENT_EVICTION}, got {policy!r}")
        self.pool = pool
        self.spans = spans
        self.block_size = block_size
        self.policy = policy
        self.entries: dict[bytes, SegmentEntry] = {}
        self._spill = spill
        self._clock = itertools.count(1)
        self._gdsf_floor = 0.0
        # counters (tokens / entries)
        self.query_tokens = 0
        self.hit_tokens = 0
        self.num_inserted = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self.entries)

    # ---- lookup / insert --------------------------------------------------------------------
    def lookup(self, token_ids: list[int] | tuple[int, ...], cache_salt: str | None, count: bool = True) -> SegmentEntry | None:
        tb = token_bytes(token_ids)
        key = hash_segment(tb, cache_salt)
        entry = self.entries.get(key)
        if entry is None or entry.cache_salt != cache_salt or entry.tokens != tb:
            entry = None
        if count:
            self.record_lookups(len(token_ids), [(entry, len(entry))] if entry is not None else [])
        return entry

    def record_lookups(self, query_tokens: int, hits: list[tuple[SegmentEntry, int]],
                       request_hit_tokens: int = 0) -> None:
        """Count a request's lookups (tokens queried; entries hit, with the tokens each served; tokens
        served by the KV of earlier requests, which no entry holds) and refresh the hit entries."""
        self.query_tokens += query_tokens
        self.hit_tokens += request_hit_tokens
        for entry, num_tokens in hits:
            self.hit_tokens += num_tokens
            entry.hits += 1
            entry.last_access = next(self._clock)
            entry.priority = self._gdsf_floor + self._value(entry)

    def _value(self, entry: SegmentEntry) -> float:
        return (1 + entry.hits) * len(entry) / max(1, len(entry.blocks) * self.block_size)

    def insert(self, token_ids: list[int], cache_salt: str | None, blocks: list[KVCacheBlock], start_pos: int,
               explicit: bool = True) -> SegmentEntry | None:
        """Pin `blocks` (those covering [start_pos, start_pos+len)) as a new entry; None if already present."""
        tb = token_bytes(token_ids)
        key = hash_segment(tb, cache_salt)
        if key in self.entries:
            return None
        first, last = block_span(start_pos, len(token_ids), self.block_size)
        pinned = list(blocks[first:last + 1])
        if len(pinned) != last - first + 1:
            raise ValueError(f"segment at {start_pos}+{len(token_ids)} needs blocks {first}..{last}, got {len(blocks)}")
        self.pool.touch(pinned)
        entry = SegmentEntry(key, tb, cache_salt, pinned, start_pos, self.block_size,
                             last_access=next(self._clock), explicit=explicit)
        entry.priority = self._gdsf_floor + self._value(entry)
        self.entries[key] = entry
        self.num_inserted += 1
        if self.spans is not None:
            self.spans.add_entry(entry)
        return entry

    def remove(self, entry: SegmentEntry) -> None:
        """Drop an entry (unpinning its blocks) to replace it by a better encoding: not an eviction,
        so neither counted as one nor moving the GDSF clock."""
        if entry.locks:
            raise RuntimeError("remove of a locked segment entry")
        self._remove(entry)

    def owns_blocks(self, entry: SegmentEntry) -> bool:
        """Whether the entry's blocks are its alone: no other holder, no prefix-cache hash (so their
        KV may change in place without touching an exact prefix hit or another entry)."""
        return all(b.ref_cnt == 1 and b.block_hash is None for b in entry.blocks)

    def copy_on_write(self, entry: SegmentEntry, write: Callable[[list[KVCacheBlock], list[KVCacheBlock]], None]) -> bool:
        """Give `entry` blocks of its own before its KV changes: allocate as many as it pins (never
        evicting for it: False, and nothing changed, when the free queue is short), let
        `write(old, new)` fill the new blocks (the old ones are still readable then), then unpin the
        old blocks, which stay where they were for their other holders (the prefix cache, requests,
        entries)."""
        if entry.locks:
            raise RuntimeError("copy-on-write of a locked segment entry")
        n = len(entry.blocks)
        if self.pool.num_free_blocks < n:
            return False
        old, new = entry.blocks, self.pool.get_new_blocks(n)
        write(old, new)
        entry.blocks = new
        self.pool.free_blocks(list(reversed(old)))
        return True

    def lock(self, entry: SegmentEntry) -> None:
        entry.locks += 1

    def unlock(self, entry: SegmentEntry) -> None:
        if entry.locks <= 0:
            raise RuntimeError("unlock of an unlocked segment entry")
        entry.locks -= 1

    # ---- eviction ---------------------------------------------------------------------------
    def _victim_order(self) -> list[SegmentEntry]:
        cands = [e for e in self.entries.values() if e.locks == 0]
        if self.policy == "lru":
            return sorted(cands, key=lambda e: e.last_access)
        return sorted(cands, key=lambda e: (e.priority, e.last_access))

    def _remove(self, entry: SegmentEntry) -> int:
        del self.entries[entry.key]
        if self.spans is not None:
            self.spans.remove_entry(entry)
        before = self.pool.num_free_blocks
        self.pool.free_blocks(list(reversed(entry.blocks)))
        return self.pool.num_free_blocks - before

    def _evict(self, entry: SegmentEntry) -> int:
        """`_remove` as an eviction: counted, and (GDSF) the clock rises to the victim's priority."""
        self.num_evicted += 1
        if self._spill is not None:
            self._spill(entry)
        if self.policy == "frequency":
            self._gdsf_floor = max(self._gdsf_floor, entry.priority)
        return self._remove(entry)

    def evict_blocks(self, num_blocks: int) -> int:
        """Evict entries until `num_blocks` blocks were returned to the free queue (or none is left
        to evict). Returns the number of blocks released."""
        released = 0
        for entry in self._victim_order():
            if released >= num_blocks:
                break
            released += self._evict(entry)
        return released

    def clear(self) -> None:
        """Drop every unlocked entry (a cache reset: nothing is spilled to a lower tier)."""
        for entry in [e for e in self.entries.values() if e.locks == 0]:
            self._remove(entry)

    # ---- accounting -------------------------------------------------------------------------
    def block_refs(self) -> dict[int, int]:
        refs: dict[int, int] = {}
        for e in self.entries.values():
            for b in e.blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        return refs

    def check_integrity(self) -> None:
        if self.spans is not None:
            self.spans.check_integrity(self.entries.values(), self.pool)
        for key, e in self.entries.items():
            if key != e.key or hash_segment(e.tokens, e.cache_salt) != key:
                raise RuntimeError("segment entry stored under a key that is not its hash")
            if e.locks < 0:
                raise RuntimeError("segment entry with negative lock count")
            if e.num_encodings < 1:
                raise RuntimeError(f"segment entry with {e.num_encodings} encodings")
            if e.num_encodings > 1 and not self.owns_blocks(e):
                raise RuntimeError("a merged segment entry shares its blocks (its mean would leak into their other holders)")
            for b in e.blocks:
                if b.ref_cnt < 1:
                    raise RuntimeError(f"segment entry pins block {b.block_id} whose ref_cnt is {b.ref_cnt}")
            first, last = block_span(e.start_pos, len(e), self.block_size)
            if len(e.blocks) != last - first + 1:
                raise RuntimeError("segment entry holds the wrong number of blocks")
