"""Tensor parallelism inside the model: which heads, columns and vocabulary rows a rank holds, and
the collectives that join the ranks' partial results.

Megatron's split, as vLLM, nano-vllm and mini-sglang do it:
  qkv_proj, gate_up_proj   column-parallel: each rank holds its heads' / its columns' rows, no
                           communication (models/weight_sharding.py cuts the checkpoint)
  o_proj, down_proj, MoE   row-parallel: each rank multiplies its share of the inner dimension and
                           the partial [T, hidden] sums are all-reduced (`all_reduce`, one per block)
  embed_tokens             vocab-parallel: a rank looks up the ids in its vocabulary range, zeros
                           elsewhere, and the all-reduce sums the one non-zero row
  lm_head                  vocab-parallel: each rank's logits of its range, all-gathered
KV heads are divided across ranks; with fewer KV heads than ranks each is replicated on
`size / num_kv_heads` ranks (a rank's query heads all read the KV head it holds).

Every rank runs the same forward on the same rows, so the hidden state between blocks is the same
on all ranks (all-reduce gives every rank identical bits).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorParallelGroup:
    """One rank's place in the group; `group` is the process group tensors go over (NCCL on CUDA,
    gloo on the CPU)."""
    rank: int
    size: int
    group: object = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank r's part at columns r*n:(r+1)*n."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def same_on_all_ranks(self, x: torch.Tensor) -> bool:
        """Whether every rank holds the same `x` (a small tensor; reads the result on the host)."""
        both = torch.cat([x.double().flatten(), -x.double().flatten()])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)   # [max x, -min x]
        n = x.numel()
        return bool(torch.equal(both[:n], -both[n:]))

    # ---- what a rank holds ------------------------------------------------------------------
    def head_range(self, num_heads: int) -> tuple[int, int]:
        """[start, end) of this rank's query heads."""
        per = num_heads // self.size
        return self.rank * per, (self.rank + 1) * per

    def kv_head_range(self, num_kv_heads: int) -> tuple[int, int]:
        """[start, end) of this rank's KV heads: its share, or the one head its query heads read
        when there are fewer KV heads than ranks."""
        if num_kv_heads >= self.size:
            per = num_kv_heads // self.size
            return self.rank * per, (self.rank + 1) * per
        head = self.rank * num_kv_heads // self.size
        return head, head + 1

    def kv_replication(self, num_kv_heads: int) -> int:
        """On how many ranks each KV head lives."""
        return max(1, self.size // num_kv_heads)

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary rows; the last rank's range is padded past
        vocab_size (padded rows are zero in the embedding and their logits are cut off)."""
        per = -(-vocab_size // self.size)
        return self.rank * per, (self.rank + 1) * per


def check_divisible(num_heads: int, num_kv_heads: int, intermediate: int, moe_intermediate: int, size: int) -> None:
    """Raise ValueError naming the dimension that `size` ranks cannot divide."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    bad = [f"num_attention_heads={num_heads}"] if num_heads % size else []
    if num_kv_heads % size and size % num_kv_heads:
        bad.append(f"num_key_value_heads={num_kv_heads} (neither divides the other)")
    if intermediate % size:
        bad.append(f"intermediate_size={intermediate}")
    if moe_intermediate % size:
        bad.append(f"moe_intermediate_size={moe_intermediate}")
    if bad:
        raise ValueError(f"tensor_parallel_size={size} does not divide the model's " + ", ".join(bad))


class VocabParallelEmbedding(nn.Module):
    """embed_tokens split by vocabulary rows: `weight` [vocab range, hidden]."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.vocab_start, self.vocab_end = tp.vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:      # [T] -> [T, hidden]
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)
