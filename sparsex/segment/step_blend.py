"""One step's blended prefill, on the forward side: reuse segments' KV at new positions and
recompute a sparse set of tokens, all inside the normal forward pass.

For a request whose prompt is P (exact prefix hit) + reused segments R1..Rm + new tokens N, whose
hits `reuse_planner.ReusePlanner` planned and locked at admission, the model runner builds a
`StepBlend` for the step (F = full_layers):

  install    the copy hook (every hit's K/V, from layer F-1 on, into the request's own blocks, keys
             re-rotated from the positions they were computed at to their new positions), a probe
             on layer F-1 and the row selector inside layer F-1. The query selectors (query_fused,
             chunk_anchor) probe each of the full layers 1..F-1 (`query_layers`), and the copy hook
             runs before the first of them.
  forward    layers 0..F-2 compute every row of R ∪ N; layer F-1 computes every row's K/V (the
             fresh ones overwrite the copies; the probe scores from them), then the selector keeps
             N plus the top-scored reused rows, and layer F-1's attention and MLP and layers
             F..L-1 run only those rows, each attending at its absolute position over all keys <= it.
             The dropped rows' outputs of layer F-1 would be read by nothing, so computing them
             would only cost: their K/V are all later layers need of them.
  results    per request: reused, candidate and recomputed counts and the reused spans
             (`BlendResult`), returned in the runner's step result; the engine sets the request's
             counters from it, and `segment_registrar.py` indexes the request's new segments.

Keys are stored rotated (like every other block) and re-rotated on copy, instead of being stored
pre-RoPE and rotated on use: the attention kernels, the prefix cache and segments then share one
block format, and the copy, which is needed anyway because positions change, does the rotation
for free (K(p+d) = R(d) K(p)).

On the GPU nothing in a blended forward waits for the device: the copy plan is built and uploaded
while the layers below F-1 run, the row selection stays on the device, and how many rows each
sequence keeps follows from the rule on the host (`StepBlend._keep_count`), so the step's one sync
is the sampled token (`python3 benchmarks/gpu_engine.py --sections syncs` lists them).

Prefix-cache contract: blocks at or after the first reused position hold approximate KV and are
never registered as exact prefix blocks (`Request.exact_prefix_len`), so a later exact prefix hit is
always exact and prefix caching on/off never changes an output. They are registered on the
approximate chain instead (cache/kv_cache_manager.py), which only requests with
`ReuseConfig.approx_prefix` follow.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from sparsex.cache.slot_mapping import block_ids, slot_mapping
from sparsex.config import ReuseConfig
from sparsex.layers import triton_probe
from sparsex.layers.forward_context import ForwardContext
from sparsex.layers.triton_rerotate import LayerPointers, copy_and_rerotate_all_layers_torch, copy_and_rerotate_layers
from sparsex.segment.segment_request import SegmentRequest
from sparsex.segment import selectors
from sparsex.segment.reuse_plan import ReusePlan


@dataclass(frozen=True)
class BlendResult:
    """What one request's selection kept (host values, known without a device sync); which tokens
    were reused is its `ReusePlan`."""
    num_candidate_tokens: int       # reused tokens the first selection kept
    num_recomputed_tokens: int      # reused tokens the last selection kept: recomputed in every layer


@dataclass
class _SeqBlend:
    """One blended sequence inside the current step."""
    request: SegmentRequest
    reuse: ReuseConfig
    reused_rows: torch.Tensor          # [R] rows of the step batch (original indexing)
    reused_pos: torch.Tensor           # [R] absolute positions
    offsets: torch.Tensor              # [R] offset inside its segment
    seq_index: int                     # the sequence's index in the step
    seg_lens: list[int]                # length of each reused segment (host copy: counts need no sync)
    query_rows: torch.Tensor           # [<= _QUERY_ROWS] new rows whose attention sparse_q weighs
    stage: int = 0                     # index into selection_layers(reuse): the next selection
    scores: torch.Tensor | None = None
    # CUDA sparse_q: (deviation [R], queries [T, H, D]) of the probe, made into scores by `select`
    # once the layer has stored this step's K (the query mass reads the paged cache)
    pending: tuple[torch.Tensor, torch.Tensor] | None = None
    # query_fused / chunk_anchor: [R] the query rows' attention mass on each reused row, averaged
    # over the probe layers so far (selectors.fused_layers)
    query_mass: torch.Tensor | None = None
    selected: int = 0                  # reused rows the last selection kept
    candidates: int = 0                # reused rows the first selection kept

    @property
    def num_reused(self) -> int:
        """R before any selection (host)."""
        return sum(self.seg_lens)

    @property
    def layer(self) -> int | None:
        """The layer of this sequence's next probe and selection; None once it has made them all."""
        layers = selection_layers(self.reuse)
        return layers[self.stage] if self.stage < len(layers) else None

    def narrow(self, idx: torch.Tensor) -> None:
        """Keep only the reused rows `idx` ([R'] sorted indices into the current ones)."""
        self.reused_rows, self.reused_pos = self.reused_rows[idx], self.reused_pos[idx]
        self.offsets = self.offsets[idx]
        self.scores = self.pending = None

    @property
    def num_segments(self) -> int:
        return len(self.seg_lens)


