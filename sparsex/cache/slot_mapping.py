"""Block/slot arithmetic: where a token position's KV lives in the paged cache.

A block table lists block ids by position (block i holds positions [i*block_size, (i+1)*block_size));
the slot of position p is `block_table[p // block_size] * block_size + p % block_size`, an index into
a layer's cache viewed as [num_blocks * block_size, num_kv_heads, head_dim]. A run of blocks that
starts at block `first_block` (a segment entry's blocks, which begin at its start_pos's block) is
indexed the same way after subtracting `first_block`.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sparsex.cache.block_pool import KVCacheBlock


def block_ids(blocks: Sequence[KVCacheBlock]) -> np.ndarray:
    """[len(blocks)] int64: the blocks' ids, as a block table."""
    return np.fromiter((b.block_id for b in blocks), dtype=np.int64, count=len(blocks))


def slot_mapping(block_table: np.ndarray, positions: np.ndarray, block_size: int,
                 first_block: int | np.ndarray = 0) -> np.ndarray:
    """[num_positions] int64 slots of `positions`, whose blocks are `block_table` from block
    `first_block` on (a scalar, or one per position)."""
    return block_table[positions // block_size - first_block].astype(np.int64) * block_size + positions % block_size


def slot_of(block_table: np.ndarray, position: int, block_size: int) -> int:
    """The slot of one position (a decode row), without building arrays."""
    return int(block_table[position // block_size]) * block_size + position % block_size


def block_span(start_pos: int, num_tokens: int, block_size: int) -> tuple[int, int]:
    """(first, last) block index holding positions [start_pos, start_pos + num_tokens), inclusive."""
    return start_pos // block_size, (start_pos + num_tokens - 1) // block_size
