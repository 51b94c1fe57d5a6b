"""One segment entry's KV, independent of block ids: the format every tier below the device stores.

A record holds the entry's token ids (verified again on every hit, like a device hit), the position
its first token was computed at, the number of encodings merged into it, whether it is an explicit
segment, and the K/V of exactly its tokens in every layer. Serialized it is

    b"SXKV" | u32 header length | header (JSON, blank-padded) | token ids (int32) | K/V bytes

and the header carries xxh3-64 checksums of everything after it, one per `CHECKSUM_CHUNK` bytes, so a
truncated or corrupt value is detected and dropped, never loaded. Chunks, not one digest: xxhash
releases the GIL, so a large record's chunks are hashed on several threads at once (`_digests`); on a
GPU host the checksum of a 2k-token Llama-3-8B record (268 MB) was a third of its fetch when hashed on
one thread.

Keys (`record_key`) name the model fingerprint, the KV dtype, the KV layout version and the tenant,
so two models, two dtypes or two tenants never meet; the tenant part comes first after the
namespace (`sparsex:<tenant>:...`) so a Redis ACL can confine a tenant's credentials to its own
keys (`~sparsex:<tenant>:*`, docs/deploy.md).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from sparsex.cache.block_hash import hash_segment

MAGIC = b"SXKV"
# Bump when the K/V layout or the format of a record changes (axis order, what the keys' rotation means,
# how it is checksummed, ...): records of another version live under other keys and are never read, so
# replicas of two versions sharing a store never drop each other's records. 2: checksums per chunk.
KV_LAYOUT_VERSION = 2
NAMESPACE = "sparsex"
_UNSALTED = "shared"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HEADER_LEN = struct.Struct("<I")
_KV_ALIGN = 64
CHECKSUM_CHUNK = 4 << 20                  # bytes per checksum (a record's header lists one per chunk)
_HASH_THREADS = min(8, os.cpu_count() or 1)


@functools.cache
def _hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_HASH_THREADS, thread_name_prefix="sparsex-xxh3")


def _digests(parts: list[bytes | memoryview], chunk: int) -> list[str]:
    """xxh3-64 hex digests of the concatenation of `parts`, one per `chunk` bytes (the last may be
    shorter), hashed on a thread pool when there are several chunks; nothing is copied (a chunk that
    straddles two parts is hashed from a view of each)."""
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(len(v) for v in views)
    pieces: list[list[memoryview]] = []
    at = 0                                  # offset of views[i] in the whole
    for v in views:
        off = 0
        while off < len(v):
            pos = at + off
            if pos % chunk == 0:
                pieces.append([])
            take = min(len(v) - off, chunk - pos % chunk)
            pieces[-1].append(v[off:off + take])
            off += take
        at += len(v)
    if total == 0:
        pieces = [[]]

    def one(piece: list[memoryview]) -> str:
        h = xxhash.xxh3_64()
        for v in piece:
            h.update(v)
        return h.hexdigest()
    if len(pieces) == 1:
        return [one(pieces[0])]
    return list(_hash_pool().map(one, pieces))


class CorruptRecord(ValueError):
    """A stored value that is not a whole, consistent record (truncated, corrupt, or another format)."""


@dataclass
class SegmentRecord:
    token_ids: np.ndarray              # [n] int32
    cache_salt: str | None
    start_pos: int                     # position the first token was computed at (keys rotated for it)
    num_encodings: int                 # the KV is the mean of this many encodings
    explicit: bool                     # an explicit segment (prompt piece, ingested passage) or a found stretch
    kv: torch.Tensor                   # [num_layers, 2, n, num_kv_heads, head_dim], CPU, the model's KV dtype

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.kv.dim() != 5 or self.kv.shape[1] != 2 or self.kv.shape[2] != n:
            raise ValueError(f"kv must be [layers, 2, {n}, kv_heads, head_dim], got {tuple(self.kv.shape)}")
        if self.num_encodings < 1 or self.start_pos < 0:
            raise ValueError(f"bad record: start_pos={self.start_pos}, num_encodings={self.num_encodings}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + 4 * self.num_tokens


def tenant_tag(cache_salt: str | None) -> str:
    """The tenant part of a key: "shared" for unsalted content, else the first 16 hex digits of the
    salt's sha256 (salts are secrets: the key must not show them)."""
    if cache_salt is None:
        return _UNSALTED
    return hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:16]


def tenant_prefix(cache_salt: str | None) -> str:
    """`sparsex:<tenant>:`: the key prefix a Redis ACL grants a tenant (`~sparsex:<tenant>:*`)."""
    return f"{NAMESPACE}:{tenant_tag(cache_salt)}:"


def record_key(token_ids, cache_salt: str | None, model_fingerprint: str, dtype: torch.dtype) -> str:
    """The store key of a segment: tenant, model, dtype, layout version, then the segment hash."""
    dtype_name = str(dtype).removeprefix("torch.")
    return (f"{tenant_prefix(cache_salt)}{model_fingerprint}:{dtype_name}:v{KV_LAYOUT_VERSION}:"
            f"{hash_segment(token_ids, cache_salt).hex()}")


def _kv_buffer(kv: torch.Tensor) -> memoryview:
    """The K/V bytes without a copy (one for a non-contiguous tensor)."""
    kv = kv.contiguous()
    if kv.dtype == torch.bfloat16:
        kv = kv.view(torch.int16)                 # numpy has no bfloat16: move the bits
    return memoryview(kv.numpy()).cast("B")


