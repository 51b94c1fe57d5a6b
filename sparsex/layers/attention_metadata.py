"""Per-step attention metadata: the one contract between the model runner and attention backends.

The KV cache of a sequence is laid out *by position*: the key/value of the token at absolute
position `p` of sequence `s` lives at slot `block_tables[s, p // block_size] * block_size + p % block_size`.
A query row carries its own absolute position and attends to keys at positions `0..position`
of its sequence (an exact per-row causal mask; in a sliding-window layer only the last
`sliding_window` of them). Rows of a sequence need not be contiguous in position: plain prefill,
chunked prefill, prefix-cache hits, decode and SparseX's sparse rows (selected tokens scattered
through a prompt) are all the same case.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # per query row
    positions: torch.Tensor        # [num_tokens] int64, absolute position of each row
    slot_mapping: torch.Tensor     # [num_tokens] int64, KV-cache slot each row's K/V is written to
    # per sequence; rows of sequence s are cu_seqlens_q[s]:cu_seqlens_q[s+1]
    cu_seqlens_q: torch.Tensor     # [num_seqs + 1] int32
    seq_lens: torch.Tensor         # [num_seqs] int32, keys 0..seq_lens[s]-1 are valid once this step's K/V are stored
    block_tables: torch.Tensor     # [num_seqs, max_num_blocks] int32 (padded with 0)
    max_seqlen_q: int
    max_seq_len: int
    # host copies, so the CPU backend never syncs on device tensors
    cu_seqlens_q_cpu: list[int]
    seq_lens_cpu: list[int]
    # True when every sequence's rows are exactly positions seq_len-q_len .. seq_len-1
    # (no sparse rows): backends may then use a plain bottom-right causal mask.
    contiguous: bool = True
    # a backend's per-step precomputation (e.g. the CPU backend's gather indices and masks),
    # built at the first layer and reused by the others; a row subset gets a fresh one
    backend_plan: object | None = None
    # the same for layers whose attention differs from the plain causal one (a sliding window,
    # softcapped logits), keyed by the backend by what a plan depends on: a model alternating
    # sliding and global layers keeps one plan of each; a row subset starts without
    variant_plans: dict | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def select_rows(self, keep: torch.Tensor, rows_per_seq: list[int] | None = None) -> "AttentionMetadata":
        """Metadata for a subset of rows (`keep`: sorted int64 row indices), as SparseX's sparse layers
        need. `rows_per_seq` (how many kept rows fall in each sequence) spares a device sync when known."""
        if rows_per_seq is None:
            bounds = torch.tensor(self.cu_seqlens_q_cpu, dtype=torch.int64)
            rows_per_seq = torch.bucketize(keep.cpu(), bounds[1:], right=True).bincount(minlength=self.num_seqs).tolist()
        if len(rows_per_seq) != self.num_seqs or sum(rows_per_seq) != keep.shape[0]:
            raise ValueError(f"rows_per_seq {rows_per_seq} does not match {keep.shape[0]} kept rows "
                             f"over {self.num_seqs} sequences")
        cu = [0]
        for c in rows_per_seq:
            cu.append(cu[-1] + c)
        return AttentionMetadata(
            positions=self.positions[keep],
            slot_mapping=self.slot_mapping[keep],
            # the kept rows before sequence s's first row, counted on the device (an upload of `cu`
            # would wait for the GPU to drain)
            cu_seqlens_q=torch.searchsorted(keep, self.cu_seqlens_q.to(keep.dtype)).to(torch.int32),
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            max_seqlen_q=max((b - a for a, b in zip(cu, cu[1:])), default=0),
            max_seq_len=self.max_seq_len,
            cu_seqlens_q_cpu=cu,
            seq_lens_cpu=self.seq_lens_cpu,
            contiguous=False,
        )
