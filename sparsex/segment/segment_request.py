"""What the segment package reads and writes of a request (`sparsex.request.Request`, which holds
the package's `ReuseRecord`: the request module sits above this package, so the package names the
interface instead of importing it)."""
from __future__ import annotations

from typing import Protocol

import numpy as np

from sparsex.cache.block_pool import KVCacheBlock
from sparsex.config import ReuseConfig
from sparsex.inputs import SegmentSpan
from sparsex.segment.reuse_plan import ReuseRecord


class SegmentRequest(Protocol):
    request_id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    segments: list[SegmentSpan]
    reuse: ReuseConfig | None
    query_horizon: int | None
    num_computed_tokens: int
    num_cached_tokens: int
    blocks: list[KVCacheBlock]
    reuse_record: ReuseRecord | None          # written by ReusePlanner.admit
    prompt_token_array: np.ndarray | None     # written by ReusePlanner (first span search)
    segments_registered: bool                 # written by SegmentRegistrar.register_if_prefilled

    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def prompt_end(self) -> int: ...
    @property
    def exact_prefix_len(self) -> int | None: ...
