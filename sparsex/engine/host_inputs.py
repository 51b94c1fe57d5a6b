"""A step's index arrays, built on the host and moved to the device in one copy.

`torch.tensor(list, device="cuda")` copies from pageable memory and blocks the host until the copy
is done, once per array: six or seven stalls a step. Instead the runner builds every per-row and
per-sequence array in numpy, packs them into one pinned buffer and issues one non_blocking
host-to-device copy; the device tensors are typed views of that one device buffer. On the CPU the
numpy arrays are wrapped as they are (no copy), so the CPU path sees exactly the tensors it saw before.

Block tables are append-only while a request holds its blocks (`KVCacheManager` extends
`req.blocks` in place and replaces the list when it frees them), so each request's table is kept as
a growing numpy array and only new blocks are converted per step.
"""
from __future__ import annotations

import weakref
from typing import Sequence

import numpy as np
import torch

_ALIGN = 64          # bytes: every array starts 16-byte aligned (Triton specialises pointers on it)
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}


class PinnedUploader:
    """One pinned staging buffer reused every step; one H2D copy per `upload`."""

    def __init__(self, device: torch.device):
        self.device = device
        self._host: torch.Tensor | None = None       # pinned uint8, grown on demand
        self._done: torch.cuda.Event | None = None   # fires when the last copy has read `_host`

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """numpy int32/int64 arrays -> device tensors of the same dtypes and shapes."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if self.device.type != "cuda":
            return [torch.from_numpy(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        host = self._reserve(total)
        staging = host.numpy()
        for a, off in zip(arrays, offsets):
            staging[off:off + a.nbytes] = a.reshape(-1).view(np.uint8)
        dev = torch.empty(total, dtype=torch.uint8, device=self.device)
        dev.copy_(host[:total], non_blocking=True)
        self._done.record()
        return [dev[off:off + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
                for a, off in zip(arrays, offsets)]

    def _reserve(self, nbytes: int) -> torch.Tensor:
        # The previous copy must have read the buffer before the host rewrites it. Steps that sample
        # have synced already; this only waits when chunked-prefill steps run ahead of the GPU.
        if self._done is not None:
            self._done.synchronize()
        if self._host is None or self._host.numel() < nbytes:
            size = max(nbytes, 1 << 16, 2 * (0 if self._host is None else self._host.numel()))
            self._host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            self._done = torch.cuda.Event()
        return self._host


class BlockTables:
    """Per-request block-id arrays (int32), extended as the request's block list grows."""

    def __init__(self):
        # request -> (the block list it was built from, id buffer, number of ids filled)
        self._cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, req) -> np.ndarray:                     # [len(req.blocks)] int32
        blocks = req.blocks
        n = len(blocks)
        entry = self._cache.get(req)
        if entry is None or entry[0] is not blocks or entry[2] > n:
            entry = (blocks, np.empty(max(n, 16), dtype=np.int32), 0)
        src, buf, filled = entry
        if n > buf.shape[0]:
            grown = np.empty(max(n, 2 * buf.shape[0]), dtype=np.int32)
            grown[:filled] = buf[:filled]
            buf = grown
        if n > filled:
            buf[filled:n] = [b.block_id for b in blocks[filled:n]]
        self._cache[req] = (src, buf, n)
        return buf[:n]
