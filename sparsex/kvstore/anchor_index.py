"""The shared anchor index: spans found by content across replicas (EngineConfig.segment_store_spans).

A record a replica publishes to the shared store (an explicit segment, or a stretch it reused
locally: what recurs) is also published with its content anchors: the winnowed k-gram anchors of
`segment.span_index.anchors` (the function the one-replica span search uses) over the record's
token ids. Per anchor, one Redis list

    sparsex:<tenant>:<model fingerprint>:<dtype>:v<layout>:a:<anchor hash, 16 hex>
        -> up to MAX_REFS values "<segment hash, 32 hex>:<offset>:<length>", newest first

where the segment hash names the record (`record.record_key` = the same prefix + the segment hash)
and offset is the anchor's k-gram start in the record. The key carries the tenant (so another
tenant's prompt never looks the anchor up, and a Redis ACL `~sparsex:<tenant>:*` confines it), the
model, the KV dtype and the layout version (a replica of another model or layout never meets it).
A record's anchors go in one pipeline (LREM + LPUSH + LTRIM per anchor: no duplicate, capped), sent
by the tier's writer thread once the record is in the store (`put_record(on_stored=...)`), so no
anchor is published for a record whose write was dropped.

A reference outlives its record when the store evicts the record (allkeys-lru), loses its payload
(Mooncake) or drops it as corrupt. The replica whose fetch finds that out removes the references it
followed (`forget`: LREM per anchor list it looked up), only if the record is still absent at that
moment: WATCH the record key, EXISTS, then MULTI/LREM/EXEC, so a record another replica stored again
meanwhile (a concurrent SET aborts the EXEC) keeps its references. Records carry no TTL, and neither
do the lists: both go by the server's eviction, a list holds at most MAX_REFS references, and a stale
one costs one missed fetch before it is removed.

A replica looks a prompt's stretches that no local source serves up in one pipeline (LRANGE per
anchor), then fetches the candidate records and verifies their token ids against the prompt at the
aligned offset (`SegmentStore.load_by_content`): a hash only proposes. Like the record tier, this
client never raises for server trouble: an error is counted, the index is marked down for
`reconnect_s` (lookups return nothing at once, publications are dropped) and then tried again.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sparsex.kvstore.backoff import Backoff
from sparsex.segment.span_index import MAX_REFS, anchors
from sparsex.store_urls import parse_redis_url as parse_url
from sparsex.store_urls import redact as _redact


ANCHOR_TAG = "a:"


@dataclass(frozen=True)
class AnchorRef:
    segment_hash: str          # hex: the record's key is the record prefix + this
    offset: int                # the anchor's k-gram start in the record's tokens
    length: int                # the record's tokens

    @property
    def value(self) -> str:
        """The list element this reference is stored as."""
        return f"{self.segment_hash}:{self.offset}:{self.length}"


@dataclass(frozen=True)
class AnchorIndexStats:
    published_records: int = 0     # records whose anchors were written
    published_anchors: int = 0
    lookups: int = 0               # prompts looked up (one round trip each)
    looked_up_anchors: int = 0
    found_refs: int = 0            # (record, offset) references returned
    errors: int = 0
    dropped: int = 0               # publications and removals not sent: index down or failed
    forgotten_records: int = 0     # records found gone whose references were removed (forget)
    removed_refs: int = 0          # references removed from anchor lists
    kept_refs: int = 0             # references forget left: their record was in the store again
    up: bool = True


def record_prefix(record_key: str) -> tuple[str, str]:
    """(prefix, segment hash) of a record key (`record.record_key`: prefix + segment hash hex)."""
    prefix, _, seg = record_key.rpartition(":")
    return prefix + ":", seg


class AnchorIndex:
    """One replica's client of the shared anchor index (thread-safe: the writer thread publishes, the
    scheduler looks up)."""

    def __init__(self, url: str, *, timeout_s: float = 0.5, reconnect_s: float = 1.0):
        parsed = parse_url(url)
        self.where = f"{parsed['host']}:{parsed['port']}/{parsed['db']}"
        self.url = url
        self.reconnect_s = reconnect_s
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._lock = threading.Lock()
        self._c = {"published_records": 0, "published_anchors": 0, "lookups": 0, "looked_up_anchors": 0,
                   "found_refs": 0, "errors": 0, "dropped": 0, "forgotten_records": 0, "removed_refs": 0,
                   "kept_refs": 0}
        self._health = Backoff(f"anchor index {self.where}", reconnect_s)

    def _failed(self, what: str, e: BaseException) -> None:
        with self._lock:
            self._c["errors"] += 1
            self._health.failed(what, e)

    def publish(self, record_key: str, token_ids: np.ndarray) -> None:
        """Write the anchors of a record (`token_ids`: its tokens) in one pipeline; never raises."""
        if self._health.down:
            with self._lock:
                self._c["dropped"] += 1
            return
        prefix, seg = record_prefix(record_key)
        pos, hashes = anchors(np.asarray(token_ids, dtype=np.int32))
        n = len(token_ids)
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for h, off in zip(hashes.tolist(), pos.tolist()):
                    key, value = f"{prefix}{ANCHOR_TAG}{h:016x}", AnchorRef(seg, off, n).value
                    pipe.lrem(key, 0, value)
                    pipe.lpush(key, value)
                    pipe.ltrim(key, 0, MAX_REFS - 1)
                pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._failed("anchor publish", e)
            with self._lock:
                self._c["dropped"] += 1
            return
        with self._lock:
            self._health.succeeded()
            self._c["published_records"] += 1
            self._c["published_anchors"] += len(pos)

    def lookup(self, prefix: str, hashes: list[int]) -> list[list[AnchorRef]]:
        """The references of each anchor hash under `prefix` (a record prefix: tenant, model, dtype,
        layout), in one round trip; all empty (never an exception) on server trouble."""
        if not hashes:
            return []
        empty: list[list[AnchorRef]] = [[] for _ in hashes]
        if self._health.down:
            return empty
        try:
            with self._client.pipeline(transaction=False) as pipe:
                for h in hashes:
                    pipe.lrange(f"{prefix}{ANCHOR_TAG}{h:016x}", 0, MAX_REFS - 1)
                values = pipe.execute()
        except (redis.RedisError, OSError) as e:
            self._failed("anchor lookup", e)
            return empty
        out = []
        for refs in values:
            parsed = []
            for v in refs or ():
                try:
                    seg, off, n = v.decode().split(":")
                    parsed.append(AnchorRef(seg, int(off), int(n)))
                except (ValueError, UnicodeDecodeError):
                    continue                 # not ours: a hash or a value only proposes anyway
            out.append(parsed)
        with self._lock:
            self._health.succeeded()
            self._c["lookups"] += 1
            self._c["looked_up_anchors"] += len(hashes)
            self._c["found_refs"] += sum(len(r) for r in out)
        return out

    def forget(self, record_key: str, refs: list[tuple[int, AnchorRef]]) -> int:
        """The record `record_key` was not in the store (evicted, its payload lost, dropped as corrupt):
        remove `refs` ((anchor hash, reference) pairs: those a lookup followed to it) from their anchor
        lists, in one transaction that runs only if the record is still absent (WATCH, EXISTS, then
        MULTI, LREM per reference, EXEC: a replica that stores it again meanwhile aborts it). Returns the
        references removed; never raises."""
        if not refs:
            return 0
        if self._health.down:
            with self._lock:
                self._c["dropped"] += 1
            return 0
        prefix, _ = record_prefix(record_key)
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.watch(record_key)
                if pipe.exists(record_key):
                    pipe.unwatch()
                    removed = None                  # stored again: its references are good
                else:
                    pipe.multi()
                    for h, ref in refs:
                        pipe.lrem(f"{prefix}{ANCHOR_TAG}{h:016x}", 0, ref.value)
                    removed = sum(pipe.execute())
        except redis.WatchError:
            removed = None                          # written meanwhile: not ours to judge
        except redis.ResponseError as e:            # refused (an ACL without WATCH or LREM): the index stays up
            with self._lock:
                self._c["errors"] += 1
                self._c["dropped"] += 1
                self._health.refused("removal of stale references", e)
            return 0
        except (redis.RedisError, OSError) as e:
            self._failed("anchor removal", e)
            with self._lock:
                self._c["dropped"] += 1
            return 0
        with self._lock:
            self._health.succeeded()
            if removed is None:
                self._c["kept_refs"] += len(refs)
                return 0
            self._c["forgotten_records"] += 1
            self._c["removed_refs"] += removed
        return removed

    def stats(self) -> AnchorIndexStats:
        with self._lock:
            return AnchorIndexStats(**self._c, up=self._health.up)

    def close(self) -> None:
        self._client.close()

    def __repr__(self) -> str:
        return f"AnchorIndex({_redact(self.url)})"
