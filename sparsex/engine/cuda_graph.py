"""CUDA graphs for decode steps: the whole forward (embedding .. logits) replayed as one graph.

A decode step of a small batch is a few hundred short kernels; launched one by one from Python the
GPU waits on the host between them. A graph launches them all at once. The model runner uses a graph
only when every scheduled request is a one-row decode and nothing blends (eager otherwise).

- One graph per batch size in `BATCH_SIZES` (capped by max_num_seqs), captured largest first into
  one memory pool, so the smaller graphs reuse the largest one's activation memory. A batch of n
  runs the smallest graph of >= n rows; padding rows store nothing (slot -1) and attend to one key.
- Inputs live in static buffers that the graph reads; `run` uploads a step's arrays in one pinned
  H2D copy (`PinnedUploader`) and copies them into the static buffers on the device.
- Split-K decode needs its split count on the host at launch, so each graph fixes it, chosen for
  max_model_len (the kernel sizes each split from the live sequence length, so any length is exact);
  a sliding-window layer uses at most what its window needs (`window_num_splits`). The window and
  the softcap are compile-time constants of the kernel: nothing of them is read at replay.
- The block-table buffer is `[max_batch, cdiv(max_model_len, block_size)]`; a step copies only its
  used width (`[n, max blocks of the batch]`), as entries past a row's length are never read.
"""
from __future__ import annotations

import numpy as np
import torch

from sparsex.layers.forward_context import ForwardContext
from sparsex.engine.host_inputs import PinnedUploader
from sparsex.layers.attention_metadata import AttentionMetadata

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def capture_sizes(max_batch: int) -> list[int]:
    """Graph batch sizes for an engine that runs at most `max_batch` sequences a step."""
    top = min(max_batch, BATCH_SIZES[-1])
    return sorted({b for b in BATCH_SIZES if b < top} | {top})


class FixedSplitDecodeBackend:
    """The Triton backend with a fixed split-K count, as a captured graph needs: an `AttentionBackend`
    (attention_backend_protocol.py) instance."""

    name = "triton-graph"

    def __init__(self, num_splits: int):
        self.num_splits = num_splits

    @staticmethod
    def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        from sparsex.layers.triton_attention import TritonAttentionBackend
        TritonAttentionBackend.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata,
                  scale: float, key: torch.Tensor | None = None, value: torch.Tensor | None = None, *,
                  sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
        from sparsex.layers.triton_attention import check_window_and_cap, decode_attention, window_num_splits
        sliding_window, logits_soft_cap = check_window_and_cap(sliding_window, logits_soft_cap)
        # a sliding layer's rows read at most its window: fewer splits (host ints, fixed at capture)
        return decode_attention(query, k_cache, v_cache, md, scale,
                                num_splits=window_num_splits(self.num_splits, sliding_window),
                                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], max_batch: int,
                 max_model_len: int, uploader: PinnedUploader):
        from sparsex.layers.triton_attention import decode_num_splits

        k0 = kv_caches[0][0]                               # [num_blocks, block_size, num_kv_heads, head_dim]
        dev, block_size, num_kv_heads = k0.device, k0.shape[1], k0.shape[2]
        self.sizes = capture_sizes(max_batch)
        self.uploader = uploader
        big = self.sizes[-1]
        width = -(-max_model_len // block_size)
        # static inputs, initialised as padding rows: token 0 at position 0, stored nowhere, one key
        self.ids = torch.zeros(big, dtype=torch.int64, device=dev)                 # [B]
        self.positions = torch.zeros(big, dtype=torch.int64, device=dev)           # [B]
        self.slots = torch.full((big,), -1, dtype=torch.int64, device=dev)         # [B]
        self.seq_lens = torch.ones(big, dtype=torch.int32, device=dev)             # [B]
        self.cu = torch.arange(big + 1, dtype=torch.int32, device=dev)             # [B+1], one row each
        self.block_tables = torch.zeros(big, width, dtype=torch.int32, device=dev)  # [B, W]; block 0 is valid
        self.num_splits: dict[int, int] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}                                 # [b, vocab], static outputs
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):
            self.num_splits[b] = decode_num_splits(b, num_kv_heads, max_model_len, 64, sms)
            self.graphs[b], self.logits[b] = self._capture(model, kv_caches, b, max_model_len, pool)

    def _capture(self, model, kv_caches, b: int, max_model_len: int, pool):
        md = AttentionMetadata(
            positions=self.positions[:b], slot_mapping=self.slots[:b], cu_seqlens_q=self.cu[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], max_seqlen_q=1,
            max_seq_len=max_model_len, cu_seqlens_q_cpu=list(range(b + 1)), seq_lens_cpu=[1] * b)
        ctx = ForwardContext(attn_metadata=md, kv_caches=kv_caches, backend=FixedSplitDecodeBackend(self.num_splits[b]))

        def forward() -> torch.Tensor:
            return model.compute_logits(model(self.ids[:b], self.positions[:b], ctx))   # [b, vocab]

        forward()                      # compiles the Triton kernels of this shape outside the capture
        forward()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits = forward()
        return graph, logits

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: list[int],
            tables: list[np.ndarray]) -> torch.Tensor:
        """One decode row per sequence -> logits [n, vocab] (a view of a static buffer: read it
        before the next replay)."""
        n = len(seq_lens)
        b = next(s for s in self.sizes if s >= n)
        width = max(t.shape[0] for t in tables)
        table = np.zeros((n, width), dtype=np.int32)                     # [n, used width]
        for i, t in enumerate(tables):
            table[i, :t.shape[0]] = t
        ids_h = np.zeros(b, dtype=np.int64)
        pos_h = np.zeros(b, dtype=np.int64)
        slot_h = np.full(b, -1, dtype=np.int64)
        len_h = np.ones(b, dtype=np.int32)
        ids_h[:n], pos_h[:n], slot_h[:n], len_h[:n] = ids, positions, slots, seq_lens
        d_ids, d_pos, d_slot, d_len, d_table = self.uploader.upload([ids_h, pos_h, slot_h, len_h, table])
        self.ids[:b].copy_(d_ids)
        self.positions[:b].copy_(d_pos)
        self.slots[:b].copy_(d_slot)
        self.seq_lens[:b].copy_(d_len)
        self.block_tables[:n, :width].copy_(d_table)
        self.graphs[b].replay()
        return self.logits[b][:n]
