"""The pool of KV-cache blocks: refcounts, an LRU queue of free blocks, and the prefix-cache map.

Every block is in exactly one of three states:
  in use   ref_cnt > 0 (held by running requests and/or segment-index entries), never evicted;
  cached   ref_cnt == 0, holds a verified block hash, sits in the free queue and may be hit again;
  free     ref_cnt == 0, no hash, sits in the free queue.
The free queue is ordered by eviction priority (head = first to go): a freed block goes to the
tail, a hit takes it out. Allocation pops the head and drops its hash (lazy eviction).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sparsex.cache.block_hash import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    generation: int = 0                          # bumped on every reallocation
    parent: tuple[int, int] | None = None        # (block_id, generation) of the previous block in the chain

    @property
    def identity(self) -> tuple[int, int]:
        return (self.block_id, self.generation)


@dataclass(frozen=True)
class PoolUsage:
    num_blocks: int
    num_free: int        # no hash, ref 0
    num_cached: int      # hash, ref 0 (evictable)
    num_in_use: int      # ref > 0


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool,
                 on_evict: Callable[[KVCacheBlock], None] | None = None):
        """`on_evict(block)`: told when a block's hash is dropped (its KV stops serving; the span
        index forgets it)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}   # hash value -> block
        self.num_evictions = 0
        self._on_evict = on_evict

    # ---- allocation -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable right now (free + cached-but-unreferenced)."""
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._drop_hash(block)
            block.generation += 1
            block.parent = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def _drop_hash(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash.value) is block:
                del self.cached[block.block_hash.value]
            block.block_hash = None
            self.num_evictions += 1
            if self._on_evict is not None:
                self._on_evict(block)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference (a cache hit or a new holder)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop a reference each; blocks that reach 0 join the free queue's tail in the given
        order (so callers pass a request's blocks tail-first: its last blocks are evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    # uncached blocks are worth nothing: evict them before any cached one
                    self.free_queue[block.block_id] = block
                    self.free_queue.move_to_end(block.block_id, last=False)
                else:
                    self.free_queue[block.block_id] = block

    # ---- prefix cache -----------------------------------------------------------------------
    def lookup(self, block_hash: BlockHash, parent: KVCacheBlock | None) -> KVCacheBlock | None:
        """The cached block for this hash, verified: same tokens, same extra keys, same parent block."""
        block = self.cached.get(block_hash.value)
        if block is None or block.block_hash is None:
            return None
        stored = block.block_hash
        if stored.token_bytes != block_hash.token_bytes or stored.extra_keys != block_hash.extra_keys:
            return None
        if block.parent != (parent.identity if parent is not None else None):
            return None
        return block

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, parent: KVCacheBlock | None) -> bool:
        """Register a full block under its hash (first writer wins on duplicates); whether it was."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash.value in self.cached:
            return False
        block.block_hash = block_hash
        block.parent = parent.identity if parent is not None else None
        self.cached[block_hash.value] = block
        return True

    def reset_prefix_cache(self, include_in_use: bool = False) -> int:
        """Forget cached block hashes: of unreferenced blocks, or of every block (their KV stays put,
        they just stop serving prefix hits). Returns how many were dropped."""
        n = 0
        for block in (self.blocks if include_in_use else list(self.free_queue.values())):
            if block.block_hash is not None:
                self._drop_hash(block)
                n += 1
        return n

    # ---- accounting -------------------------------------------------------------------------
    def usage(self) -> PoolUsage:
        cached = sum(1 for b in self.free_queue.values() if b.block_hash is not None)
        return PoolUsage(self.num_blocks, len(self.free_queue) - cached, cached, self.num_blocks - len(self.free_queue))

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise if the pool's invariants are broken. `expected_refs` (block_id -> count of holders
        known to the caller) must then equal every block's ref_cnt exactly."""
        in_queue = set(self.free_queue)
        u = self.usage()
        if u.num_free + u.num_cached + u.num_in_use != self.num_blocks:
            raise RuntimeError(f"block accounting broken: {u}")
        for b in self.blocks:
            if b.ref_cnt < 0:
                raise RuntimeError(f"block {b.block_id} has negative ref_cnt {b.ref_cnt}")
            if (b.ref_cnt == 0) != (b.block_id in in_queue):
                raise RuntimeError(f"block {b.block_id}: ref_cnt={b.ref_cnt} but in free queue={b.block_id in in_queue}")
            if b.block_hash is not None and self.cached.get(b.block_hash.value) is not b:
                raise RuntimeError(f"block {b.block_id} has a hash that does not map back to it")
        for value, b in self.cached.items():
            if b.block_hash is None or b.block_hash.value != value:
                raise RuntimeError(f"cache map entry points to block {b.block_id} with another hash")
        if expected_refs is not None:
            for b in self.blocks:
                if b.ref_cnt != expected_refs.get(b.block_id, 0):
                    raise RuntimeError(f"block {b.block_id}: ref_cnt={b.ref_cnt}, holders={expected_refs.get(b.block_id, 0)}")
