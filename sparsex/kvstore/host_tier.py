"""Segment records in host memory: where entries evicted from the device KV pool go, and where a hit
brings them back from. Least recently used first out, within a byte budget; on CUDA the records are
pinned, so loading one back is one asynchronous copy."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from sparsex.kvstore.record import SegmentRecord


@dataclass
class HostTierStats:
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0              # spilled into the tier
    bytes_out: int = 0             # loaded back from it
    evictions: int = 0
    used_bytes: int = 0
    num_records: int = 0


class HostTier:
    def __init__(self, capacity_bytes: int, pin: bool = False, on_evict=None):
        """`on_evict(key)`: told of each record that leaves to make room (tensor parallelism: the other
        ranks drop their shard of it)."""
        if capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.pin = pin
        self._on_evict = on_evict
        self._records: OrderedDict[str, SegmentRecord] = OrderedDict()   # oldest first
        self.used = 0
        self.hits = self.misses = self.bytes_in = self.bytes_out = self.evictions = 0

    def __len__(self) -> int:
        return len(self._records)

    def put(self, key: str, record: SegmentRecord) -> bool:
        """Keep `record` (replacing one under the same key); older records leave to make room. False
        when it is larger than the whole tier."""
        size = record.nbytes
        if size > self.capacity:
            return False
        self.pop(key)
        while self.used + size > self.capacity:
            old_key, old = self._records.popitem(last=False)
            self.used -= old.nbytes
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(old_key)
        if self.pin and not record.kv.is_pinned():
            record.kv = record.kv.pin_memory()
        self._records[key] = record
        self.used += size
        self.bytes_in += size
        return True

    def get(self, key: str) -> SegmentRecord | None:
        """The record under `key`, now the most recently used; None (a miss) otherwise."""
        record = self._records.get(key)
        if record is None:
            self.misses += 1
            return None
        self._records.move_to_end(key)
        self.hits += 1
        self.bytes_out += record.nbytes
        return record

    def pop(self, key: str) -> SegmentRecord | None:
        record = self._records.pop(key, None)
        if record is not None:
            self.used -= record.nbytes
        return record

    def stats(self) -> HostTierStats:
        return HostTierStats(self.hits, self.misses, self.bytes_in, self.bytes_out, self.evictions, self.used,
                             len(self._records))

    def check_integrity(self) -> None:
        if self.used != sum(r.nbytes for r in self._records.values()) or self.used > self.capacity:
            raise RuntimeError(f"host tier accounts {self.used} bytes for records of "
                               f"{sum(r.nbytes for r in self._records.values())} (capacity {self.capacity})")
