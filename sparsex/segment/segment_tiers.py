"""What the segment package asks of the tiers below the device KV pool (implemented by
`kvstore.segment_store.SegmentStore`; the kvstore package sits above this one, so the segment
package names the interface and the engine passes the store in)."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from sparsex.cache.block_pool import KVCacheBlock
from sparsex.segment.segment_index import SegmentEntry, SegmentIndex


class SegmentTiers(Protocol):
    def load(self, spans: list[tuple[list[int], str | None]], index: SegmentIndex) -> int:
        """Install into `index` the spans (token ids, salt) a tier holds; how many."""
        ...

    def publish(self, entry: SegmentEntry) -> None:
        """A new entry: write it to the shared tier (explicit ones; found stretches too when it shares spans)."""
        ...

    def publish_merge(self, entry: SegmentEntry, blocks: list[KVCacheBlock], start: int) -> None:
        """Another exact encoding of `entry`, computed at `start` in `blocks`: fold it into the shared record."""
        ...

    @property
    def shares_spans(self) -> bool:
        """Whether spans found by content are shared with other replicas (EngineConfig.segment_store_spans)."""
        ...

    def load_by_content(self, prompt: np.ndarray, intervals: list[tuple[int, int]], cache_salt: str | None,
                        index: SegmentIndex, min_tokens: int) -> int:
        """Install into `index` the shared records that hold verified runs of the prompt's `intervals`; how many."""
        ...

    def publish_span(self, token_ids: list[int], cache_salt: str | None, blocks: tuple[KVCacheBlock, ...],
                     start_pos: int) -> None:
        """A stretch reused by content here (it recurred): write it, with its anchors, to the shared tier."""
        ...