class LayerPointerCache:
    """CUDA copy: the address tables of the runner's caches from each first layer copied, made once
    (building one uploads it, which waits for the GPU); dropped if the cache list is replaced."""

    def __init__(self):
        self._groups: dict[int, list[tuple[LayerPointers, torch.Tensor]]] = {}
        self._caches: list | None = None

    def groups(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], first_layer: int,
               inv_freqs: list[torch.Tensor]) -> list[tuple[LayerPointers, torch.Tensor]]:
        """The address tables of `kv_caches[first_layer:]`, one per RoPE base those layers use (one
        kernel launch each: a single one for most models, two for Gemma 3's sliding/global layers)."""
        if kv_caches is not self._caches:
            self._groups, self._caches = {}, kv_caches
        if first_layer not in self._groups:
            by_freq: dict[int, list[int]] = {}
            for layer in range(first_layer, len(kv_caches)):
                by_freq.setdefault(id(inv_freqs[layer]), []).append(layer)
            self._groups[first_layer] = [(LayerPointers([kv_caches[i] for i in layers]), inv_freqs[layers[0]])
                                         for layers in by_freq.values()]
        return self._groups[first_layer]


class StepBlend:
    """The blended sequences of one step: built by the model runner before the forward, called
    from inside it (copy, probe, select), read after it (`results`)."""

    def __init__(self, sched, ctx: ForwardContext, inv_freqs: list[torch.Tensor], uploader,
                 pointers: LayerPointerCache, generator: torch.Generator, reduce_scores=None,
                 same_on_all_ranks=None):
        """Install the probe, the row selector (this object) and the copy hook on `ctx`. The copy
        plan itself is built and launched from inside the forward, just before the first selection
        layer (`_copy_reused`; on the GPU the host builds it while the layers below run). Only layers
        whose copies are read are copied: the selection layer stores every row's fresh K/V over
        them, so it needs its copies only where the probe compares the two.

        `reduce_scores(deviation, mass)`, under tensor parallelism: each rank scores with its own
        heads, and this turns a rank's [R] K/V deviation and [R] query mass (either may be None) into
        the whole model's, identical on every rank, so every rank keeps the same rows."""
        self._reduce = reduce_scores or (lambda deviation, mass: (deviation, mass))
        self._same_rows = same_on_all_ranks     # tensor -> whether every rank holds the same one
        self.inv_freqs = inv_freqs               # per layer [rotary_dim / 2] float32, the model's RoPE frequencies
        self.uploader = uploader                 # the runner's PinnedUploader: one pinned upload a step
        self.pointers = pointers
        self._gen = generator                    # the `random` selector's draws (long-lived: seeded once)
        self._seqs: list[_SeqBlend] = []
        self.copy_seconds = 0.0                  # host seconds building and launching the copy
        self.selection_seconds = 0.0             # host seconds in the probes and selections
        reuses = [s.reuse_plan.reuse for s in sched.scheduled if s.reuse_plan is not None]
        # the rows are known from the hook on: it runs before the first probe (query_fused probes
        # from layer 1) or selection
        hook_layer = min(min((selection_layer(r), *query_layers(r))) for r in reuses)
        copy_from = min(selection_layer(r) + (r.selector not in selectors.DEVIATION_SELECTORS) for r in reuses)
        ctx.pre_layer_hooks[hook_layer] = lambda: self._copy_reused(sched, ctx, copy_from)
        probe_layers = {layer for r in reuses if r.selector in selectors.PROBE_SELECTORS
                        for layer in (*selection_layers(r), *query_layers(r))}
        ctx.probe_layers = frozenset(probe_layers)
        ctx.probe = self._probe if probe_layers else None
        self.layers = frozenset(layer for r in reuses for layer in selection_layers(r))
        ctx.row_selector = self

    def __call__(self, layer_idx: int, ctx: ForwardContext) -> tuple[torch.Tensor, list[int]] | None:
        """The forward's row selector (`layers.forward_context.RowSelector`)."""
        return self.select(layer_idx, ctx)

    def results(self) -> dict[str, BlendResult]:
        """Each blended request's outcome, by request id (host values: read after the forward)."""
        return {b.request.request_id: BlendResult(b.candidates, b.selected)
                for b in self._seqs}

    def _copy_reused(self, sched, ctx: ForwardContext, first_layer: int) -> None:
        """Copy every hit's K/V of layers `first_layer`.. into the requests' own blocks, keys
        re-rotated to their new positions, and record each blended sequence's rows."""
        md = ctx.attn_metadata
        cu = md.cu_seqlens_q_cpu
        dev = md.positions.device
        bs = ctx.kv_caches[0][0].shape[1]        # block size
        t0 = time.perf_counter()
        per_seq = []          # (seq index, plan, segment lengths, [6, R] int64 host plan, query rows)
        for si, s in enumerate(sched.scheduled):
            plan: ReusePlan | None = s.reuse_plan
            if plan is None:
                continue
            req = s.request
            row0, pos0 = cu[si], req.num_computed_tokens
            table = block_ids(req.blocks)
            # every reused row of every hit at once (vectorised over hits: 64 passages at 32k tokens
            # made a per-hit loop of small numpy calls a few ms of host time)
            starts = np.array([h.start for h in plan.hits], dtype=np.int64)       # new positions
            lens = np.array([h.num_tokens for h in plan.hits], dtype=np.int64)
            old = np.array([h.start_pos for h in plan.hits], dtype=np.int64)      # computed at
            seg = np.repeat(np.arange(len(lens)), lens)                                  # [R] hit of each row
            offs = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)   # [R] offset in its hit
            rp, ep = starts[seg] + offs, old[seg] + offs
            # the hits' blocks as one table; hit i's run starts at eb0[i] and holds its start_pos's
            # block (old // bs) first
            entry_blocks = [h.blocks for h in plan.hits]
            eb = block_ids([b for blocks in entry_blocks for b in blocks])
            eb0 = np.cumsum([len(x) for x in entry_blocks]) - np.array([len(x) for x in entry_blocks])
            src = slot_mapping(eb, ep, bs, first_block=old[seg] // bs - eb0[seg])
            dst = slot_mapping(table, rp, bs)
            query_rows = self._query_rows(req, rp, pos0, row0, cu[si + 1] - cu[si])
            per_seq.append((si, plan, lens.tolist(),
                            np.stack([src, dst, (starts - old)[seg], rp - pos0 + row0, rp, offs]),
                            query_rows))
        # one upload for the whole step: the [6, R_total] plan (src slot, dst slot, delta, row,
        # position, offset), then the query rows. Pinned and asynchronous: the GPU may
        # still run the layers below the hook, and a pageable upload would wait for them.
        plan_h = np.concatenate([x[3] for x in per_seq], axis=1)
        up = self.uploader.upload([np.concatenate([plan_h.ravel()] + [x[4] for x in per_seq])])[0]
        plan_t, query_t = up[:plan_h.size].view(6, -1), up[plan_h.size:]
        src_t, dst_t, delta_t = plan_t[0], plan_t[1], plan_t[2]
        col = qcol = 0
        for si, plan, seg_lens, h, query_rows in per_seq:
            part = plan_t[:, col:col + h.shape[1]]
            col += h.shape[1]
            self._seqs.append(_SeqBlend(sched.scheduled[si].request, plan.reuse, part[3], part[4], part[5],
                                        seq_index=si, seg_lens=seg_lens,
                                        query_rows=query_t[qcol:qcol + len(query_rows)]))
            qcol += len(query_rows)
        if dev.type == "cuda":
            for pointers, inv_freq in self.pointers.groups(ctx.kv_caches, first_layer, self.inv_freqs):
                copy_and_rerotate_layers(pointers, src_t, dst_t, delta_t, inv_freq)
        else:
            copy_and_rerotate_all_layers_torch(ctx.kv_caches[first_layer:], src_t, dst_t, delta_t,
                                               self.inv_freqs[first_layer:])
        self.copy_seconds += time.perf_counter() - t0

    @staticmethod
    def _query_rows(req: SegmentRequest, reused_pos: np.ndarray, pos0: int, row0: int, num_rows: int) -> np.ndarray:
        """sparse_q's query side: the step's last new rows (the question and the template glue around
        it), not every new row: passages that missed the cache are new rows too, and all of them
        would make the score matrix [heads, new rows, keys] GBs for no better signal."""
        step_pos = np.arange(pos0, pos0 + num_rows)
        is_new = np.ones(num_rows, dtype=bool)
        is_new[reused_pos - pos0] = False
        if req.query_horizon is not None:
            is_new &= step_pos < req.query_horizon
        return np.flatnonzero(is_new)[-_QUERY_ROWS:] + row0

    def _current_rows(self, ctx: ForwardContext, rows: torch.Tensor) -> torch.Tensor:
        """Original row indices -> indices into the rows still present."""
        if ctx.kept_rows is None:
            return rows
        return torch.searchsorted(ctx.kept_rows, rows)

    def _probe(self, layer_idx, q, k, v, k_cache, v_cache, ctx: ForwardContext) -> None:
        """Before layer `layer_idx` stores this step's K/V: the deviation of every reused row's fresh
        K/V from the re-rotated copies still in the cache; for query_fused / chunk_anchor, once every
        deviation is read, the query rows' attention mass (`_probe_query`)."""
        t0 = time.perf_counter()
        query = []                                    # query_fused / chunk_anchor sequences probing here
        for b in self._seqs:
            if b.reuse.selector in selectors.QUERY_SELECTORS:
                if b.stage == 0 and layer_idx in query_layers(b.reuse):
                    query.append(b)
                    if b.reuse.selector == "chunk_anchor" and layer_idx == b.layer:
                        b.scores = self._reduce(self._deviation(b, k, v, k_cache, v_cache, ctx), None)[0]  # before any store
                continue
            if b.layer != layer_idx or b.reuse.selector not in selectors.PROBE_SELECTORS:
                continue
            dev = self._deviation(b, k, v, k_cache, v_cache, ctx)
            if b.reuse.selector == "kv_deviation" or b.query_rows.numel() == 0:
                b.scores = self._reduce(dev, None)[0]
            elif k.is_cuda:
                b.pending = (dev, q)
            else:
                b.scores = selectors.sparse_q_scores(*self._reduce(dev, self._query_mass(b, q, k, k_cache, ctx)))
        if query:
            self._probe_query(query, layer_idx, q, k, v, k_cache, v_cache, ctx)
        self.selection_seconds += time.perf_counter() - t0

    def _deviation(self, b: _SeqBlend, k, v, k_cache, v_cache, ctx: ForwardContext) -> torch.Tensor:
        """[R] each reused row's K/V deviation from its re-rotated copy, still in the cache."""
        md = ctx.attn_metadata
        cur = self._current_rows(ctx, b.reused_rows)
        if k.is_cuda:
            return triton_probe.kv_deviation(k, v, k_cache, v_cache, cur, md.slot_mapping)
        slots = md.slot_mapping[cur]
        k_old = k_cache.view(-1, *k_cache.shape[2:])[slots]                  # [R, KVH, D] re-rotated copies
        v_old = v_cache.view(-1, *v_cache.shape[2:])[slots]
        return selectors.kv_deviation_scores(k[cur], v[cur], k_old, v_old)

    def _probe_query(self, seqs: list[_SeqBlend], layer_idx: int, q, k, v, k_cache, v_cache,
                     ctx: ForwardContext) -> None:
        """query_fused / chunk_anchor at one of their probe layers: the query rows' attention mass on
        each reused row, added into its mean over `query_layers` (selectors.add_layer_mass). On the
        GPU the mass reads the paged cache, so this step's K/V are stored first (the layer stores the
        same values again right after); every deviation of this layer was read before."""
        md = ctx.attn_metadata
        if k.is_cuda:
            ctx.backend.store_kv(k, v, k_cache, v_cache, md.slot_mapping)
        for b in seqs:
            if b.query_rows.numel() == 0:                                    # no query: every row alike
                mass = torch.ones(b.reused_rows.numel(), dtype=torch.float32, device=k.device)
            else:
                mass = self._reduce(None, self._query_mass(b, q, k, k_cache, ctx))[1]
            b.query_mass = selectors.add_layer_mass(b.query_mass, mass, len(query_layers(b.reuse)))

    def _finish_sparse_q(self, b: _SeqBlend, layer_idx: int, ctx: ForwardContext) -> torch.Tensor:
        """CUDA sparse_q, after the layer's K/V store: the probe's deviation weighted by the query
        rows' attention mass on each reused token, read from the paged cache (triton_probe.py)."""
        dev, q = b.pending
        b.pending = None
        return selectors.sparse_q_scores(*self._reduce(dev, self._query_mass(b, q, None, ctx.kv_caches[layer_idx][0], ctx)))

    def _query_mass(self, b: _SeqBlend, q, k, k_cache, ctx: ForwardContext) -> torch.Tensor:
        """[R] the query rows' attention mass on each reused row at this layer. On the GPU it reads
        the paged cache (this step's K must be stored: `k` is unused); on the CPU it gathers the
        sequence's keys with this step's fresh `k`."""
        md = ctx.attn_metadata
        si = b.seq_index
        rows = self._current_rows(ctx, b.query_rows)
        scale = q.shape[-1] ** -0.5
        if q.is_cuda:
            mass = triton_probe.query_key_mass(q, rows, md.positions, k_cache, md.block_tables[si],
                                               md.seq_lens_cpu[si], scale)                           # [n]
        else:
            keys = self._sequence_keys(si, k, k_cache, ctx)                  # [n, KVH, D]
            mass = selectors.query_attention_mass(q[rows], keys, md.positions[rows], scale)           # [n]
        return mass[b.reused_pos]

    def _sequence_keys(self, si: int, k, k_cache, ctx) -> torch.Tensor:
        """The sequence's keys at the probe layer: cached ones from the pool, this step's rows fresh."""
        md = ctx.attn_metadata
        n = md.seq_lens_cpu[si]
        bs = k_cache.shape[1]
        blocks = md.block_tables[si, : (n + bs - 1) // bs]
        keys = k_cache[blocks].flatten(0, 1)[:n]                              # [n, KVH, D], a gathered copy
        r0, r1 = md.cu_seqlens_q_cpu[si], md.cu_seqlens_q_cpu[si + 1]
        keys[md.positions[r0:r1]] = k[r0:r1].to(keys.dtype)
        return keys

    def select(self, layer_idx: int, ctx: ForwardContext) -> tuple[torch.Tensor, list[int]] | None:
        """Rows to keep from layer `layer_idx`'s attention on, and how many each sequence keeps;
        None: all.
        No host sync: how many rows a sequence keeps follows from the rule and the segment lengths
        alone (`_keep_count`), so the host builds the sparse layers' metadata and keeps launching
        while the GPU is still in the full layers."""
        t0 = time.perf_counter()
        md = ctx.attn_metadata
        keep = None                                                          # [num_rows] bool
        blends = []
        present = []                                                         # reused rows before this selection
        for b in self._seqs:
            if b.layer != layer_idx:
                continue
            if keep is None:
                keep = torch.ones(md.positions.shape[0], dtype=torch.bool, device=md.positions.device)
            if b.pending is not None:
                b.scores = self._finish_sparse_q(b, layer_idx, ctx)
            mask = self._keep_mask(b)
            b.selected = self._keep_count(b)
            if mask.device.type == "cpu":                                     # free to check here
                if int(mask.sum()) != b.selected:
                    raise RuntimeError(f"keep mask has {int(mask.sum())} rows, _keep_count {b.selected}")
                self._check_same_rows(b, mask)
            keep[self._current_rows(ctx, b.reused_rows)] = mask
            present.append(b.reused_rows.numel())
            if b.stage == 0:
                b.candidates = b.selected
            b.stage += 1
            if b.layer is not None:
                b.narrow(_true_indices(mask, b.selected))   # the candidates, scored again deeper
            blends.append(b)
        if keep is None:
            return None
        rows_per_seq = [b - a for a, b in zip(md.cu_seqlens_q_cpu, md.cu_seqlens_q_cpu[1:])]
        for b, n in zip(blends, present):
            rows_per_seq[b.seq_index] -= n - b.selected
        self.selection_seconds += time.perf_counter() - t0
        if all(b.selected == n for b, n in zip(blends, present)):
            return None
        return _true_indices(keep, sum(rows_per_seq)), rows_per_seq

    def _check_same_rows(self, b: _SeqBlend, mask: torch.Tensor) -> None:
        """Under tensor parallelism on the CPU: every rank kept the same rows (a rank that kept
        others would attend over different keys). Checked where a sync costs nothing."""
        if self._same_rows is None:
            return
        kept = b.reused_pos[mask].double()
        fingerprint = torch.stack([kept.sum(), (kept * kept).sum()])
        if not self._same_rows(fingerprint):
            raise RuntimeError(f"tensor-parallel ranks kept different rows for request {b.request.request_id!r}")

    def _keep_plan(self, b: _SeqBlend) -> tuple[int, int, int]:
        """The rule of `b`'s next selection, from host data only (the GPU path must not sync):
        (leading tokens of every segment kept whatever the scores, how many rows that keeps, rows
        then picked by score). sparse_q's boundary share is paid from the budget; `boundary_tokens`
        come on top of it. A first stage of two keeps the same leading tokens and picks up to
        `candidate_ratio` of the reused rows by score; the second picks among those candidates."""
        r = b.reuse
        n = b.num_reused
        lead, num_lead, k = self._final_plan(b)
        if b.stage == 0 and len(selection_layers(r)) > 1:
            k = min(max(k, int(round(r.candidate_ratio * n)) - num_lead), n - num_lead)
        return lead, num_lead, k

    def _final_plan(self, b: _SeqBlend) -> tuple[int, int, int]:
        """`_keep_plan` of the last (or only) selection: recompute_ratio of the reused rows."""
        r = b.reuse
        n = b.num_reused
        k = int(round(r.recompute_ratio * n)) if r.selector != "none" else 0
        lead = r.boundary_tokens
        if r.selector == "sparse_q" and r.boundary_share > 0 and k > 0:
            per_segment = max(1, int(round(r.boundary_share * k)) // b.num_segments)
            lead = max(lead, per_segment)
            k -= sum(min(per_segment, s) for s in b.seg_lens)
        num_lead = sum(min(lead, s) for s in b.seg_lens)
        return lead, num_lead, min(max(k, 0), n - num_lead)

    def _keep_count(self, b: _SeqBlend) -> int:
        """How many reused rows `_keep_mask` keeps."""
        if b.reuse.selector == "all":
            return b.reused_rows.numel()
        _, num_lead, num_scored = self._keep_plan(b)
        return num_lead + num_scored

    def _keep_mask(self, b: _SeqBlend) -> torch.Tensor:
        """[R] bool on the rows' device, over the reused rows still present: which go on past this
        selection (the K/V store of its layer) and are recomputed in the later layers:
        the fixed leading tokens of each segment, then the top-scored others (exactly
        `_keep_count(b)` rows)."""
        r = b.reuse
        n = b.reused_rows.numel()
        dev = b.offsets.device
        if r.selector == "all":
            return torch.ones(n, dtype=torch.bool, device=dev)
        lead, _, k = self._keep_plan(b)
        keep = b.offsets < lead
        if k > 0:
            if r.selector == "boundary":
                scores = selectors.boundary_scores(b.offsets)
            elif r.selector == "random":
                scores = selectors.random_scores(n, self._gen).to(dev)
            elif r.selector == "query_fused":        # no query rows: the segment starts, as boundary
                scores = b.query_mass if b.query_rows.numel() else selectors.boundary_scores(b.offsets)
            elif r.selector == "chunk_anchor":
                scores = selectors.chunk_anchor_scores(b.query_mass, b.scores, b.offsets, keep, b.num_segments)
            else:
                scores = b.scores.float()
            top = torch.topk(scores.masked_fill(keep, float("-inf")), k).indices
            keep.index_fill_(0, top, True)          # not `keep[top] = True`: that syncs on CUDA
        return keep

def selection_layer(reuse: ReuseConfig) -> int:
    """The layer inside which reused rows are dropped (after it stores every row's K/V): F-1, the
    layer the probe reads. With F = 0 that is layer 0, whose K/V depend on token and position only,
    so its fresh K/V equal the re-rotated copies."""
    return max(reuse.full_layers - 1, 0)


def selection_layers(reuse: ReuseConfig) -> tuple[int, ...]:
    """Every layer inside which reused rows are dropped: the selection layer, and with two-stage
    selection the layer `rescore_layers` deeper, whose probe re-scores the candidates. `reuse` is a
    request's (`ReuseConfig.resolved`: rescore_layers is an int)."""
    first = selection_layer(reuse)
    return (first, first + reuse.rescore_layers) if reuse.rescore_layers else (first,)


def query_layers(reuse: ReuseConfig) -> tuple[int, ...]:
    """The layers whose probe adds to query_fused's / chunk_anchor's fused query mass (the last is
    their selection layer); () for every other selector."""
    return selectors.fused_layers(reuse.full_layers) if reuse.selector in selectors.QUERY_SELECTORS else ()


_QUERY_ROWS = 128          # new rows (the last ones) whose attention weights sparse_q's scores


def _true_indices(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Sorted indices of the `count` True entries of `mask` ([n] bool) -> [count] int64, without
    the device->host sync `torch.nonzero` makes to learn its output size."""
    n = mask.numel()
    rank = torch.cumsum(mask, 0) - 1                                         # [n] rank among the True ones
    out = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    # False entries all write to the spare last slot, which is dropped
    out.scatter_(0, torch.where(mask, rank, count), torch.arange(n, device=mask.device))
    return out[:count]
