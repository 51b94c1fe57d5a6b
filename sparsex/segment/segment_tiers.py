"""What the segment package asks of the tiers below the device KV pool (implemented by
`kvstore.segment_store.SegmentStore`; the kvstore package sits above this one, so the segment
package names the interface and the engine passes the store in)."""
from __future__ import annotations

from typing import Protocol

from sparsex.cache.block_pool import KVCacheBlock
from sparsex.segment.segment_index import SegmentEntry, SegmentIndex


class SegmentTiers(Protocol):
    def load(self, spans: list[tuple[list[int], str | None]], index: SegmentIndex) -> int:
        """Install into `index` the spans (token ids, salt) a tier holds; how many."""
        ...

    def publish(self, entry: SegmentEntry) -> None:
        """A new entry: write it to the shared tier."""
        ...

    def publish_merge(self, entry: SegmentEntry, blocks: list[KVCacheBlock], start: int) -> None:
        """Another exact encoding of `entry`, computed at `start` in `blocks`: fold it into the shared record."""
        ...
