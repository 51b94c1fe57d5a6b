"""Content hashes of KV blocks and segments (xxh3-128), domain-separated so a prefix-block hash can
never equal a segment hash. A hash only finds a candidate: every hit is verified against the stored
token ids (and, for blocks, the identity of the parent block), so a forced collision never reuses KV."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import xxhash

_PREFIX_DOMAIN = b"sparsex/prefix-block/v1\x00"
_SEGMENT_DOMAIN = b"sparsex/segment/v1\x00"
_NONE_PARENT = b"\x00" * 16


class BlockHash(NamedTuple):
    """A named tuple, not a dataclass: a 32k-token prompt makes ~2k of them on the TTFT path, and a
    tuple is built in C (and its token bytes are not tracked by the cyclic garbage collector)."""
    value: bytes                      # 16-byte digest of (parent, token bytes, extra_keys)
    token_bytes: bytes                # the block's token ids as int64 bytes, kept for verification on hit
    extra_keys: tuple = ()


def _salt_bytes(cache_salt: str | None) -> bytes:
    return b"" if cache_salt is None else b"salt:" + cache_salt.encode("utf-8") + b"\x00"


def _extra_bytes(extra_keys: tuple) -> bytes:
    return b"".join(repr(key).encode("utf-8") + b"\x00" for key in extra_keys)


def _digest(parent_value: bytes, token_bytes: bytes, extra_bytes: bytes) -> bytes:
    return xxhash.xxh3_128_digest(_PREFIX_DOMAIN + parent_value + token_bytes + extra_bytes)


# First extra key of every block in the approximate chain: blocks whose KV was computed over reused
# (re-rotated, partly recomputed) segments. An exact lookup never carries it, so it can never
# return such a block; only requests that accept approximate KV follow this chain. The second extra
# key is the reuse config that blended the KV (`ReuseConfig.kv_key`): a request follows only the
# chain its own knobs would have written, never KV blended with fewer recomputed tokens.
APPROXIMATE_KV = ("kv", "blended")

_CHUNK_BLOCKS = 64          # blocks converted to bytes at a time (a lookup that misses early stops early)


def iter_block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None,
                      parent: BlockHash | None = None, start: int = 0, approx_key: tuple | None = None):
    """Hashes of the full blocks of `token_ids[start:]` (start is block-aligned), chained from `parent`,
    one at a time (a lookup that misses stops hashing). The salt is an extra key of the first block
    only: every later hash inherits it through the chain. `approx_key` (a reuse config's `kv_key`)
    puts every block on that config's approximate chain (`APPROXIMATE_KV`, then the key); None is
    the exact chain. The token ids are turned into bytes a chunk at a time
    (hashing a 32k-token prompt is on the TTFT path); the values do not depend on the chunking."""
    end = len(token_ids) - len(token_ids) % block_size
    parent_value = parent.value if parent is not None else _NONE_PARENT
    stride = 8 * block_size
    # every block but a salted first one carries the same extra keys: one tuple and its bytes for all
    extra = (APPROXIMATE_KV, approx_key) if approx_key is not None else ()
    extra_bytes = _extra_bytes(extra)
    for c in range(start, end, _CHUNK_BLOCKS * block_size):
        chunk_end = min(end, c + _CHUNK_BLOCKS * block_size)
        raw = np.asarray(token_ids[c:chunk_end], dtype=np.int64).tobytes()
        for j in range((chunk_end - c) // block_size):
            block_bytes = raw[j * stride:(j + 1) * stride]
            if c + j == 0 and cache_salt is not None:
                first = (("cache_salt", cache_salt),) + extra
                parent_value = _digest(parent_value, block_bytes, _extra_bytes(first))
                yield BlockHash(parent_value, block_bytes, first)
                continue
            parent_value = _digest(parent_value, block_bytes, extra_bytes)
            yield BlockHash(parent_value, block_bytes, extra)


def compute_block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None,
                         parent: BlockHash | None = None, start: int = 0,
                         approx_key: tuple | None = None) -> list[BlockHash]:
    """All of `iter_block_hashes`."""
    return list(iter_block_hashes(token_ids, block_size, cache_salt, parent, start, approx_key))


def token_bytes(token_ids) -> bytes:
    """Compact, comparable form of a token span (4 bytes a token): what segment entries store."""
    return np.asarray(token_ids, dtype=np.int32).tobytes()


def hash_segment(token_ids, cache_salt: str | None) -> bytes:
    h = xxhash.xxh3_128(_SEGMENT_DOMAIN)
    h.update(_salt_bytes(cache_salt))
    h.update(token_ids if isinstance(token_ids, bytes) else token_bytes(token_ids))
    return h.digest()
