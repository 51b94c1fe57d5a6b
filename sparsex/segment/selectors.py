"""Which reused tokens to recompute: one small interface, several rules.

A selector scores the reused rows of one sequence; a blended step keeps the top
`recompute_ratio * num_reused` (plus every new row, plus the first `boundary_tokens` of each
reused segment). Scores come from what the last full layer (`full_layers - 1`) computed:

  kv_deviation  CacheBlend's rule: ||K_fresh - K_cached||^2 + ||V_fresh - V_cached||^2 at the last
                full layer (the cached K/V are the re-rotated copies about to be overwritten).
  sparse_q      ours; query-side: see `SparseQProbe` below.
  boundary      EPIC's rule: the first tokens of each reused segment.
  random        a control.
  none / all    recompute nothing / everything ("all" must equal plain prefill).
"""
from __future__ import annotations

import torch

from sparsex.config import PROBE_SELECTORS  # noqa: F401  (the selectors that read the probe)


def boundary_scores(offsets: torch.Tensor) -> torch.Tensor:
    """offsets: [n] position of each reused row inside its segment -> earlier is higher."""
    return -offsets.to(torch.float32)


def random_scores(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=generator)


def kv_deviation_scores(k_fresh: torch.Tensor, v_fresh: torch.Tensor,
                        k_cached: torch.Tensor, v_cached: torch.Tensor) -> torch.Tensor:
    """All [n, num_kv_heads, head_dim] -> [n]."""
    dk = (k_fresh.float() - k_cached.float()).pow(2).sum(dim=(-1, -2))
    dv = (v_fresh.float() - v_cached.float()).pow(2).sum(dim=(-1, -2))
    return dk + dv


def sparse_q_scores(deviation: torch.Tensor, query_mass: torch.Tensor) -> torch.Tensor:
    """sparse_q: the K/V deviation ([R]) weighted by the query rows' attention mass on each reused
    token ([R]), relative to its mean: dev * (1 + mass / mean(mass))."""
    return deviation * (1.0 + query_mass / query_mass.mean().clamp_min(1e-12))


def query_attention_mass(q: torch.Tensor, keys: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Mean attention probability that the rows `q` ([m, H, D] at positions q_pos) put on each key
    ([S, KVH, D]), averaged over rows and heads -> [S]. m is small (the new tokens). Grouped by KV
    head (no copy of the keys per query head: at 32k keys that copy was the probe's largest tensor).
    On the GPU the scores are made in the input dtype on the tensor cores and normalised in fp32:
    an fp32 score matrix [KVH, m * G, S] was most of the probe's time at long contexts."""
    m, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    dtype = q.dtype if q.is_cuda else torch.float32
    qg = (q.to(dtype) * scale).view(m, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
    qg = qg.reshape(num_kv_heads, m * group, head_dim)
    s = torch.bmm(qg, keys.to(dtype).permute(1, 2, 0)).view(num_kv_heads, m, group, -1)   # [KVH, m, G, S]
    hidden = torch.arange(keys.shape[0], device=q.device)[None, :] > q_pos[:, None]        # [m, S]
    s.masked_fill_(hidden[None, :, None, :], float("-inf"))
    return torch.softmax(s, dim=-1, dtype=torch.float32).mean(dim=(0, 1, 2))
