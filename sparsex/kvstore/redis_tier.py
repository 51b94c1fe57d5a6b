"""The Redis tier of the segment store: records (`record.py`) shared by every replica.

Reads are synchronous and batched: `get_many` asks for all of a request's spans in one MGET. Writes
are write-behind: `put`, `merge` and the DEL of a corrupt value go to a queue that one background
thread sends, so a slow or dead server never delays a request; what must follow a write runs on that
thread after it (`put_record(on_stored=...)`, `after_writes`: the anchor index's writes). The tier
never raises for server trouble: a connection error, a timeout or a refused command (wrong password,
ACL) is counted, the tier is marked down for `reconnect_s` (reads return misses at once, writes are
dropped and counted) and then tried again; redis-py's pool opens a new connection, so a restarted
server serves again.

Timings of the reads feed two estimates the fetch policy (`fetch_policy.py`) weighs against
recomputing a span: the round-trip latency (EWMA over reads that moved little data) and the
bandwidth (size-weighted EWMA over reads that returned data, their latency taken out).
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from sparsex.kvstore.backoff import Backoff
from sparsex.kvstore.fetch_policy import TransferEstimate
from sparsex.kvstore.record import SegmentRecord, encode
from sparsex.store_urls import parse_redis_url as parse_url
from sparsex.store_urls import redact as _redact

log = logging.getLogger(__name__)

# A read that moved less than this is a latency sample (a round trip with next to no payload).
# A merge's queued size (its value is made in the writer thread) and a DEL's, beyond the key.
_OP_OVERHEAD_BYTES = 64
_CAS_MAX_ATTEMPTS = 64


@dataclass(frozen=True)
class RedisTierStats:
    gets: int = 0                 # keys asked for (get_many); gets == hits + misses
    hits: int = 0
    misses: int = 0               # includes the keys of reads that failed or were skipped while down
    errors: int = 0               # failed round trips (reads and writes): connection, timeout, auth, ACL
    corrupt: int = 0              # values the caller found corrupt (count_corrupt)
    bytes_read: int = 0
    bytes_written: int = 0        # values sent by SET (puts that an NX found present count too)
    writes_dropped: int = 0       # puts/merges/deletes not done: queue full, tier down, failed, CAS gave up
    cas_retries: int = 0          # merge attempts lost to a concurrent writer (WatchError), retried
    fetch_seconds_total: float = 0.0
    up: bool = True               # the last round trip succeeded (or none failed yet)


class RedisTier:
    """One replica's client of the shared Redis store (thread-safe; one writer thread)."""

    def __init__(self, url: str, *, timeout_s: float = 0.5, max_pending_bytes: int = 256 << 20,
                 reconnect_s: float = 1.0):
        self.url = url
        parsed = parse_url(url)
        if timeout_s <= 0 or reconnect_s < 0 or max_pending_bytes < 0:
            raise ValueError(f"need timeout_s > 0, reconnect_s >= 0, max_pending_bytes >= 0; got "
                             f"{timeout_s}, {reconnect_s}, {max_pending_bytes}")
        self.where = f"{parsed['host']}:{parsed['port']}/{parsed['db']}"      # for logs: no password
        self.timeout_s = timeout_s
        self.max_pending_bytes = max_pending_bytes
        self.reconnect_s = reconnect_s
        # No retries inside redis-py (its default retries a failed command 3 times with backoff): a
        # read must cost at most one timeout; the down window is the retry policy.
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)

        self._lock = threading.Lock()
        self._c = {"gets": 0, "hits": 0, "misses": 0, "errors": 0, "corrupt": 0, "bytes_read": 0,
                   "bytes_written": 0, "writes_dropped": 0, "cas_retries": 0}
        self._fetch_seconds = 0.0
        self._health = Backoff(f"Redis tier {self.where}", reconnect_s)
        self._cost = TransferEstimate()         # measured read latency and bandwidth (under the lock)

        self._queue: queue.Queue = queue.Queue()
        self._pending_bytes = 0
        self._pending_ops = 0                   # queued + the one being sent
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name=f"sparsex-redis-writer[{self.where}]",
                                        daemon=True)
        self._writer.start()

    # ---- health -------------------------------------------------------------------------------
    def _failed(self, what: str, e: BaseException) -> None:
        with self._lock:
            self._c["errors"] += 1
            self._health.failed(what, e)

    def _refused(self, what: str, e: redis.ResponseError) -> None:
        """The server answered but refused the command (an ACL without this key or command, OOM under
        maxmemory with noeviction): counted, logged once per kind, and the tier stays up, since the
        connection is fine and other keys or reads may well succeed."""
        with self._lock:
            self._c["errors"] += 1
            self._health.refused(what, e)

    def _succeeded(self) -> None:
        self._health.succeeded()

    # ---- reads --------------------------------------------------------------------------------
    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """One round trip (MGET) for a request's spans; all None (never an exception) on server trouble."""
        keys = list(keys)
        if not keys:
            return []
        values: list[bytes | None] | None = None
        if not self._health.down:
            t0 = time.perf_counter()
            try:
                values = self._client.mget(keys)
            except redis.ResponseError as e:
                self._refused("MGET", e)
            except (redis.RedisError, OSError) as e:
                self._failed("MGET", e)
            else:
                self._observe(time.perf_counter() - t0, values)
        if values is None:
            with self._lock:
                self._c["gets"] += len(keys)
                self._c["misses"] += len(keys)
            return [None] * len(keys)
        return values

    def _observe(self, seconds: float, values: list[bytes | None]) -> None:
        nbytes = sum(len(v) for v in values if v is not None)
        hits = sum(v is not None for v in values)
        with self._lock:
            self._succeeded()
            self._c["gets"] += len(values)
            self._c["hits"] += hits
            self._c["misses"] += len(values) - hits
            self._c["bytes_read"] += nbytes
            self._fetch_seconds += seconds
            self._cost.observe(seconds, nbytes)

    def bandwidth(self) -> float | None:
        """Bytes/s of reads that returned data (size-weighted EWMA, latency excluded); None before any."""
        with self._lock:
            return self._cost.bandwidth

    def latency(self) -> float | None:
        """Seconds per round trip (EWMA); None before any successful read."""
        return self._cost.latency

    # ---- writes (write-behind) ----------------------------------------------------------------
    def _enqueue(self, op: tuple, nbytes: int) -> bool:
        with self._lock:
            if self._closed or self._health.down or self._pending_bytes + nbytes > self.max_pending_bytes:
                self._c["writes_dropped"] += op[0] != "call"
                return False
            self._pending_bytes += nbytes
            self._pending_ops += 1
        self._queue.put((op, nbytes))
        return True

    def put(self, key: str, value: bytes, *, only_if_absent: bool = True,
            on_stored: Callable[[], None] | None = None) -> None:
        """Queue a SET (NX when only_if_absent) and return at once; dropped and counted if the queue is
        full. `on_stored` runs on the writer thread once the key holds a value (this one, or the one an
        NX found); not if the write is dropped or fails."""
        value = value if isinstance(value, bytes) else bytes(value)
        self._enqueue(("set", key, value, only_if_absent, on_stored), len(key) + len(value))

    def put_record(self, key: str, record: SegmentRecord, *, only_if_absent: bool = True,
                   on_stored: Callable[[], None] | None = None) -> None:
        """`put` of the encoded record (encoded here, in the caller's thread)."""
        self.put(key, encode(record), only_if_absent=only_if_absent, on_stored=on_stored)

    def after_writes(self, fn: Callable[[], None]) -> bool:
        """Run `fn` on the writer thread once the writes queued before it were sent (a DEL that
        count_corrupt queued has landed); False (not run, not counted as a write) while the tier is
        down or closed. `fn` handles its own server trouble."""
        return self._enqueue(("call", None, fn), _OP_OVERHEAD_BYTES)

    def merge(self, key: str, update: Callable[[bytes | None], bytes | None]) -> None:
        """Queue a compare-and-set: the writer WATCHes key, GETs it, writes update(current) in MULTI/EXEC
        (nothing when it returns None), and retries on a concurrent write, so no update is lost.
        `update` runs in the writer thread and may run more than once."""
        self._enqueue(("merge", key, update), len(key) + _OP_OVERHEAD_BYTES)

    def count_corrupt(self, key: str | None = None) -> None:
        """The caller found a value that failed record.decode: count it, and (given its key) queue a DEL
        so it is not fetched again."""
        with self._lock:
            self._c["corrupt"] += 1
        if key is not None:
            self._enqueue(("del", key), len(key) + _OP_OVERHEAD_BYTES)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            op, nbytes = item
            try:
                if op[0] == "call":
                    self._callback(op[2])
                elif self._health.down:
                    with self._lock:
                        self._c["writes_dropped"] += 1
                else:
                    self._send(op)
            except Exception:                     # noqa: BLE001 - a caller's update() raising, a bug here
                log.exception("Redis tier %s: %s of %r failed", self.where, op[0], op[1])
                with self._lock:
                    self._c["writes_dropped"] += 1
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes
                    self._pending_ops -= 1
                    if self._pending_ops == 0:
                        self._idle.notify_all()

    def _send(self, op: tuple) -> None:
        kind, key = op[0], op[1]
        try:
            if kind == "set":
                self._client.set(key, op[2], nx=op[3])
                written = len(op[2])
            elif kind == "del":
                self._client.delete(key)
                written = 0
            else:
                written = self._cas(key, op[2])
        except redis.ResponseError as e:
            self._refused(kind.upper(), e)
            with self._lock:
                self._c["writes_dropped"] += 1
            return
        except (redis.RedisError, OSError) as e:
            self._failed(kind.upper(), e)
            with self._lock:
                self._c["writes_dropped"] += 1
            return
        with self._lock:
            self._succeeded()
            self._c["bytes_written"] += written
        if kind == "set" and op[4] is not None:
            self._callback(op[4])

    def _callback(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:                         # noqa: BLE001 - the caller's bug: the writer goes on
            log.exception("Redis tier %s: a callback after a write failed", self.where)

    def _cas(self, key: str, update: Callable[[bytes | None], bytes | None]) -> int:
        with self._client.pipeline(transaction=True) as pipe:
            for attempt in range(_CAS_MAX_ATTEMPTS):
                try:
                    pipe.watch(key)
                    new = update(pipe.get(key))
                    if new is None:
                        pipe.unwatch()
                        return 0
                    pipe.multi()
                    pipe.set(key, new)
                    pipe.execute()
                    return len(new)
                except redis.WatchError:
                    with self._lock:
                        self._c["cas_retries"] += 1
                    pipe.reset()
                    time.sleep(random.uniform(0, 0.001 * min(attempt + 1, 8)))   # de-synchronize rivals
        log.warning("Redis tier %s: merge of %r gave up after %d conflicting attempts",
                    self.where, key, _CAS_MAX_ATTEMPTS)
        with self._lock:
            self._c["writes_dropped"] += 1
        return 0

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued write was sent (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending_ops:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Send what is queued (each write bounded by the timeout; dropped while down), stop the writer,
        close the connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=max(5.0, 4 * self.timeout_s))
        self._client.close()

    # ---- metrics ------------------------------------------------------------------------------
    def stats(self) -> RedisTierStats:
        with self._lock:
            return RedisTierStats(**self._c, fetch_seconds_total=self._fetch_seconds, up=self._health.up)

    def __repr__(self) -> str:
        return f"RedisTier({_redact(self.url)})"
