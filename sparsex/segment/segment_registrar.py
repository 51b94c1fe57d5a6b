"""After a step: what the engine does with a request's prompt segments once its prompt is computed.

  new segments        indexed, pinning the request's blocks that hold them (their KV is there already);
                      in a request that reused KV (blended, or continued an approximate prefix), only
                      segments it computed in full, never rows that were reused;
  fresh stretches     (`transparent_segments`) the rest of what such a request computed in full (runs
                      of at least `min_segment_tokens` outside its reused spans and explicit segments)
                      is indexed too, so a later prompt finds it by content: an exact request needs
                      none, its blocks are already on the exact prefix chain, which the span index
                      reads; with a store that shares spans (`segment_store_spans`) such a stretch is
                      published like a new explicit segment (a request's exact KV that is no entry is
                      published once it recurs: `ReusePlanner.admit`);
  early encodings     an entry computed right after a short head (`min_context_tokens`) that this
                      request recomputed later in its prompt is replaced by this encoding;
  merged encodings    a segment the index holds that this request computed exactly in another
                      context (it did not blend: `blend=False`, as an ingestion pass sends, or below
                      `min_blend_tokens`) is folded into the entry, which becomes the running mean of
                      up to `merge_encodings` encodings, keys re-rotated to its position
                      (`layers/triton_rerotate.merge_rerotated_all_layers_torch`); the entry first gets
                      blocks of its own (`SegmentIndex.copy_on_write`), since its blocks are usually
                      exact prefix-cache blocks too.
"""
from __future__ import annotations

import numpy as np

from sparsex.cache.device_kv import DeviceKV
from sparsex.cache.slot_mapping import block_ids, slot_mapping
from sparsex.inputs import SegmentSpan
from sparsex.layers.triton_rerotate import merge_rerotated_all_layers_torch
from sparsex.segment.segment_request import SegmentRequest
from sparsex.segment.reuse_planner import early, fresh_intervals, too_early_for
from sparsex.segment.segment_index import SegmentEntry, SegmentIndex
from sparsex.segment.segment_tiers import SegmentTiers


class SegmentRegistrar:
    def __init__(self, index: SegmentIndex, kv: DeviceKV, store: SegmentTiers | None):
        self.index = index
        self.kv = kv              # the KV caches merged encodings are written into
        self.block_size = kv.block_size
        self.store = store        # new entries and merges go there too (None: no tier below)

    def register_if_prefilled(self, req: SegmentRequest) -> None:
        """Once the request's prompt is computed, register its segments (once per request; the one
        writer of `Request.segments_registered`)."""
        if req.segments_registered or req.num_computed_tokens < req.num_prompt_tokens:
            return
        req.segments_registered = True
        self.register(req)

    def register(self, req: SegmentRequest) -> None:
        """Index the request's segments that are not in the index yet (KV already in its blocks),
        replace early encodings it recomputed with more context, and merge the encodings it
        computed exactly into the entries that already hold those segments."""
        reuse = req.reuse
        toks = req.prompt_token_ids
        exact = req.exact_prefix_len is None          # nothing of it was blended
        end = req.prompt_end
        reused = [(s.start, s.end) for s in req.reuse_record.reused_spans]
        fresh = None if exact else fresh_intervals(0, end, reused)     # KV this request computed in full
        handled = []          # segments indexed (or found) whole
        for span in req.segments:
            if span.end - span.start < reuse.min_segment_tokens or span.end > req.num_computed_tokens:
                continue
            if fresh is not None and not any(a <= span.start and span.end <= b for a, b in fresh):
                continue          # holds reused (approximate) rows: only its fresh part may be indexed
            handled.append((span.start, span.end))
            seg = toks[span.start:span.end]
            entry = self.index.lookup(seg, req.cache_salt, count=False)
            if entry is None:
                self._publish(self.index.insert(seg, req.cache_salt, req.blocks, span.start))
            elif entry.locks:
                continue
            elif too_early_for(entry, span.start, reuse):
                self.index.remove(entry)      # an early encoding, recomputed here with more context
                self._publish(self.index.insert(seg, req.cache_salt, req.blocks, span.start))
            elif (exact and span.start >= req.num_cached_tokens and entry.num_encodings < reuse.merge_encodings
                  and early(entry.start_pos, reuse) == early(span.start, reuse)):
                self._merge(entry, req, span)
        if fresh is not None and reuse.transparent_segments and reuse.blend:
            # before exact_prefix_len the blocks are on the exact prefix chain: the span index has them
            for a, b in fresh_intervals(req.exact_prefix_len, end, reused):
                for start, stop in fresh_intervals(a, b, handled):
                    if stop - start >= reuse.min_segment_tokens:
                        entry = self.index.insert(toks[start:stop], req.cache_salt, req.blocks, start, explicit=False)
                        if self.store is not None and self.store.shares_spans:
                            self._publish(entry)        # a registered reuse source, shared by content

    def _merge(self, entry: SegmentEntry, req: SegmentRequest, span: SegmentSpan) -> None:
        """Merged encodings: the entry's KV becomes the running mean of its encodings and this one
        (keys re-rotated to the entry's positions). An entry that shares its blocks (usually also
        exact prefix-cache blocks, whose KV must stay exact) gets blocks of its own, the new mean
        written straight into them (copy on write); skipped, with nothing changed, when the pool has
        no free blocks for them."""
        bs = self.block_size
        first = entry.start_pos // bs
        rows = np.arange(entry.start_pos, entry.start_pos + span.end - span.start)   # the entry's positions
        src = slot_mapping(block_ids(req.blocks), np.arange(span.start, span.end), bs)
        mean = slot_mapping(block_ids(entry.blocks), rows, bs, first)   # read before copy-on-write replaces the blocks

        def fold(dst_blocks: list) -> None:
            arrays = [src, mean, slot_mapping(block_ids(dst_blocks), rows, bs, first),
                      np.full_like(src, entry.start_pos - span.start)]
            weight = 1.0 / (entry.num_encodings + 1)
            src_t, mean_t, dst_t, delta_t = self.kv.upload(arrays)
            merge_rerotated_all_layers_torch(self.kv.kv_caches, src_t, mean_t, dst_t, delta_t,
                                             self.kv.layer_inv_freqs(), weight)
            if self.kv.on_merge is not None:
                self.kv.on_merge(arrays, weight)

        if self.index.owns_blocks(entry):
            fold(entry.blocks)
        elif not self.index.copy_on_write(entry, lambda old, new: fold(new)):
            return
        entry.num_encodings += 1
        if self.store is not None:
            self.store.publish_merge(entry, req.blocks, span.start)

    def _publish(self, entry: SegmentEntry | None) -> None:
        if entry is not None and self.store is not None:
            self.store.publish(entry)
