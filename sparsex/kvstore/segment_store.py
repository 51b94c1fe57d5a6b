"""The tiers below the device KV pool for segment entries, and the moves between them.

  device  the segment index's entries (blocks of the KV pool);
  host    `host_tier.HostTier`: an entry evicted from the pool is copied here first (`spill`) and comes
          back on a later hit (`fetch` + `install`): on the CPU this extends the pool, on a GPU it keeps
          KV that device memory had to drop;
  remote  a store shared by every replica, picked by the url's scheme: `redis_tier.RedisTier`
          (redis://: whole records in Redis) or `mooncake_tier.MooncakeTier` (mooncake://: payloads
          in a Mooncake Store moved between registered buffers, their index in Redis). An explicit
          segment a replica computes is written there (`publish`, write-behind: serialised and sent by a worker thread,
          off the TTFT path), an encoding it merges is folded into the stored record by
          compare-and-set (`publish_merge`: concurrent merges from several replicas lose no update),
          and a replica that misses locally looks the request's spans up there in one round trip.

A hit below the device becomes an ordinary segment entry (`install`: blocks from the pool, K/V of
every layer written, indexed, also for transparent reuse) before the request is planned, so
blending is unchanged. Token ids are verified on every hit, records are checksummed
(`record.decode`), and keys carry the tenant, model, dtype and layout (`record.record_key`).

Spans found by content across replicas (`share_spans`, EngineConfig.segment_store_spans): a
published record's content anchors also go to a shared index in Redis (`anchor_index.AnchorIndex`),
and what a replica publishes grows by the stretches it reuses by content locally (`publish_span`:
only what recurs). A prompt's stretches that no local source serves are looked up there
(`load_by_content`), the candidate records fetched and verified token by token against the prompt
at the aligned offset before they are installed; the span search then finds them like any entry.
A proposed record the store no longer holds, or drops as corrupt, has the references that led to it
removed from the index (`AnchorIndex.forget`, on the tier's writer thread after the tier's own
removal), unless another replica stored it again meanwhile.

Fetch or recompute: a remote fetch is taken only when `fetch_policy.FetchPolicy` expects it to be
cheaper than recomputing the span (bytes / measured store bandwidth + round trip, against tokens /
measured prefill throughput); the decisions are counted.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from sparsex.cache.device_kv import DeviceKV
from sparsex.cache.slot_mapping import block_ids, block_span, slot_mapping
from sparsex.kvstore.fetch_policy import FetchPolicy
from sparsex.kvstore.host_tier import HostTier
from sparsex.kvstore.record import CorruptRecord, SegmentRecord, decode, encode, record_key
from sparsex.layers.triton_rerotate import rerotate_keys
from sparsex.segment.segment_index import SegmentEntry, SegmentIndex

logger = logging.getLogger(__name__)


@dataclass
class StoreStats:
    host_hits: int = 0
    host_misses: int = 0
    host_bytes_in: int = 0
    host_bytes_out: int = 0
    host_used_bytes: int = 0
    remote_hits: int = 0
    remote_misses: int = 0
    remote_errors: int = 0
    remote_corrupt: int = 0
    remote_bytes_read: int = 0
    remote_bytes_written: int = 0
    remote_writes_dropped: int = 0
    remote_stale: int = 0              # index entries whose payload was gone (mooncake: evicted, master restarted)
    remote_up: bool = True
    remote_kind: str | None = None     # "redis" or "mooncake"; None without a shared store
    fetch_seconds: float = 0.0         # remote round trips on the scheduling path
    fetch_decisions: int = 0           # spans fetched from the remote store
    recompute_decisions: int = 0       # spans the fetch policy left to recompute
    installed_tokens: int = 0          # tokens brought back into the device pool from a tier
    # spans found by content across replicas (share_spans; anchor_index.py)
    span_records_published: int = 0    # records published with their anchors
    span_anchors_published: int = 0
    span_lookups: int = 0              # prompts whose unserved stretches were looked up in the anchor index
    span_candidates: int = 0           # records the anchors proposed and that were fetched
    span_rejected: int = 0             # fetched candidates whose tokens did not match the prompt where aligned
    span_missing: int = 0              # records the anchors proposed that the store no longer held (evicted, lost)
    span_installed: int = 0            # verified records installed as entries
    span_installed_tokens: int = 0
    span_refs_removed: int = 0         # stale references removed from the anchor index (gone or corrupt records)


# the most records one prompt's anchor lookup fetches (the best-voted first)
MAX_SPAN_FETCH = 8


def _verified_run(prompt: np.ndarray, tokens: np.ndarray, diag: int, intervals: list[tuple[int, int]]) -> int:
    """The longest run of prompt positions inside one of `intervals` whose token equals the record's
    token aligned there (record token i at prompt position diag + i): what a hash proposed, checked."""
    best = 0
    for a, b in intervals:
        lo, hi = max(a, diag), min(b, diag + len(tokens))
        if hi - lo <= best:
            continue
        eq = np.concatenate([[False], prompt[lo:hi] == tokens[lo - diag:hi - diag], [False]])
        edges = np.flatnonzero(eq[1:] != eq[:-1])          # run starts and ends, alternating
        if len(edges):
            best = max(best, int((edges[1::2] - edges[::2]).max()))
    return best


class SegmentStore:
    """`url`: EngineConfig.segment_store (redis:// or mooncake://), `index_url`: EngineConfig.segment_index
    (a mooncake:// store's Redis index); `fetch`: EngineConfig.segment_store_fetch; `merge_cap`:
    ReuseConfig.merge_encodings (the most encodings a shared record averages)."""

    def __init__(self, kv: DeviceKV, model_fingerprint: str, *, host_bytes: int, url: str | None, fetch: str,
                 merge_cap: int, index_url: str | None = None, share_spans: bool = False):
        self.kv = kv
        self.fingerprint = model_fingerprint
        self.merge_cap = merge_cap
        self.host = (HostTier(host_bytes, pin=kv.device.type == "cuda", on_evict=self._host_evicted)
                     if host_bytes > 0 else None)
        self.remote = None
        self.remote_kind = None
        if url and url.startswith("mooncake://"):
            from sparsex.kvstore.mooncake_tier import MooncakeTier
            if not index_url:
                raise ValueError("a mooncake:// segment store needs its index: segment_index=redis://...")
            self.remote, self.remote_kind = MooncakeTier(url, index_url=index_url, pin=kv.device.type == "cuda"), "mooncake"
        elif url:
            from sparsex.kvstore.redis_tier import RedisTier
            self.remote, self.remote_kind = RedisTier(url), "redis"
        self.anchors = None               # anchor_index.AnchorIndex: spans shared by content (share_spans)
        if share_spans and self.remote is not None:
            from sparsex.kvstore.anchor_index import AnchorIndex
            self.anchors = AnchorIndex(index_url if self.remote_kind == "mooncake" else url)
        self._published: set[str] = set()  # record keys this replica published or installed (not sent again)
        self._span = {"lookups": 0, "candidates": 0, "rejected": 0, "missing": 0, "installed": 0,
                      "installed_tokens": 0}
        self.policy = FetchPolicy(fetch)
        self.fetch_seconds = 0.0
        self.installed_tokens = 0
        self.bytes_per_token = kv.bytes_per_token        # what a record carries per token
        self._jobs: queue.Queue | None = None
        self._worker: threading.Thread | None = None
        if self.remote is not None:
            self._jobs = queue.Queue()
            self._worker = threading.Thread(target=self._work, name="sparsex-store-writer", daemon=True)
            self._worker.start()

    def reset(self) -> None:
        """The engine's caches were reset: the host tier starts empty (a shared store is left as it
        is: other replicas use it)."""
        if self.host is not None:
            self.host = HostTier(self.host.capacity, pin=self.host.pin, on_evict=self._host_evicted)
            self._tell_host("clear", None, None)

    def _host_evicted(self, key: str) -> None:
        self._tell_host("evict", key, None)

    def _tell_host(self, op: str, key: str | None, slots: torch.Tensor | None) -> None:
        """Tensor parallelism: the other ranks make the same host-tier move with their shard."""
        if self.kv.on_host is not None:
            self.kv.on_host(op, key, None if slots is None else slots.cpu().numpy())

    # ---- keys and device <-> record ------------------------------------------------------------
    def key(self, token_ids, cache_salt: str | None) -> str:
        return record_key(token_ids, cache_salt, self.fingerprint, self.kv.dtype)

    def _slots(self, blocks, start_pos: int, n: int, block0: int) -> torch.Tensor:
        slots = slot_mapping(block_ids(blocks), np.arange(start_pos, start_pos + n), self.kv.block_size, block0)
        return torch.from_numpy(slots).to(self.kv.device)

    def _gather(self, blocks, start_pos: int, n: int, block0: int) -> torch.Tensor:
        """K/V of positions start_pos.. held by `blocks` (blocks[0] is block `block0`), every layer:
        [layers, 2, n, kv_heads, head_dim], a copy on the KV's device."""
        return self.kv.gather(self._slots(blocks, start_pos, n, block0))

    def _record(self, entry: SegmentEntry, kv: torch.Tensor) -> SegmentRecord:
        return SegmentRecord(np.frombuffer(entry.tokens, dtype=np.int32).copy(), entry.cache_salt,
                             entry.start_pos, entry.num_encodings, entry.explicit, kv)

    # ---- device -> tiers -----------------------------------------------------------------------
    def spill(self, entry: SegmentEntry) -> None:
        """`SegmentIndex`'s spill: keep an evicted entry's KV in the host tier."""
        if self.host is None:
            return
        kv = self._gather(entry.blocks, entry.start_pos, len(entry), entry.start_pos // self.kv.block_size)
        # one device -> host copy, straight into pinned memory where the tier pins (a pageable .cpu()
        # and then pin_memory() is two copies, the first at pageable speed)
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=self.host.pin)
        host.copy_(kv)
        key = self.key(entry.tokens, entry.cache_salt)
        if self.host.put(key, self._record(entry, host)):
            self._tell_host("spill", key, self._slots(entry.blocks, entry.start_pos, len(entry),
                                                      entry.start_pos // self.kv.block_size))

    def publish(self, entry: SegmentEntry) -> None:
        """A new explicit entry (or, sharing spans, a stretch a blended request computed in full,
        indexed for transparent reuse): write it to the shared store unless a record is there
        already. The K/V are copied on the device now (the blocks may be reused later); serialising
        and sending happen in the writer thread."""
        if self.remote is None or not (entry.explicit or self.anchors is not None):
            return
        kv = self._gather(entry.blocks, entry.start_pos, len(entry), entry.start_pos // self.kv.block_size)
        key = self.key(entry.tokens, entry.cache_salt)
        self._published.add(key)
        entry.shared = True
        self._jobs.put(("put", key, self._record(entry, kv)))

    @property
    def shares_spans(self) -> bool:
        return self.anchors is not None

    def publish_span(self, token_ids: list[int], cache_salt: str | None, blocks, start_pos: int) -> None:
        """A stretch this replica just reused by content (it recurred): `token_ids`, computed at
        positions start_pos.. in `blocks` (blocks[0] holds start_pos's block), written to the shared
        store as a record (explicit=False) with its anchors; once per record key. The K/V are copied
        on the device now (the caller holds the blocks until then), sent by the writer thread."""
        if self.anchors is None:
            return
        key = self.key(token_ids, cache_salt)
        if key in self._published:
            return
        if len(self._published) > 1 << 20:        # a bound on the memory of what was sent (re-sending is harmless)
            self._published.clear()
        self._published.add(key)
        kv = self._gather(blocks, start_pos, len(token_ids), start_pos // self.kv.block_size)
        record = SegmentRecord(np.asarray(token_ids, dtype=np.int32), cache_salt, start_pos, 1, False, kv)
        self._jobs.put(("put", key, record))

    def publish_merge(self, entry: SegmentEntry, blocks, start: int) -> None:
        """This replica computed another exact encoding of `entry`'s tokens at position `start` (its
        KV in `blocks`, which cover the request from position 0): fold it into the stored record."""
        if self.remote is None or not entry.explicit:
            return
        fresh = self._gather(blocks, start, len(entry), 0)
        record = SegmentRecord(np.frombuffer(entry.tokens, dtype=np.int32).copy(), entry.cache_salt, start, 1,
                               True, fresh)
        self._jobs.put(("merge", self.key(entry.tokens, entry.cache_salt), record))

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                kind, key, record = job
                record.kv = record.kv.cpu()
                if kind == "put":
                    # the anchors follow the record, once it is in the store (never for a dropped write)
                    publish = None if self.anchors is None else (
                        lambda k=key, t=record.token_ids: self.anchors.publish(k, t))
                    self.remote.put_record(key, record, only_if_absent=True, on_stored=publish)
                else:
                    self.remote.merge(key, lambda current, r=record: self._merged(current, r))
            except Exception:                       # a bad job must not stop the writer
                logger.exception("segment store writer failed on a job")
            finally:
                self._jobs.task_done()

    def _merged(self, current: bytes | None, fresh: SegmentRecord) -> bytes | None:
        """The stored record with `fresh` (one encoding) folded in: keys re-rotated to the record's
        positions, the running mean over num_encodings + 1; None (leave it) at the merge cap."""
        if current is None:
            return encode(fresh)
        try:
            cur = decode(current, fresh.cache_salt)
        except CorruptRecord:
            self.remote.count_corrupt()
            return encode(fresh)
        if cur.num_encodings >= self.merge_cap or not np.array_equal(cur.token_ids, fresh.token_ids):
            return None
        inv_freqs = [f.cpu() for f in self.kv.layer_inv_freqs()]
        delta = torch.full((fresh.num_tokens,), cur.start_pos - fresh.start_pos, dtype=torch.int64)
        # no in-place change of `fresh`: a compare-and-set retry calls this again with the same record
        keys = torch.stack([rerotate_keys(fresh.kv[layer, 0], delta, f) for layer, f in enumerate(inv_freqs)])
        new = torch.stack([keys, fresh.kv[:, 1].float()], dim=1)         # [layers, 2, n, kv_heads, head_dim]
        mean = torch.lerp(cur.kv.float(), new, 1.0 / (cur.num_encodings + 1)).to(cur.kv.dtype)
        return encode(SegmentRecord(cur.token_ids, cur.cache_salt, cur.start_pos, cur.num_encodings + 1,
                                    cur.explicit, mean))

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write reached the store (tests, shutdown)."""
        if self._jobs is None:
            return True
        deadline = time.monotonic() + timeout_s
        while self._jobs.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._jobs.unfinished_tasks and self.remote.flush(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.put(None)
            self._worker.join(timeout=5)
            self._jobs = None
        if self.remote is not None:
            self.remote.close()
        if self.anchors is not None:
            self.anchors.close()

    # ---- tiers -> device -----------------------------------------------------------------------
    def load(self, spans: list[tuple[list[int], str | None]], index: SegmentIndex) -> int:
        """Install as entries of `index` the segments `spans` (token ids, salt) that a tier holds
        (`fetch`); returns how many. A remote record's decode + install time feeds the fetch policy."""
        installed = 0
        borrowed = False
        for record, decode_s in self.fetch(spans, borrow=True):
            if record is None:
                continue
            borrowed |= decode_s is not None
            t0 = time.perf_counter()
            if self.install(record, index) is None:
                continue
            installed += 1
            if decode_s is not None:
                self.policy.observe_load(record.nbytes, decode_s + time.perf_counter() - t0)
        if borrowed and self.kv.device.type == "cuda":
            # the host-to-device copies read the tier's transfer buffer, which the next fetch overwrites
            torch.cuda.current_stream(self.kv.device).synchronize()
        return installed

    def fetch(self, spans: list[tuple[list[int], str | None]], *,
              borrow: bool = False) -> list[tuple[SegmentRecord | None, float | None]]:
        """(record, decode seconds) of the segments `spans` (token ids, salt) that a tier holds: the
        host tier first (no decode: None), then one remote round trip for the rest that the fetch
        policy finds cheaper to fetch than to recompute. Token ids are verified; a corrupt record, or
        one whose K/V is not of this engine's shape and dtype, is dropped (and counted). `borrow`: a
        remote record's K/V may be a view of the tier's transfer buffer (a Mooncake read), valid until
        the next fetch: the caller installs it before that."""
        out: list[tuple[SegmentRecord | None, float | None]] = [(None, None)] * len(spans)
        keys = [self.key(toks, salt) for toks, salt in spans]
        if self.host is not None:
            for i, ((toks, _), key) in enumerate(zip(spans, keys)):
                record = self.host.get(key)
                if record is not None and np.array_equal(record.token_ids, np.asarray(toks, dtype=np.int32)):
                    out[i] = (self.host.pop(key), None)
                    self._tell_host("take", key, None)
        if self.remote is None:
            return out
        wanted = []
        for i, (toks, _) in enumerate(spans):
            if out[i][0] is not None:
                continue
            decision = self.policy.decide(len(toks), len(toks) * self.bytes_per_token,
                                          self.remote.bandwidth(), self.remote.latency())
            if decision.fetch:
                wanted.append(i)
        if not wanted:
            return out
        t0 = time.perf_counter()
        values = self.remote.get_many([keys[i] for i in wanted])
        for i, value in zip(wanted, values):
            if value is None:
                continue
            t_decode = time.perf_counter()
            try:
                record = decode(value, spans[i][1], copy=not borrow)
                self._check_shape(record)
            except CorruptRecord as e:
                logger.warning("dropping a corrupt segment record %s: %s", keys[i], e)
                self.remote.count_corrupt(keys[i])            # counted, and deleted from the store
                continue
            if np.array_equal(record.token_ids, np.asarray(spans[i][0], dtype=np.int32)):
                out[i] = (record, time.perf_counter() - t_decode)
        self.fetch_seconds += time.perf_counter() - t0
        return out

    def load_by_content(self, prompt: np.ndarray, intervals: list[tuple[int, int]], cache_salt: str | None,
                        index: SegmentIndex, min_tokens: int) -> int:
        """Spans found by content across replicas: install as entries of `index` the records of the
        shared store that other replicas published and that hold a run of at least `min_tokens`
        tokens of prompt[a:b] for an interval (a, b) of `intervals` (the stretches no local source
        serves). The prompt's anchors there are looked up in one round trip; the records they propose
        (the most-voted first, at most MAX_SPAN_FETCH, each only if its anchors on one alignment span at
        least `min_tokens` tokens) are fetched when the fetch policy finds it
        cheaper than recomputing, and installed only if their tokens equal the prompt's at the
        aligned offset for at least `min_tokens` tokens (a forced or chance collision is rejected and
        counted). Returns how many were installed; never raises for store trouble."""
        if self.anchors is None or not intervals:
            return 0
        from sparsex.kvstore.anchor_index import record_prefix
        from sparsex.segment.span_index import KGRAM, anchors
        positions, hashes = [], []
        for a, b in intervals:
            pos, h = anchors(prompt[a:b])
            positions += (pos + a).tolist()
            hashes += h.tolist()
        if not hashes:
            return 0
        prefix, _ = record_prefix(self.key([], cache_salt))
        t0 = time.perf_counter()
        refs = self.anchors.lookup(prefix, hashes)
        self._span["lookups"] += 1
        # segment hash -> {alignment (prompt position of its token 0): [votes, first, last anchor position]}
        votes: dict[str, dict[int, list[int]]] = {}
        lengths: dict[str, int] = {}
        through: dict[str, list] = {}       # segment hash -> the (anchor hash, reference) pairs that name it
        for p, h, rs in zip(positions, hashes, refs):
            for r in rs:
                v = votes.setdefault(r.segment_hash, {}).setdefault(p - r.offset, [0, p, p])
                v[0], v[1], v[2] = v[0] + 1, min(v[1], p), max(v[2], p)
                lengths[r.segment_hash] = r.length
                through.setdefault(r.segment_hash, []).append((h, r))
        # an alignment whose anchors span fewer than min_tokens tokens proposes no run worth a fetch (a
        # short phrase every prompt repeats): the payload is not moved for it
        for seg in list(votes):
            votes[seg] = {d: v for d, v in votes[seg].items() if v[2] - v[1] + KGRAM >= min_tokens}
            if not votes[seg]:
                del votes[seg]
        ranked = sorted(votes, key=lambda seg: -max(v[0] for v in votes[seg].values()))[:MAX_SPAN_FETCH]
        free = sum(b - a for a, b in intervals)
        wanted = []
        for seg in ranked:
            try:
                if bytes.fromhex(seg) in index.entries:
                    continue        # an entry here already (the record key ends with the entry's key)
            except ValueError:
                continue            # not a segment hash: nothing this engine wrote
            n = lengths[seg]
            decision = self.policy.decide(min(n, free), n * self.bytes_per_token, self.remote.bandwidth(),
                                          self.remote.latency())
            if decision.fetch:
                wanted.append(seg)
        if not wanted:
            self.fetch_seconds += time.perf_counter() - t0
            return 0
        values = self.remote.get_many([prefix + seg for seg in wanted])
        self.fetch_seconds += time.perf_counter() - t0
        read = self.remote.stats().up         # a failed read returns nothing, and proves no record gone
        installed = 0
        for seg, value in zip(wanted, values):
            key = prefix + seg
            if value is None:
                if read:
                    self._span["missing"] += 1
                    self._forget(key, through[seg])
                continue
            t_decode = time.perf_counter()
            try:
                record = decode(value, cache_salt)
                self._check_shape(record)
            except CorruptRecord as e:
                logger.warning("dropping a corrupt segment record %s: %s", key, e)
                self.remote.count_corrupt(key)
                self._forget(key, through[seg])
                continue
            self._span["candidates"] += 1
            if not any(_verified_run(prompt, record.token_ids, d, intervals) >= min_tokens
                       for d in sorted(votes[seg], key=lambda d: -votes[seg][d][0])):
                self._span["rejected"] += 1
                continue
            entry = self.install(record, index)
            if entry is None:
                continue
            entry.shared = True
            self._published.add(key)
            installed += 1
            self._span["installed"] += 1
            self._span["installed_tokens"] += record.num_tokens
            self.policy.observe_load(record.nbytes, time.perf_counter() - t_decode)
        return installed

    def _forget(self, key: str, refs: list) -> None:
        """The anchors proposed the record `key` and the store no longer holds it (or just dropped it as
        corrupt): remove `refs` from the index on the tier's writer thread, after the tier's own removal
        of the record (queued before), off the scheduling path."""
        self.remote.after_writes(lambda: self.anchors.forget(key, refs))

    def _check_shape(self, record: SegmentRecord) -> None:
        """CorruptRecord unless the record's K/V fits this engine's KV cache (a record of another model or
        layout that reached this key: a forged or colliding index entry)."""
        k_cache = self.kv.kv_caches[0][0]
        want = (len(self.kv.kv_caches), 2, record.num_tokens, *k_cache.shape[2:])
        if tuple(record.kv.shape) != want or record.kv.dtype != self.kv.dtype:
            raise CorruptRecord(f"record K/V {tuple(record.kv.shape)} {record.kv.dtype} does not fit this "
                                f"engine's {want} {self.kv.dtype}")

    def install(self, record: SegmentRecord, index: SegmentIndex) -> SegmentEntry | None:
        """Make `record` an entry of `index`: blocks from the pool's free queue (None, nothing
        changed, when it is short: a fetch never evicts what the device holds), K/V of every layer
        written."""
        bs = self.kv.block_size
        first, last = block_span(record.start_pos, record.num_tokens, bs)
        pool = index.pool
        if pool.num_free_blocks < last - first + 1:
            return None
        blocks = pool.get_new_blocks(last - first + 1)
        slots = self._slots(blocks, record.start_pos, record.num_tokens, first)
        self._tell_host("install", self.key(record.token_ids.tolist(), record.cache_salt), slots)
        self.kv.write(slots, record.kv.to(self.kv.device, non_blocking=True))
        entry = index.insert(record.token_ids.tolist(), record.cache_salt, [None] * first + blocks,
                                  record.start_pos, explicit=record.explicit)
        pool.free_blocks(list(reversed(blocks)))          # the entry holds them now
        if entry is None:
            return None
        entry.num_encodings = record.num_encodings
        self.installed_tokens += record.num_tokens
        return entry

    # ---- accounting ----------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        st = StoreStats(fetch_seconds=self.fetch_seconds, fetch_decisions=self.policy.fetched,
                        recompute_decisions=self.policy.recomputed, installed_tokens=self.installed_tokens)
        if self.host is not None:
            h = self.host.stats()
            st.host_hits, st.host_misses, st.host_bytes_in, st.host_bytes_out, st.host_used_bytes = (
                h.hits, h.misses, h.bytes_in, h.bytes_out, h.used_bytes)
        if self.remote is not None:
            r = self.remote.stats()
            st.remote_hits, st.remote_misses, st.remote_errors, st.remote_corrupt = r.hits, r.misses, r.errors, r.corrupt
            st.remote_bytes_read, st.remote_bytes_written, st.remote_writes_dropped = (
                r.bytes_read, r.bytes_written, r.writes_dropped)
            st.remote_up = r.up
            st.remote_stale = getattr(r, "stale", 0)        # a Redis record has no separate payload to lose
            st.remote_kind = self.remote_kind
        if self.anchors is not None:
            a = self.anchors.stats()
            st.span_records_published, st.span_anchors_published = a.published_records, a.published_anchors
            st.span_refs_removed = a.removed_refs
            st.remote_errors += a.errors
            st.remote_up = st.remote_up and a.up
        st.span_lookups, st.span_candidates, st.span_rejected, st.span_missing = (
            self._span["lookups"], self._span["candidates"], self._span["rejected"], self._span["missing"])
        st.span_installed, st.span_installed_tokens = self._span["installed"], self._span["installed_tokens"]
        return st

    def check_integrity(self) -> None:
        if self.host is not None:
            self.host.check_integrity()
