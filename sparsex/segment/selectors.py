"""Which reused tokens to recompute: one small interface, several rules.

A selector scores the reused rows of one sequence; a blended step keeps the top
`recompute_ratio * num_reused` (plus every new row, plus the first `boundary_tokens` of each
reused segment). Scores come from what the full layers (0..`full_layers - 1`) computed:

  kv_deviation  CacheBlend's rule: ||K_fresh - K_cached||^2 + ||V_fresh - V_cached||^2 at the last
                full layer (the cached K/V are the re-rotated copies about to be overwritten).
  sparse_q      ours; query-side: see `sparse_q_scores` below.
  query_fused   ProphetKV's rule (arXiv 2602.02579): the query rows' attention mass on each reused
                token, averaged over the full layers `fused_layers` (1..F-1; layer 0 alone when F = 1),
                no deviation term (`query_attention_mass` per layer, averaged in step_blend's probe).
  chunk_anchor  QCFuse's rule (arXiv 2606.05875), without its offline critical-layer profile: the
                query decides how many rows each reused segment (chunk) gets, in proportion to the
                query rows' total attention mass on it (the same fused mass as query_fused), and
                inside a chunk its anchors are its rows of largest K/V deviation at the last full
                layer (`chunk_anchor_scores`).
  boundary      EPIC's rule: the first tokens of each reused segment.
  random        a control.
  none / all    recompute nothing / everything ("all" must equal plain prefill).

query_fused and chunk_anchor (`QUERY_SELECTORS`) select once, at the last full layer: their mass is
already fused over the full layers, and a second, deeper probe would see a single layer of it
(ReuseConfig.verify rejects rescore_layers for them).
"""
from __future__ import annotations

import torch

from sparsex.config import PROBE_SELECTORS, QUERY_SELECTORS  # noqa: F401  (the selectors that read the probe)

# the selectors whose probe reads the re-rotated copies at the selection layer (their K/V deviation),
# so the copy must cover that layer too
DEVIATION_SELECTORS = ("kv_deviation", "sparse_q", "chunk_anchor")


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



def fused_layers(full_layers: int) -> tuple[int, ...]:
    """query_fused / chunk_anchor: the full layers whose query mass is averaged (equal weights):
    1..F-1, or layer 0 alone when F = 1. Layer 0 is left out when there are others: its keys are a
    function of token and position only, so its attention can match the query's words and nearby
    positions but not what the context made of a token, which is what the deeper full layers' keys
    carry (ProphetKV fuses the layers it recomputes the query in; ours are the full layers)."""
    return tuple(range(1 if full_layers > 1 else 0, full_layers))


def add_layer_mass(fused: torch.Tensor | None, mass: torch.Tensor, num_layers: int) -> torch.Tensor:
    """One probe layer's query mass ([R]) into the running mean over `num_layers` layers."""
    part = mass.float() / num_layers
    return part if fused is None else fused + part


def chunk_of_rows(offsets: torch.Tensor) -> torch.Tensor:
    """[R] offset of each reused row inside its segment, rows in segment order (as `_copy_reused`
    lays them out) -> [R] int64 segment index of each row. On the device, no sync."""
    return torch.cumsum(offsets == 0, 0) - 1


def chunk_relevance(mass: torch.Tensor, chunk: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """[num_chunks] the query rows' total attention mass on each chunk's rows."""
    return torch.zeros(num_chunks, dtype=torch.float32, device=mass.device).scatter_add_(0, chunk, mass.float())


def chunk_anchor_scores(mass: torch.Tensor, anchor: torch.Tensor, offsets: torch.Tensor, fixed: torch.Tensor,
                        num_chunks: int) -> torch.Tensor:
    """chunk_anchor's priorities ([R]; the top k of them are kept, whatever k): per-chunk quotas in
    proportion to each chunk's relevance (the query mass `mass` summed over its rows), filled inside
    each chunk by `anchor` (the K/V deviation) descending. Rows in `fixed` (kept anyway: the leading
    tokens) get -inf and use no quota.

    The quotas are Sainte-Lague's (Webster's) divisor method: row j (0-based, by anchor score) of
    chunk c gets priority rel_c / (j + 0.5), so the top k are every chunk's best rows, c's count
    being k * rel_c / sum(rel) rounded to the nearest integer with the divisor moved until the
    counts sum to exactly k. One topk does it on the device (no sync, no iteration), a chunk never
    gets more rows than it has (its rows run out), and a more relevant chunk never gets fewer rows
    than a less relevant one that it could still give rows to. A chunk without any mass still ranks
    its rows by anchor score (rel is floored at a tiny positive value)."""
    n = offsets.numel()
    dev = offsets.device
    chunk = chunk_of_rows(offsets)                                           # [R]
    rel = chunk_relevance(mass, chunk, num_chunks).clamp_min(1e-30)          # [C]
    a = anchor.float().masked_fill(fixed, float("-inf"))
    order = torch.argsort(a, descending=True, stable=True)
    order = order[torch.argsort(chunk[order], stable=True)]                  # by chunk, then anchor descending
    count = torch.zeros(num_chunks, dtype=torch.int64, device=dev).scatter_add_(0, chunk, torch.ones_like(chunk))
    start = torch.cumsum(count, 0) - count                                   # [C] first sorted index of each chunk
    rank = torch.empty(n, dtype=torch.int64, device=dev)
    rank.scatter_(0, order, torch.arange(n, device=dev) - start[chunk[order]])   # [R] rank inside its chunk
    return (rel[chunk] / (rank.float() + 0.5)).masked_fill(fixed, float("-inf"))
