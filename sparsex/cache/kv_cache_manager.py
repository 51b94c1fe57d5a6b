"""Gives requests KV blocks: prefix-cache lookups, slot allocation, freeing, registering full blocks.

A request's block table is append-only and laid out by position (block i holds positions
[i*block_size, (i+1)*block_size)). Two hash chains share the pool:

- the exact chain: blocks whose KV equals a plain prefill's. Only these serve ordinary prefix hits,
  so prefix caching on/off never changes an output;
- the approximate chain: blocks at or after a blended request's first reused position (their KV was
  computed over re-rotated, partly recomputed segments). Each hash carries `APPROXIMATE_KV` and the
  blending request's `ReuseConfig.kv_key`, so an exact lookup can never return one, nor can a request
  with other reuse knobs. A later request that accepts approximate KV (`ReuseConfig.approx_prefix`)
  continues its exact hit along its config's chain: the next turn of a blended
  conversation then reuses the previous turn's KV as it is, instead of blending the same history again
  (which would stack one more approximation per turn).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from sparsex.cache.block_hash import BlockHash, compute_block_hashes, iter_block_hashes
from sparsex.cache.block_pool import BlockPool, KVCacheBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _ReuseKnobs(Protocol):
    kv_key: bytes


class KVRequest(Protocol):
    """What the manager reads and writes of a request (`sparsex.request.Request`). The manager is
    the one writer of the block fields."""
    cache_salt: str | None
    reuse: _ReuseKnobs | None
    num_computed_tokens: int
    blocks: list[KVCacheBlock]
    block_hashes: list[BlockHash]
    num_exact_cached_blocks: int
    approx_block_hashes: list[BlockHash]
    num_approx_cached_blocks: int

    @property
    def num_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def prompt_end(self) -> int: ...
    @property
    def exact_prefix_len(self) -> int | None: ...
    @property
    def approx_prefix_enabled(self) -> bool: ...


@dataclass(frozen=True)
class PrefixHit:
    """A waiting request's cached prefix: `exact` blocks of the exact chain, then `approx` blocks
    of the approximate chain continuing them (KV an earlier blended request left)."""
    exact: list[KVCacheBlock]
    approx: list[KVCacheBlock]
    block_size: int

    @property
    def blocks(self) -> list[KVCacheBlock]:
        return self.exact + self.approx

    @property
    def num_exact_tokens(self) -> int:
        return len(self.exact) * self.block_size

    @property
    def num_approx_tokens(self) -> int:
        return len(self.approx) * self.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_exact_tokens + self.num_approx_tokens


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, *, reclaim: Callable[[int], int] | None = None,
                 on_exact_run: Callable[[list[int], str | None, int, list[KVCacheBlock]], None] | None = None):
        """`reclaim(n) -> released`: asked to release pinned blocks (segment entries) when the free
        queue runs dry. `on_exact_run(token_ids, cache_salt, first block index, blocks)`: told of every
        run of prompt blocks a request registers on the exact chain (the span index makes them
        findable inside later prompts)."""
        self.block_size = block_size
        self.pool = pool
        self.enable_prefix_caching = pool.enable_caching
        self._reclaim = reclaim
        self._on_exact_run = on_exact_run
        # counters (tokens), counted when a waiting request is admitted (`admit`)
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.approx_prefix_hits = 0     # tokens served from the approximate chain

    # ---- prefix cache -----------------------------------------------------------------------
    def hash_blocks(self, req: KVRequest, num_blocks: int) -> None:
        """Extend the request's exact hash chain over its first `num_blocks` full blocks (at most the
        full blocks it has). Hashes are made when first needed: a blended request only ever needs
        those of its exact prefix, and hashing a 32k-token prompt is milliseconds on the TTFT path."""
        num_blocks = min(num_blocks, req.num_tokens // self.block_size)
        have = len(req.block_hashes)
        if have < num_blocks:
            req.block_hashes.extend(compute_block_hashes(
                req.all_token_ids[: num_blocks * self.block_size], self.block_size, req.cache_salt,
                parent=req.block_hashes[-1] if have else None, start=have * self.block_size))

    def find_prefix(self, req: KVRequest, approx: bool) -> PrefixHit:
        """The request's cached prefix: the longest verified exact hit, continued along the
        approximate chain when `approx` (the request accepts approximate KV)."""
        exact, _ = self.get_computed_blocks(req)
        return PrefixHit(exact, self.get_approx_blocks(req, exact) if approx else [], self.block_size)

    def get_computed_blocks(self, req: KVRequest) -> tuple[list[KVCacheBlock], int]:
        """Longest verified prefix hit. At least one token is always left to compute (its logits are needed)."""
        if not self.enable_prefix_caching:
            return [], 0
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        parent = None
        while len(hits) < max_hit_blocks:
            i = len(hits)
            if i >= len(req.block_hashes):
                self.hash_blocks(req, min(max_hit_blocks, 2 * i + 16))   # hash ahead, doubling
            block = self.pool.lookup(req.block_hashes[i], parent)
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits, len(hits) * self.block_size

    def get_approx_blocks(self, req: KVRequest, exact_hits: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Blocks of the approximate chain that continue `exact_hits` (verified like exact hits)."""
        if not self.enable_prefix_caching:
            return []
        start = len(exact_hits)
        max_hit_blocks = (req.num_tokens - 1) // self.block_size
        if start >= max_hit_blocks:
            return []
        parent = exact_hits[-1] if exact_hits else None
        hits: list[KVCacheBlock] = []
        for block_hash in iter_block_hashes(req.all_token_ids[: max_hit_blocks * self.block_size], self.block_size,
                                            req.cache_salt, parent=req.block_hashes[start - 1] if start else None,
                                            start=start * self.block_size, approx_key=req.reuse.kv_key):
            block = self.pool.lookup(block_hash, parent)
            if block is None:
                break
            hits.append(block)
            parent = block
        return hits

    # ---- allocation -------------------------------------------------------------------------
    def admit(self, req: KVRequest, num_new_tokens: int, hit: PrefixHit) -> bool:
        """A waiting request's first allocation: its prefix hit's blocks, then room for
        `num_new_tokens`; the prefix-cache counters count it. False, nothing changed, when the pool
        cannot supply the blocks."""
        if not self.allocate_slots(req, num_new_tokens, hit.blocks):
            return False
        self.prefix_queries += req.num_tokens
        self.prefix_hits += hit.num_exact_tokens
        self.approx_prefix_hits += hit.num_approx_tokens
        return True

    def allocate_slots(self, req: KVRequest, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the (hit-extended) computed ones.
        Returns False and changes nothing when the pool cannot supply the blocks."""
        hits = new_computed_blocks or []
        total = req.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new_blocks = cdiv(total, self.block_size) - len(req.blocks) - len(hits)
        if num_new_blocks > 0:
            while True:
                # hit blocks sitting in the free queue stop being allocatable once we take them.
                # Recounted after every reclaim: releasing a segment entry can drop a hit block's
                # last reference, which moves it into the free queue (counted free, but ours).
                need = num_new_blocks + sum(1 for b in hits if b.ref_cnt == 0)
                short = need - self.pool.num_free_blocks
                if short <= 0:
                    break
                if self._reclaim is None or self._reclaim(short) == 0:
                    return False
        self.pool.touch(hits)
        req.blocks.extend(hits)
        if num_new_blocks > 0:
            req.blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        return True

    def free(self, req: KVRequest) -> None:
        """Release the request's blocks (finish, abort, preemption). What it registered stays
        cached; a readmission registers from its new block table (its token hashes are kept)."""
        self.pool.free_blocks(list(reversed(req.blocks)))
        req.blocks = []
        req.num_exact_cached_blocks = 0
        req.approx_block_hashes, req.num_approx_cached_blocks = [], 0

    def cache_blocks(self, req: KVRequest, num_exact_tokens: int) -> None:
        """Register the request's full blocks below `num_exact_tokens` (already computed, exact KV)."""
        if not self.enable_prefix_caching:
            return
        n = min(min(num_exact_tokens, req.num_computed_tokens) // self.block_size, len(req.blocks))
        if n <= req.num_exact_cached_blocks:        # incremental: a decode step completes <= 1 block
            return
        self.hash_blocks(req, n)
        run_start = None               # runs of blocks this request registered (not already cached)
        for i in range(req.num_exact_cached_blocks, n):
            new = self.pool.cache_block(req.blocks[i], req.block_hashes[i], req.blocks[i - 1] if i > 0 else None)
            if new and run_start is None:
                run_start = i
            elif not new and run_start is not None:
                self._report_run(req, run_start, i)
                run_start = None
        if run_start is not None:
            self._report_run(req, run_start, n)
        req.num_exact_cached_blocks = n

    def _report_run(self, req: KVRequest, start: int, end: int) -> None:
        # only blocks of prompt tokens become span sources: generated tokens rarely recur elsewhere,
        # and a teacher-forced evaluation (prompt + continuation, `query_horizon`) must index exactly
        # what the plain request indexes
        end = min(end, req.prompt_end // self.block_size)
        if self._on_exact_run is not None and end > start:
            self._on_exact_run(req.all_token_ids, req.cache_salt, start, req.blocks[start:end])

    def _hash_approx(self, req: KVRequest, n_full: int) -> None:
        """Extend `req.approx_block_hashes`: the chain from block exact_prefix_len // block_size on."""
        bs = self.block_size
        start = req.exact_prefix_len // bs                     # the block holding the first approximate KV
        have = start + len(req.approx_block_hashes)
        if have >= n_full:
            return
        self.hash_blocks(req, start)
        if req.approx_block_hashes:
            parent = req.approx_block_hashes[-1]
        else:
            parent = req.block_hashes[start - 1] if start > 0 else None
        req.approx_block_hashes.extend(compute_block_hashes(
            req.all_token_ids[: n_full * bs], bs, req.cache_salt, parent=parent, start=have * bs,
            approx_key=req.reuse.kv_key))

    def cache_approx_blocks(self, req: KVRequest) -> None:
        """Register the request's full computed blocks at or after `exact_prefix_len` on the
        approximate chain (incremental: each step registers only the blocks it completed)."""
        if not self.enable_prefix_caching or req.exact_prefix_len is None or not req.approx_prefix_enabled:
            return
        n_full = min(req.num_computed_tokens // self.block_size, len(req.blocks))
        self._hash_approx(req, n_full)
        start = req.exact_prefix_len // self.block_size
        for i in range(start + req.num_approx_cached_blocks, n_full):
            self.pool.cache_block(req.blocks[i], req.approx_block_hashes[i - start], req.blocks[i - 1] if i > 0 else None)
        req.num_approx_cached_blocks = max(req.num_approx_cached_blocks, n_full - start)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests or segment entries."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks
