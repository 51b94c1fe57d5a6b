"""The Mooncake tier of the segment store: record payloads in a Mooncake Store, their index in Redis.

    mooncake://MASTER:PORT?metadata=http://HOST:PORT/metadata&protocol=tcp     (+ --segment-index redis://...)

A Mooncake Store is a master that keeps object metadata and clients (here: the replicas) that each
mount a segment of their memory (`segment=`) and move bytes between registered buffers over TCP or
RDMA (its transfer engine). Payloads are the encoded records (`record.py`); they go in and out
through two registered buffers per replica, without a serialized copy on the way:

    write   encode_into(write buffer)  ->  batch_put_from(its parts)  ->  Redis SET key -> {payload, size, version, part}
    read    Redis MGET keys  ->  batch_get_into(read buffer, every part of every record at its offset)  ->  views of it

A payload larger than `part=` (16M) is stored as parts of that size (`payload#0`, `payload#1`, ...), moved in
the same one batch call: the transfer engine moves the objects of a batch at once, where one large object
moved at a third of the speed (TCP loopback, a 64 MB record as 1 object against 2-4).

A read hands out views of the read buffer (valid until the next read): `SegmentStore.load` decodes
them in place (`decode(copy=False)`) and installs each with one host-to-device copy (the buffer is
pinned where CUDA is). Redis holds the index because it gives what Mooncake does not: a
compare-and-set (WATCH/MULTI) for merges, key-prefix ACLs per tenant (record_key) and a lookup that
needs no transfer; the payload key carries a fresh nonce per version, so a payload is never
overwritten in place:

    merge   WATCH key; GET entry; get_into(old payload); update(); put_from(new payload key);
            MULTI SET key -> new entry EXEC   (a concurrent writer: WatchError, the new payload is
            removed and the merge retried, so no update is lost); the old payload removed afterwards

Faults never raise: the index (Redis) and the payloads (Mooncake) are each marked down for
`reconnect_s` after a failure (a read is then a miss at once, a write is dropped), and every Mooncake
call runs on a worker thread that the caller waits for at most the tier's timeout (a hung master
blocks the worker, not the engine; the tier stays down until the call returns). An index entry whose
payload is gone (evicted by Mooncake, lost with a restarted master or with the replica whose segment
held it) is a miss counted as `stale`, and the entry is removed if it still names that payload.

Reads feed the same latency and bandwidth estimates as the Redis tier (`fetch_policy.FetchPolicy`).
As there, what must follow a write runs on the writer thread after it (`put_record(on_stored=...)`,
`after_writes`: the anchor index's writes).
"""
from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import queue
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from sparsex.kvstore.backoff import Backoff
from sparsex.kvstore.fetch_policy import TransferEstimate
from sparsex.kvstore.record import SegmentRecord, encode_into
from sparsex.store_urls import parse_mooncake_url as parse_url
from sparsex.store_urls import parse_redis_url
from sparsex.store_urls import redact as _redact

log = logging.getLogger(__name__)


# Mooncake's error codes (negative returns of the client's calls) that mean something here
_OBJECT_NOT_FOUND = -704
_OBJECT_HAS_LEASE = -706
_LEASE_EXPIRED = -707                        # a read slower than the lease the master granted it

_MIN_TRANSFER_BPS = 100e6                    # a transfer's deadline: timeout + bytes at this rate
_ALIGN = 64                                  # records sit 64-byte aligned in the read buffer
_CAS_MAX_ATTEMPTS = 64
_OP_OVERHEAD_BYTES = 64
_REMOVE_RETRY_S = 1.0                        # an old payload still leased by a reader: try again later
_REMOVE_MAX_ATTEMPTS = 30                    # then leave it to Mooncake's eviction