def _parts(record: SegmentRecord) -> tuple[bytes, bytes, memoryview]:
    """(header, token ids, K/V bytes) of a serialized record, the K/V not copied."""
    tokens = np.ascontiguousarray(record.token_ids, dtype=np.int32).tobytes()
    kv = _kv_buffer(record.kv)
    checksums = _digests([tokens, kv], CHECKSUM_CHUNK)
    dtype_name = str(record.kv.dtype).removeprefix("torch.")
    header = json.dumps({
        "layout": KV_LAYOUT_VERSION, "dtype": dtype_name, "shape": list(record.kv.shape),
        "num_tokens": record.num_tokens, "start_pos": record.start_pos,
        "num_encodings": record.num_encodings, "explicit": record.explicit,
        "cache_salt_tag": tenant_tag(record.cache_salt), "checksum_chunk": CHECKSUM_CHUNK,
        "checksums": checksums,
    }, separators=(",", ":")).encode()
    # JSON ignores trailing blanks: pad the header so the K/V starts 64-byte aligned in the record (a
    # record read into an aligned buffer is viewed as a tensor in place, decode(copy=False))
    header += b" " * (-(8 + len(header) + len(tokens)) % _KV_ALIGN)
    return MAGIC + _HEADER_LEN.pack(len(header)) + header, tokens, kv


def encode(record: SegmentRecord) -> bytes:
    # One allocation of the record's size (the join): a fresh GB-sized buffer costs its page faults,
    # which on a VM are slower than the copy itself.
    return b"".join(_parts(record))


def encode_into(record: SegmentRecord, out: memoryview) -> int:
    """Serialize `record` into `out` (a writable byte buffer, e.g. a registered transfer buffer) without
    an intermediate copy; returns the bytes written. ValueError when `out` is too small."""
    head, tokens, kv = _parts(record)
    n = len(head) + len(tokens) + kv.nbytes
    if len(out) < n:
        raise ValueError(f"buffer of {len(out)} bytes holds no record of {n}")
    a, b = len(head), len(head) + len(tokens)
    out[:a], out[a:b], out[b:n] = head, tokens, kv
    return n


def decode_header(data: bytes | memoryview) -> dict:
    """The header of a serialized record (no checksum check: cheap, for compare-and-set)."""
    if len(data) < 8 or bytes(data[:4]) != MAGIC:
        raise CorruptRecord("not a SparseX KV record")
    (n,) = _HEADER_LEN.unpack_from(data, 4)
    if len(data) < 8 + n:
        raise CorruptRecord("record truncated inside its header")
    try:
        return json.loads(bytes(data[8:8 + n]))
    except ValueError as e:
        raise CorruptRecord(f"record header is not JSON ({e})") from e


def decode(data: bytes | memoryview, cache_salt: str | None, *, copy: bool = True) -> SegmentRecord:
    """Parse and check a serialized record; CorruptRecord if anything is off. `copy=False`: the record's
    K/V is a view of `data` (a transfer buffer loaded straight to the device), valid while `data` is
    left unchanged."""
    header = decode_header(data)
    # views, not slices: the K/V bytes are copied once, into the tensor the record keeps
    payload = memoryview(data)[8 + _HEADER_LEN.unpack_from(data, 4)[0]:]
    try:
        if header["layout"] != KV_LAYOUT_VERSION:
            raise CorruptRecord(f"record layout {header['layout']} (this engine reads {KV_LAYOUT_VERSION})")
        chunk = header["checksum_chunk"]
        if not isinstance(chunk, int) or chunk <= 0:
            raise CorruptRecord(f"record header has a bad checksum_chunk {chunk!r}")
        if _digests([payload], chunk) != header["checksums"]:
            raise CorruptRecord("record checksum mismatch (truncated or corrupt)")
        if header["cache_salt_tag"] != tenant_tag(cache_salt):
            raise CorruptRecord("record belongs to another tenant")
        dtype = _DTYPES[header["dtype"]]
        n, shape = header["num_tokens"], tuple(header["shape"])
    except (KeyError, TypeError) as e:
        raise CorruptRecord(f"record header lacks a field ({e})") from e
    elem = torch.empty((), dtype=dtype).element_size()
    if len(payload) != 4 * n + int(np.prod(shape)) * elem:
        raise CorruptRecord("record size does not match its header")
    tokens = np.frombuffer(payload[:4 * n], dtype=np.int32).copy()
    raw = np.frombuffer(payload[4 * n:], dtype=np.int16 if dtype == torch.bfloat16 else
                        {torch.float32: np.float32, torch.float16: np.float16}[dtype])
    if copy or not raw.flags.writeable or not raw.flags.aligned:   # torch takes neither without a copy
        raw = raw.copy()
    kv = torch.from_numpy(raw)
    kv = (kv.view(torch.bfloat16) if dtype == torch.bfloat16 else kv).view(shape)
    return SegmentRecord(tokens, cache_salt, header["start_pos"], header["num_encodings"], header["explicit"], kv)


def model_fingerprint(name: str, config_repr: str, probe: torch.Tensor) -> str:
    """16 hex digits naming a model: its name, its architecture config and a sample of its weights
    (two checkpoints of one architecture differ there), so records of two models never meet."""
    h = hashlib.sha256(name.encode() + b"\x00" + config_repr.encode() + b"\x00")
    h.update(probe.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
