"""Blended prefill: reuse segments' KV at new positions and recompute a sparse set of tokens,
all inside the normal forward pass.

For a request whose prompt is P (exact prefix hit) + reused segments R1..Rm + new tokens N:

  plan()     at admission: look up each prompt segment after P in the segment index; lock hits.
  prepare()  before the forward: copy every hit's K/V (all layers) into the request's own blocks,
             re-rotating keys from the positions they were computed at to their new positions;
             install a probe on layer F-1 and a row selector before layer F (F = full_layers).
  forward    layers 0..F-1 compute every row of R ∪ N (their fresh K/V overwrite the copies);
             at layer F the selector keeps N plus the top-scored reused rows; layers F..L-1 run
             only those rows, each attending at its absolute position over all keys <= it.
  after_step unlock hits; register the request's not-yet-indexed segments (their KV is in its
             blocks already); record counters.

Keys are stored rotated (like every other block) and re-rotated on copy, instead of being stored
pre-RoPE and rotated on use: the attention kernels, the prefix cache and segments then share one
block format, and the copy, which is needed anyway because positions change, does the rotation
for free (K(p+d) = R(d) K(p)).

Prefix-cache contract: blocks at or after the first reused position hold approximate KV and are
never registered as exact prefix blocks (`Request.exact_prefix_len`), so a later exact prefix hit is
always exact and prefix caching on/off never changes an output. They are registered on the
approximate chain instead (cache/kv_cache_manager.py), which only requests with
`ReuseConfig.approx_prefix` follow.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from sparsex.cache.kv_cache_manager import KVCacheManager
from sparsex.config import EngineConfig, ReuseConfig
from sparsex.engine.forward_context import ForwardContext
from sparsex.engine.request import Request, SegmentSpan
from sparsex.layers.triton_rerotate import copy_and_rerotate_all_layers_torch
from sparsex.segment import selectors
from sparsex.segment.segment_index import SegmentEntry, SegmentIndex


@dataclass
class ReusePlan:
    reuse: ReuseConfig
    hits: list[tuple[SegmentSpan, SegmentEntry]]

    @property
    def num_reused_tokens(self) -> int:
        return sum(span.end - span.start for span, _ in self.hits)

    @property
    def first_reused_position(self) -> int:
        return min(span.start for span, _ in self.hits)


@dataclass
class _SeqBlend:
    """One blended sequence inside the current step."""
    request: Request
    reuse: ReuseConfig
    reused_rows: torch.Tensor          # [R] rows of the step batch (original indexing)
    reused_pos: torch.Tensor           # [R] absolute positions
    offsets: torch.Tensor              # [R] offset inside its segment
    seg_lo: torch.Tensor               # [R] position where its segment starts
    num_segments: int = 1
    scores: torch.Tensor | None = None
    selected: int = 0


class Blender:
    def __init__(self, config: EngineConfig, model, index: SegmentIndex, kv: KVCacheManager):
        self.config = config
        self.model = model
        self.index = index
        self.kv = kv
        self.block_size = config.block_size
        self._gen = torch.Generator().manual_seed(config.seed)
        self._seqs: list[_SeqBlend] = []
        self._pending: dict[str, tuple[int, list[SegmentEntry]]] = {}   # planned, not yet admitted
        self.sparse_q_variant = "dev_qrel"     # measurement knobs (benchmarks); see docs/benchmarks.md
        self.boundary_share = 0.5              # share of sparse_q's budget spent on segment-start tokens
        # counters
        self.recomputed_tokens = 0
        self.reused_tokens = 0
        self.selection_seconds = 0.0
        self.copy_seconds = 0.0

    # ---- scheduling -------------------------------------------------------------------------
    def plan(self, req: Request, num_prefix_hit: int) -> ReusePlan | None:
        reuse = req.reuse
        hits = []
        queried = 0
        toks = req.prompt_token_ids
        for span in req.segments:
            if span.start < num_prefix_hit or span.end - span.start < reuse.min_segment_tokens:
                continue
            if span.end >= req.num_prompt_tokens:
                continue          # the last prompt token must be computed: its logits start decoding
            queried += span.end - span.start
            # counted in `admitted`: a request that waits is planned again next step
            entry = self.index.lookup(toks[span.start:span.end], req.cache_salt, count=False)
            if entry is not None:
                self.index.lock(entry)
                hits.append((span, entry))
        self._pending[req.request_id] = (queried, [e for _, e in hits])
        if not hits:
            return None
        plan = ReusePlan(reuse, hits)
        req.reuse_plan = plan
        return plan

    def admitted(self, req: Request) -> None:
        """The scheduler admitted the request with its plan: count the lookups once."""
        queried, entries = self._pending.pop(req.request_id, (0, []))
        self.index.record_lookups(queried, entries)

    def release(self, req: Request) -> None:
        """Unlock a plan that will not run (preemption, allocation failure, abort)."""
        self._pending.pop(req.request_id, None)
        plan = req.reuse_plan
        if plan is not None:
            for _, entry in plan.hits:
                self.index.unlock(entry)
            req.reuse_plan = None

    # ---- forward ----------------------------------------------------------------------------
    def prepare(self, sched, ctx: ForwardContext, runner) -> None:
        md = ctx.attn_metadata
        cu = md.cu_seqlens_q_cpu
        dev = md.positions.device
        bs = self.block_size
        src, dst, delta = [], [], []
        self._seqs = []
        t0 = time.perf_counter()
        for si, s in enumerate(sched.scheduled):
            plan: ReusePlan | None = s.reuse_plan
            if plan is None:
                continue
            req = s.request
            row0, pos0 = cu[si], req.num_computed_tokens
            table = np.fromiter((b.block_id for b in req.blocks), dtype=np.int64, count=len(req.blocks))
            rows, pos, offs, lo = [], [], [], []
            for span, entry in plan.hits:
                n = span.end - span.start
                ep = np.arange(entry.start_pos, entry.start_pos + n)                  # where it was computed
                eb = np.fromiter((b.block_id for b in entry.blocks), dtype=np.int64, count=len(entry.blocks))
                src.append(eb[ep // bs - entry.start_pos // bs] * bs + ep % bs)
                rp = np.arange(span.start, span.end)                                    # where it goes now
                dst.append(table[rp // bs] * bs + rp % bs)
                delta.append(np.full(n, span.start - entry.start_pos))
                rows.append(rp - pos0 + row0)
                pos.append(rp)
                offs.append(np.arange(n))
                lo.append(np.full(n, span.start))
            t = lambda x: torch.from_numpy(np.concatenate(x)).to(dev)
            self._seqs.append(_SeqBlend(req, plan.reuse, t(rows), t(pos), t(offs), t(lo), num_segments=len(plan.hits)))
        src_t, dst_t, delta_t = (torch.from_numpy(np.concatenate(x)).to(dev) for x in (src, dst, delta))
        inv_freq = self.model.rotary.inv_freq
        if dev.type == "cuda":
            from sparsex.layers.triton_rerotate import copy_and_rerotate
            for k_cache, v_cache in ctx.kv_caches:
                copy_and_rerotate(k_cache, v_cache, src_t, dst_t, delta_t, inv_freq)
        else:
            copy_and_rerotate_all_layers_torch(ctx.kv_caches, src_t, dst_t, delta_t, inv_freq)
        self.copy_seconds += time.perf_counter() - t0

        probe_layers = {b.reuse.full_layers - 1 for b in self._seqs if b.reuse.selector in selectors.PROBE_SELECTORS}
        ctx.probe_layers = frozenset(probe_layers)
        ctx.probe = self._probe if probe_layers else None
        ctx.row_selector = _RowSelector(self, frozenset(b.reuse.full_layers for b in self._seqs))

    def _current_rows(self, ctx: ForwardContext, rows: torch.Tensor) -> torch.Tensor:
        """Original row indices -> indices into the rows still present."""
        if ctx.kept_rows is None:
            return rows
        return torch.searchsorted(ctx.kept_rows, rows)

    def _probe(self, layer_idx, q, k, v, k_cache, v_cache, ctx: ForwardContext) -> None:
        t0 = time.perf_counter()
        md = ctx.attn_metadata
        for b in self._seqs:
            if b.reuse.full_layers - 1 != layer_idx or b.reuse.selector not in selectors.PROBE_SELECTORS:
                continue
            cur = self._current_rows(ctx, b.reused_rows)
            slots = md.slot_mapping[cur]
            k_old = k_cache.view(-1, *k_cache.shape[2:])[slots]              # [R, KVH, D] re-rotated copies
            v_old = v_cache.view(-1, *v_cache.shape[2:])[slots]
            dev = selectors.kv_deviation_scores(k[cur], v[cur], k_old, v_old)   # [R]
            if b.reuse.selector == "kv_deviation":
                b.scores = dev
            else:
                b.scores = self._sparse_q_scores(b, cur, dev, q, k, k_cache, ctx)
        self.selection_seconds += time.perf_counter() - t0

    def _sequence_keys(self, si: int, k, k_cache, ctx) -> torch.Tensor:
        """The sequence's keys at the probe layer: cached ones from the pool, this step's rows fresh."""
        md = ctx.attn_metadata
        n = md.seq_lens_cpu[si]
        bs = k_cache.shape[1]
        blocks = md.block_tables[si, : (n + bs - 1) // bs]
        keys = k_cache[blocks].flatten(0, 1)[:n].clone()                      # [n, KVH, D]
        r0, r1 = md.cu_seqlens_q_cpu[si], md.cu_seqlens_q_cpu[si + 1]
        keys[md.positions[r0:r1]] = k[r0:r1].to(keys.dtype)
        return keys

    def _sparse_q_scores(self, b: _SeqBlend, cur, dev, q, k, k_cache, ctx) -> torch.Tensor:
        """Deviation weighted by query-side importance: how much the new tokens' queries (the
        user's question, the template glue) attend to each reused token at the probe layer."""
        md = ctx.attn_metadata
        si = _seq_index(md, int(cur[0]))
        r0, r1 = md.cu_seqlens_q_cpu[si], md.cu_seqlens_q_cpu[si + 1]
        is_new = torch.ones(r1 - r0, dtype=torch.bool, device=cur.device)
        is_new[cur - r0] = False
        pos = md.positions[r0:r1]
        if b.request.query_horizon is not None:
            is_new &= pos < b.request.query_horizon
        # the query side is the prompt's tail (the question and the template glue around it): new
        # passages that missed the cache are new rows too, and all of them would make the score
        # matrix [heads, new rows, keys] (GBs at 4k rows x 4k keys) for no better signal
        new_rows = (torch.nonzero(is_new).flatten() + r0)[-_QUERY_ROWS:]
        if new_rows.numel() == 0:
            return dev
        keys = self._sequence_keys(si, k, k_cache, ctx)                       # [n, KVH, D]
        imp = selectors.query_attention_mass(q[new_rows], keys, md.positions[new_rows], q.shape[-1] ** -0.5)  # [n]
        imp = imp[b.reused_pos]
        variant = self.sparse_q_variant
        if variant == "xseg":
            return selectors.outside_segment_mass(q[cur], keys, b.reused_pos, b.seg_lo, q.shape[-1] ** -0.5)
        if variant == "qrel":
            return imp
        return dev * (1.0 + imp / imp.mean().clamp_min(1e-12))

    def select(self, layer_idx: int, ctx: ForwardContext) -> torch.Tensor | None:
        t0 = time.perf_counter()
        num_rows = ctx.attn_metadata.positions.shape[0]
        drop = torch.zeros(num_rows, dtype=torch.bool, device=ctx.attn_metadata.positions.device)
        any_drop = False
        for b in self._seqs:
            if b.reuse.full_layers != layer_idx:
                continue
            r = b.reuse
            n = b.reused_rows.numel()
            if r.selector == "all":
                keep_mask = torch.ones(n, dtype=torch.bool)
            else:
                k = int(round(r.recompute_ratio * n)) if r.selector != "none" else 0
                if r.selector == "boundary":
                    scores = selectors.boundary_scores(b.offsets)
                elif r.selector == "random":
                    scores = selectors.random_scores(n, self._gen)
                elif r.selector == "none":
                    scores = torch.zeros(n)
                else:
                    scores = b.scores.float().cpu()
                keep_mask = torch.zeros(n, dtype=torch.bool)
                if r.selector == "sparse_q" and self.boundary_share > 0 and k > 0:
                    keep_mask |= _boundary_budget(b.offsets.cpu(), b.num_segments, int(round(self.boundary_share * k)))
                    k -= int(keep_mask.sum())
                    scores = scores.masked_fill(keep_mask, float("-inf"))
                if k > 0:
                    keep_mask[torch.topk(scores.cpu(), min(k, n)).indices] = True
                if r.boundary_tokens > 0:
                    keep_mask |= b.offsets.cpu() < r.boundary_tokens
            b.selected = int(keep_mask.sum())
            cur = self._current_rows(ctx, b.reused_rows)
            drop[cur[~keep_mask.to(cur.device)]] = True
            any_drop = any_drop or b.selected < n
        self.selection_seconds += time.perf_counter() - t0
        if not any_drop:
            return None
        return torch.nonzero(~drop).flatten()

    # ---- bookkeeping ------------------------------------------------------------------------
    def after_step(self, req: Request, scheduled) -> None:
        plan: ReusePlan | None = scheduled.reuse_plan
        if plan is not None:
            b = next((x for x in self._seqs if x.request is req), None)
            # on top of an approximate-chain prefix hit the scheduler already counted
            req.num_reused_tokens += plan.num_reused_tokens
            req.num_recomputed_tokens = b.selected if b is not None else 0
            first = plan.first_reused_position
            req.exact_prefix_len = first if req.exact_prefix_len is None else min(req.exact_prefix_len, first)
            self.reused_tokens += plan.num_reused_tokens
            self.recomputed_tokens += req.num_recomputed_tokens
            self.release(req)
        if req.num_computed_tokens >= req.num_prompt_tokens and not req.segments_registered:
            req.segments_registered = True
            self._register(req)

    def _register(self, req: Request) -> None:
        """Index the request's segments that are not in the index yet (KV already in its blocks)."""
        min_len = req.reuse.min_segment_tokens
        toks = req.prompt_token_ids
        for span in req.segments:
            if span.end - span.start < min_len or span.end > req.num_computed_tokens:
                continue
            seg = toks[span.start:span.end]
            if self.index.lookup(seg, req.cache_salt, count=False) is not None:
                continue
            self.index.insert(seg, req.cache_salt, req.blocks, span.start)


_QUERY_ROWS = 128          # new rows (the last ones) whose attention weights sparse_q's scores


class _RowSelector:
    def __init__(self, blender: Blender, layers: frozenset[int]):
        self.blender = blender
        self.layers = layers

    def __call__(self, layer_idx: int, ctx: ForwardContext) -> torch.Tensor | None:
        return self.blender.select(layer_idx, ctx)


def _boundary_budget(offsets: torch.Tensor, num_segments: int, budget: int) -> torch.Tensor:
    """The first tokens of every reused segment, spread evenly, about `budget` rows in all."""
    per_segment = max(1, budget // max(1, num_segments))
    return offsets < per_segment


def _seq_index(md, row: int) -> int:
    cu = md.cu_seqlens_q_cpu
    for s in range(len(cu) - 1):
        if cu[s] <= row < cu[s + 1]:
            return s
    raise IndexError(row)