@dataclass(frozen=True)
class MooncakeTierStats:
    gets: int = 0                 # keys asked for (get_many); gets == hits + misses
    hits: int = 0
    misses: int = 0               # includes stale entries and the keys of reads that failed or were skipped
    stale: int = 0                # index entries whose payload was gone (evicted, master restarted)
    errors: int = 0               # failed calls, index (Redis) and payload (Mooncake) together
    timeouts: int = 0             # Mooncake calls that outlasted the tier's timeout (among errors)
    corrupt: int = 0              # payloads the caller found corrupt (count_corrupt)
    bytes_read: int = 0
    bytes_written: int = 0        # payload bytes put
    writes_dropped: int = 0       # puts/merges/drops not done: queue full, tier down, failed, CAS gave up
    cas_retries: int = 0
    fetch_seconds_total: float = 0.0
    up: bool = True               # both the index and the payload store answered at the last try
    index_up: bool = True
    payload_up: bool = True


class StoreUnavailable(RuntimeError):
    """The Mooncake client library cannot be loaded (wheel or Debian libraries missing)."""


class _Busy(RuntimeError):
    """An earlier call on this worker has not returned yet (a hung store)."""


@functools.cache
def _store_module() -> Any:
    """mooncake.store, imported once. Its extension links libcudart.so.12 even in the non-CUDA wheel:
    where the system has none, the copy of the nvidia-cuda-runtime-cu12 wheel is loaded first. Its log
    (glog, to stderr) keeps errors only unless MC_LOG_LEVEL says otherwise."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        import nvidia.cuda_runtime as cuda_runtime
    except ImportError:
        cuda_runtime = None
    if cuda_runtime is not None:
        for folder in cuda_runtime.__path__:
            lib = os.path.join(folder, "lib", "libcudart.so.12")
            if os.path.exists(lib):
                ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
                break
    import mooncake.store
    return mooncake.store


def import_error() -> str | None:
    """Why the Mooncake client cannot be loaded here; None when it can."""
    try:
        _store_module()
    except (ImportError, OSError) as e:
        return (f"the Mooncake client does not load ({e}); make install installs the "
                f"mooncake-transfer-engine-non-cuda wheel and libibverbs1, librdmacm1, libnuma1")
    return None


def local_address(master_host: str) -> str:
    """The address of this host that other clients reach it at: loopback for a master on loopback, else
    the source address the routing table picks towards the master (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(master_host, None, socket.AF_INET)
        target = infos[0][4][0]
    except (OSError, IndexError):
        return "127.0.0.1"
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class _Worker:
    """Runs calls on one daemon thread; the caller waits for each at most `timeout` seconds. A call that
    did not return in time keeps the thread (and the buffer it uses): later calls raise _Busy at once
    until it returns."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending: threading.Event | None = None
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, box, done = job
            try:
                box.append((True, fn()))
            except BaseException as e:              # noqa: BLE001 - handed to the caller
                box.append((False, e))
            finally:
                done.set()

    @property
    def idle(self) -> bool:
        return self._pending is None or self._pending.is_set()

    def call(self, fn: Callable[[], Any], timeout: float) -> Any:
        with self._lock:
            if not self.idle:
                raise _Busy("an earlier call has not returned")
            box: list = []
            done = self._pending = threading.Event()
            self._jobs.put((fn, box, done))
            if not done.wait(timeout):
                raise TimeoutError(f"no answer in {timeout:.2f}s")
            ok, value = box[0]
            if ok:
                return value
            raise value

    def stop(self) -> None:
        self._jobs.put(None)


class _Buffer:
    """A byte buffer registered with the Mooncake client (pinned where CUDA is), grown on demand."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.tensor: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()

    def ensure(self, client: Any, nbytes: int) -> None:
        """At least `nbytes`, registered (call on the worker that uses the buffer)."""
        if nbytes <= self.size:
            return
        size = max(nbytes, int(self.size * 1.5), 1 << 20)
        size = (size + (1 << 20) - 1) & ~((1 << 20) - 1)
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        rc = client.register_buffer(tensor.data_ptr(), size)
        if rc != 0:
            raise OSError(f"register_buffer of {size} bytes failed ({rc})")
        if self.tensor is not None:
            client.unregister_buffer(self.tensor.data_ptr())      # views handed out keep the memory alive
        self.tensor = tensor

    @property
    def ptr(self) -> int:
        return self.tensor.data_ptr()

    def view(self, start: int, n: int) -> memoryview:
        return memoryview(self.tensor.numpy())[start:start + n]


def _deadline(timeout_s: float, nbytes: int) -> float:
    return timeout_s + nbytes / _MIN_TRANSFER_BPS


class MooncakeTier:
    """One replica's client of the shared Mooncake store (payloads) and its Redis index; thread-safe for
    one reading thread (the engine's) and any number of writers (a writer thread sends)."""

    def __init__(self, url: str, *, index_url: str, pin: bool = False, timeout_s: float | None = None,
                 index_timeout_s: float = 0.5, max_pending_bytes: int = 256 << 20, reconnect_s: float = 1.0):
        self.url = url
        self.cfg = parse_url(url)
        parse_redis_url(index_url)
        self.timeout_s = timeout_s or self.cfg["timeout"]
        if self.timeout_s <= 0 or reconnect_s < 0 or max_pending_bytes < 0 or index_timeout_s <= 0:
            raise ValueError(f"need timeout_s > 0, index_timeout_s > 0, reconnect_s >= 0, max_pending_bytes >= 0; "
                             f"got {self.timeout_s}, {index_timeout_s}, {reconnect_s}, {max_pending_bytes}")
        self.module = _store_module()
        self.where = self.cfg["master"]
        self.index_where = _redact(index_url)
        self.local_host = self.cfg["host"] or local_address(self.cfg["master_host"])
        self.max_pending_bytes = max_pending_bytes
        self.reconnect_s = reconnect_s
        self._index = redis.Redis.from_url(index_url, socket_timeout=index_timeout_s,
                                           socket_connect_timeout=index_timeout_s,
                                           retry=Retry(NoBackoff(), 0), health_check_interval=0)

        self._lock = threading.Lock()
        self._c = {"gets": 0, "hits": 0, "misses": 0, "stale": 0, "errors": 0, "timeouts": 0, "corrupt": 0,
                   "bytes_read": 0, "bytes_written": 0, "writes_dropped": 0, "cas_retries": 0}
        self._fetch_seconds = 0.0
        self._payload_health = Backoff(f"Mooncake tier {self.where}", reconnect_s)
        self._index_health = Backoff(f"Mooncake tier {self.where}: index {self.index_where}", reconnect_s)
        self._cost = TransferEstimate()         # measured read latency and bandwidth (under the lock)
        self._last_entries: dict[str, dict] = {}      # key -> index entry of the last read (count_corrupt)
        self.part_bytes = self.cfg["part"]

        self._client = None                           # mooncake.store.MooncakeDistributedStore once set up
        self._reader = _Worker(f"sparsex-mooncake-read[{self.where}]")
        self._writer_io = _Worker(f"sparsex-mooncake-write[{self.where}]")
        self._read_buf, self._write_buf, self._merge_buf = _Buffer(pin), _Buffer(pin), _Buffer(pin)
        self._queue: queue.Queue = queue.Queue()
        self._removals: list[tuple[float, str, int]] = []     # (due, payload key, attempts)
        self._pending_bytes = 0
        self._pending_ops = 0
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._connect(wait_s=2 * self.timeout_s)
        self._writer = threading.Thread(target=self._write_loop, name=f"sparsex-mooncake-writer[{self.where}]",
                                        daemon=True)
        self._writer.start()

    # ---- connection and health ----------------------------------------------------------------
    def _connect(self, wait_s: float) -> bool:
        """Set the client up on the read worker (a dead master blocks the worker, not the caller); a setup
        that succeeds after the caller stopped waiting still takes effect."""
        cfg = self.cfg

        def setup():
            client = self.module.MooncakeDistributedStore()
            rc = client.setup(self.local_host, cfg["metadata"], cfg["segment"], cfg["buffer"], cfg["protocol"],
                              cfg["device"], cfg["master"])
            if rc != 0:
                raise OSError(f"setup returned {rc}")
            with self._lock:
                if self._closed:
                    client.close()
                else:
                    self._client = client
            log.info("Mooncake tier %s: connected as %s (%s)", self.where, self.local_host, cfg["protocol"])

        try:
            self._reader.call(setup, wait_s)
        except (OSError, TimeoutError, _Busy, RuntimeError) as e:
            self._payload_failed("setup", e)
            return False
        return True

    def _payload_ready(self) -> bool:
        if self._payload_health.down:
            return False
        if self._client is None:
            return self._connect(wait_s=self.timeout_s)
        return True

    def _payload_failed(self, what: str, e: BaseException) -> None:
        with self._lock:
            self._c["errors"] += 1
            if isinstance(e, (TimeoutError, _Busy)):
                self._c["timeouts"] += isinstance(e, TimeoutError)
            self._payload_health.failed(what, e)

    def _payload_ok(self) -> None:
        with self._lock:
            self._payload_health.succeeded()

    def _index_ready(self) -> bool:
        return not self._index_health.down

    def _index_failed(self, what: str, e: BaseException) -> None:
        with self._lock:
            self._c["errors"] += 1
            self._index_health.failed(what, e)

    def _index_ok(self) -> None:
        with self._lock:
            self._index_health.succeeded()

    # ---- index entries ------------------------------------------------------------------------
    @staticmethod
    def _entry(raw: bytes | None) -> dict | None:
        """An index entry {"p": payload key, "n": bytes, "v": version, "s": part bytes}; None if absent or
        malformed."""
        if raw is None:
            return None
        try:
            e = json.loads(raw)
            if (isinstance(e, dict) and isinstance(e.get("p"), str) and isinstance(e.get("n"), int) and e["n"] > 0
                    and isinstance(e.get("s"), int) and e["s"] > 0):
                return e
        except ValueError:
            pass
        return None

    @staticmethod
    def _parts(entry: dict) -> list[tuple[str, int, int]]:
        """(object key, offset in the payload, bytes) of each object `entry`'s payload is stored as: the
        payload key itself when it fits one part."""
        n, part = entry["n"], entry["s"]
        if n <= part:
            return [(entry["p"], 0, n)]
        return [(f"{entry['p']}#{i}", at, min(part, n - at)) for i, at in enumerate(range(0, n, part))]

    @staticmethod
    def _joined(parts: list[tuple[str, int, int]], rcs: list[int]) -> int:
        """One payload's result from its parts' return codes: its bytes, or the first error (a part gone:
        _OBJECT_NOT_FOUND); a short part ends the payload there (decode then rejects it)."""
        for rc in rcs:
            if rc == _OBJECT_NOT_FOUND:
                return rc
        for rc in rcs:
            if rc < 0:
                return rc
        got = 0
        for (_, _, size), rc in zip(parts, rcs):
            got += rc
            if rc != size:
                break
        return got

    @staticmethod
    def _payload_key(key: str, version: int) -> str:
        return f"{key}@{version}.{uuid.uuid4().hex[:12]}"

    # ---- reads --------------------------------------------------------------------------------
    def get_many(self, keys: list[str]) -> list[memoryview | None]:
        """The stored records of `keys` (views of the read buffer, valid until the next call) or None: one
        index round trip (MGET) and one batch_get_into; all None (never an exception) on trouble."""
        keys = list(keys)
        if not keys:
            return []
        out: list[memoryview | None] = [None] * len(keys)
        t0 = time.perf_counter()
        raws = None
        if self._index_ready():
            try:
                raws = self._index.mget(keys)
            except (redis.RedisError, OSError) as e:
                self._index_failed("MGET", e)
            else:
                self._index_ok()
        entries = [self._entry(r) for r in raws] if raws is not None else [None] * len(keys)
        wanted = [(i, e) for i, e in enumerate(entries) if e is not None]
        stale, nbytes, read = [], 0, False
        if wanted and self._payload_ready():
            offsets, total = [], 0
            parts = [self._parts(e) for _, e in wanted]
            for _, e in wanted:
                offsets.append(total)
                total += (e["n"] + _ALIGN - 1) // _ALIGN * _ALIGN
            objects = [(key, off + at, size) for off, ps in zip(offsets, parts) for key, at, size in ps]

            def batch_get():
                self._read_buf.ensure(self._client, total)
                base = self._read_buf.ptr
                flat = self._client.batch_get_into([k for k, _, _ in objects], [base + at for _, at, _ in objects],
                                                   [size for _, _, size in objects])
                out, at = [], 0
                for ps in parts:                                  # one return code per record
                    out.append(self._joined(ps, flat[at:at + len(ps)]))
                    at += len(ps)
                return out
            try:
                rcs = self._reader.call(batch_get, _deadline(self.timeout_s, total))
            except (OSError, TimeoutError, _Busy, RuntimeError) as e:
                self._payload_failed("batch_get_into", e)
            else:
                read = True
                failed = [rc for rc in rcs if rc < 0 and rc != _OBJECT_NOT_FOUND]
                if _LEASE_EXPIRED in failed:                        # the store was slower than its own lease
                    with self._lock:
                        self._c["timeouts"] += 1
                self._last_entries = {keys[i]: e for i, e in wanted}
                for (i, e), off, rc in zip(wanted, offsets, rcs):
                    if rc == _OBJECT_NOT_FOUND:
                        stale.append((keys[i], e))
                    elif rc >= 0:
                        out[i] = self._read_buf.view(off, rc)      # rc != n: truncated, decode rejects it
                        nbytes += rc
                    elif rc == -600:                                # larger than its entry says: not a record
                        out[i] = memoryview(b"")
                if failed and len(failed) == len(rcs):
                    self._payload_failed("batch_get_into", OSError(f"error {failed[0]}"))
                elif failed:
                    with self._lock:
                        self._c["errors"] += 1
                else:
                    self._payload_ok()
        seconds = time.perf_counter() - t0
        hits = sum(v is not None for v in out)
        with self._lock:
            self._c["gets"] += len(keys)
            self._c["hits"] += hits
            self._c["misses"] += len(keys) - hits
            self._c["stale"] += len(stale)
            self._c["bytes_read"] += nbytes
            if raws is not None:
                self._fetch_seconds += seconds
                if read or not wanted:
                    self._cost.observe(seconds, nbytes)
        for key, entry in stale:
            self._enqueue(("drop", key, entry), len(key) + _OP_OVERHEAD_BYTES)
        return out

    def bandwidth(self) -> float | None:
        """Bytes/s of reads that returned data (size-weighted EWMA, latency excluded); None before any."""
        with self._lock:
            return self._cost.bandwidth

    def latency(self) -> float | None:
        """Seconds per lookup + fetch with next to no payload (EWMA); None before any."""
        return self._cost.latency

    # ---- writes (write-behind) ----------------------------------------------------------------
    def _enqueue(self, op: tuple, nbytes: int) -> bool:
        with self._lock:
            if self._closed or self._pending_bytes + nbytes > self.max_pending_bytes or (
                    op[0] == "call" and not self._index_ready()) or (
                    op[0] in ("put", "merge") and (self._payload_health.down or not self._index_ready())):
                self._c["writes_dropped"] += op[0] != "call"
                return False
            self._pending_bytes += nbytes
            self._pending_ops += 1
        self._queue.put((op, nbytes))
        return True

    def put(self, key: str, value: bytes, *, only_if_absent: bool = True,
            on_stored: Callable[[], None] | None = None) -> None:
        """Queue a write of `value` under `key` (kept if present when only_if_absent); returns at once.
        `on_stored` runs on the writer thread once the index names a payload for `key` (this one, or
        the one found present); not if the write is dropped or fails."""
        value = value if isinstance(value, bytes) else bytes(value)
        self._enqueue(("put", key, value, only_if_absent, on_stored), len(key) + len(value))

    def put_record(self, key: str, record: SegmentRecord, *, only_if_absent: bool = True,
                   on_stored: Callable[[], None] | None = None) -> None:
        """Queue a write of `record`, encoded by the writer straight into the registered write buffer."""
        self._enqueue(("put", key, record, only_if_absent, on_stored), len(key) + record.nbytes + 1024)

    def after_writes(self, fn: Callable[[], None]) -> bool:
        """Run `fn` on the writer thread once the writes queued before it were sent (the removal of a
        stale or corrupt entry has landed); False (not run, not counted as a write) while the index is
        down or the tier closed. `fn` handles its own server trouble."""
        return self._enqueue(("call", None, fn), _OP_OVERHEAD_BYTES)

    def merge(self, key: str, update: Callable[[memoryview | None], bytes | None]) -> None:
        """Queue a compare-and-set: `update(current)` (None: absent; the payload bytes otherwise) gives the
        new value (None: leave it), written under a new payload key and swapped into the index only if no
        other writer changed the entry meanwhile (else retried: no update is lost). `update` runs in the
        writer thread and may run more than once."""
        self._enqueue(("merge", key, update), len(key) + _OP_OVERHEAD_BYTES)

    def count_corrupt(self, key: str | None = None) -> None:
        """The caller found a value that failed record.decode: count it, and (given its key) queue the
        removal of its index entry and payload."""
        with self._lock:
            self._c["corrupt"] += 1
        entry = self._last_entries.get(key) if key is not None else None
        if entry is not None:
            self._enqueue(("drop", key, entry), len(key) + _OP_OVERHEAD_BYTES)

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=_REMOVE_RETRY_S if self._removals else None)
            except queue.Empty:
                self._run_removals()
                continue
            if item is None:
                return
            op, nbytes = item
            try:
                if op[0] == "call":
                    self._callback(op[2])
                elif op[0] != "drop" and (self._payload_health.down or not self._index_ready()):
                    with self._lock:
                        self._c["writes_dropped"] += 1
                elif not self._send(op):
                    with self._lock:
                        self._c["writes_dropped"] += 1
            except Exception:                     # noqa: BLE001 - a caller's update() raising, a bug here
                log.exception("Mooncake tier %s: %s of %r failed", self.where, op[0], op[1])
                with self._lock:
                    self._c["writes_dropped"] += 1
            finally:
                with self._lock:
                    self._pending_bytes -= nbytes
                    self._pending_ops -= 1
                    if self._pending_ops == 0:
                        self._idle.notify_all()
            if self._removals:
                self._run_removals()

    def _send(self, op: tuple) -> bool:
        """One queued write; False when it was not done (counted by the caller)."""
        kind, key = op[0], op[1]
        try:
            if kind == "put":
                if not self._put(key, op[2], op[3]):
                    return False
                if op[4] is not None:
                    self._callback(op[4])
                return True
            if kind == "merge":
                return self._cas(key, op[2])
            return self._drop(key, op[2])
        except (redis.RedisError, OSError) as e:
            self._index_failed(kind.upper(), e)
            return False

    def _callback(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:                         # noqa: BLE001 - the caller's bug: the writer goes on
            log.exception("Mooncake tier %s: a callback after a write failed", self.where)

    def _put_payload(self, key: str, version: int, value: bytes | memoryview | SegmentRecord) -> dict | None:
        """Write `value` under a fresh payload key (in parts of at most part_bytes) through the write buffer;
        its index entry {"p", "n", "v", "s"} or None."""
        if self._client is None and not self._payload_ready():
            return None
        payload = self._payload_key(key, version)
        box: list[int] = []

        def put():
            if isinstance(value, SegmentRecord):
                self._write_buf.ensure(self._client, value.nbytes + 4096)
                n = encode_into(value, self._write_buf.view(0, self._write_buf.size))
            else:
                n = len(value)
                self._write_buf.ensure(self._client, n)
                self._write_buf.view(0, n)[:] = value
            box.append({"p": payload, "n": n, "v": version, "s": self.part_bytes})
            parts = self._parts(box[0])
            rcs = self._client.batch_put_from([k for k, _, _ in parts], [self._write_buf.ptr + at for _, at, _ in parts],
                                              [size for _, _, size in parts])
            failed = [rc for rc in rcs if rc != 0]
            if failed:                             # the parts that did land are of no use
                self._schedule_removal([k for (k, _, _), rc in zip(parts, rcs) if rc == 0])
            return failed[0] if failed else 0
        size = value.nbytes + 4096 if isinstance(value, SegmentRecord) else len(value)
        try:
            rc = self._writer_io.call(put, _deadline(self.timeout_s, size))
        except (OSError, TimeoutError, _Busy, RuntimeError) as e:
            self._payload_failed("batch_put_from", e)
            return None
        if rc != 0:
            self._payload_failed("batch_put_from", OSError(f"error {rc}"))
            return None
        self._payload_ok()
        with self._lock:
            self._c["bytes_written"] += box[0]["n"]
        return box[0]

    def _put(self, key: str, value, only_if_absent: bool) -> bool:
        if only_if_absent and self._index.exists(key):
            return True                                   # present: nothing to send
        new = self._put_payload(key, 1, value)
        if new is None:
            return False
        if only_if_absent:
            if not self._index.set(key, json.dumps(new), nx=True):   # another replica won the race: keep its record
                self._schedule_removal(self._keys(new))
        else:
            old = self._entry(self._index.set(key, json.dumps(new), get=True))
            if old is not None:
                self._schedule_removal(self._keys(old))
        self._index_ok()
        return True

    def _read_current(self, entry: dict) -> memoryview | None | bool:
        """The payload of `entry` in the merge buffer; None if it is gone; False on failure."""
        parts = self._parts(entry)

        def get():
            self._merge_buf.ensure(self._client, entry["n"])
            rcs = self._client.batch_get_into([k for k, _, _ in parts], [self._merge_buf.ptr + at for _, at, _ in parts],
                                              [size for _, _, size in parts])
            return self._joined(parts, rcs)
        try:
            rc = self._writer_io.call(get, _deadline(self.timeout_s, entry["n"]))
        except (OSError, TimeoutError, _Busy, RuntimeError) as e:
            self._payload_failed("get_into", e)
            return False
        if rc == _OBJECT_NOT_FOUND:
            with self._lock:
                self._c["stale"] += 1
            return None
        if rc < 0:
            self._payload_failed("get_into", OSError(f"error {rc}"))
            return False
        return self._merge_buf.view(0, rc)

    def _cas(self, key: str, update: Callable) -> bool:
        if self._client is None and not self._payload_ready():
            return False
        with self._index.pipeline(transaction=True) as pipe:
            for attempt in range(_CAS_MAX_ATTEMPTS):
                written = None
                try:
                    pipe.watch(key)
                    entry = self._entry(pipe.get(key))
                    current = None if entry is None else self._read_current(entry)
                    if current is False:
                        pipe.reset()
                        return False
                    new = update(current)
                    if new is None:
                        pipe.reset()
                        return True
                    version = 1 if entry is None else int(entry.get("v", 0)) + 1
                    written = self._put_payload(key, version, new)
                    if written is None:
                        pipe.reset()
                        return False
                    pipe.multi()
                    pipe.set(key, json.dumps(written))
                    pipe.execute()
                except redis.WatchError:
                    if written is not None:
                        self._schedule_removal(self._keys(written))
                    with self._lock:
                        self._c["cas_retries"] += 1
                    pipe.reset()
                    time.sleep(random.uniform(0, 0.001 * min(attempt + 1, 8)))
                    continue
                self._index_ok()
                if entry is not None:
                    self._schedule_removal(self._keys(entry))
                return True
        log.warning("Mooncake tier %s: merge of %r gave up after %d conflicting attempts",
                    self.where, key, _CAS_MAX_ATTEMPTS)
        return False

    def _drop(self, key: str, dropped: dict) -> bool:
        """Remove the index entry of `key` if it still names the payload of `dropped` (an entry found stale
        or corrupt), and that payload."""
        with self._index.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)
                entry = self._entry(pipe.get(key))
                if entry is not None and entry["p"] == dropped["p"]:
                    pipe.multi()
                    pipe.delete(key)
                    pipe.execute()
                else:
                    pipe.reset()
            except redis.WatchError:                        # rewritten meanwhile: no longer ours to drop
                pass
        self._index_ok()
        self._schedule_removal(self._keys(dropped))
        return True

    def _keys(self, entry: dict) -> list[str]:
        return [k for k, _, _ in self._parts(entry)]

    def _schedule_removal(self, objects: list[str], attempts: int = 0) -> None:
        """Remove the objects of a payload no index entry names any more: now if no reader holds a lease
        on them, else later (a reader may still be fetching them); after _REMOVE_MAX_ATTEMPTS Mooncake's
        own eviction takes them."""
        due = time.monotonic() + (_REMOVE_RETRY_S if attempts else 0.0)
        self._removals.extend((due, obj, attempts) for obj in objects)

    def _run_removals(self) -> None:
        now = time.monotonic()
        due = [r for r in self._removals if r[0] <= now]
        if not due or self._client is None or self._payload_health.down:
            return
        self._removals = [r for r in self._removals if r[0] > now]
        for _, payload, attempts in due:
            try:
                rc = self._writer_io.call(lambda p=payload: self._client.remove(p), self.timeout_s)
            except (OSError, TimeoutError, _Busy, RuntimeError) as e:
                self._payload_failed("remove", e)
                rc = None
            if (rc is None or rc == _OBJECT_HAS_LEASE) and attempts + 1 < _REMOVE_MAX_ATTEMPTS:
                self._schedule_removal([payload], attempts + 1)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued write was sent (or dropped); False on timeout. Old payloads whose
        removal waits for a reader's lease are not waited for."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending_ops:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self) -> None:
        """Send what is queued, stop the writer, close the index connection and the Mooncake client (its
        segment leaves the store: the payloads it held are gone). Idempotent; never waits on a dead
        master for more than the timeout."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(None)
        self._writer.join(timeout=max(5.0, 4 * self.timeout_s))
        self._index.close()
        client, self._client = self._client, None
        if client is not None:
            try:
                self._writer_io.call(client.close, 2 * self.timeout_s)
            except (OSError, TimeoutError, _Busy, RuntimeError) as e:
                log.warning("Mooncake tier %s: close did not finish (%s); left to its thread", self.where, e)
        self._reader.stop()
        self._writer_io.stop()

    # ---- metrics ------------------------------------------------------------------------------
    def stats(self) -> MooncakeTierStats:
        with self._lock:
            return MooncakeTierStats(**self._c, fetch_seconds_total=self._fetch_seconds,
                                     up=self._index_health.up and self._payload_health.up,
                                     index_up=self._index_health.up, payload_up=self._payload_health.up)

    def __repr__(self) -> str:
        return f"MooncakeTier({self.url}, index={self.index_where})"
