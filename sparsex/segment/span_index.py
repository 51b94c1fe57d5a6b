"""The span index: finds, inside any prompt, every run of tokens whose KV the engine holds, at any
offset in the prompt and in the source, with no segment marked by the client.

Sources (KV computed exactly for its own tokens, keyed by the tenant's `cache_salt`):
  entry    a segment-index entry: an explicit segment (a message, an ingested passage), or a
           stretch a blended request computed in full (`segment_registrar.py`);
  request  the exact prefix-cached blocks an earlier request computed (cache/kv_cache_manager.py
           reports each run of blocks it registers); approximate-chain blocks are never sources.

Anchors are content-defined, so they do not depend on where a passage sits: every k-gram of token
ids (k = `KGRAM`) gets a 64-bit hash (a vectorised polynomial over the ids, then a mixer), and
winnowing keeps, in every window of `WINDOW` consecutive k-grams, the one(s) with the smallest hash.
Two token runs that share a stretch of `KGRAM + WINDOW - 1` = `GUARANTEED_TOKENS` tokens share an
anchor there, whatever comes before or after it (both sides pick the same minimum of the same
window). An anchor maps a hash to (source, offset); a prompt's anchors are looked up, each hit is
verified token by token and extended left and right to the maximal common run, and overlapping
runs are resolved longest first. A hash only proposes an alignment: the token comparison decides,
so a forced hash collision never reuses wrong KV.

Memory follows the block pool: an entry's anchors go with the entry (evicted or replaced), a
request run's anchors go block by block as the pool reallocates or forgets its blocks
(`BlockPool.on_evict`). An anchor keeps at most `MAX_REFS` sources (template glue recurs in every
request; the newest request runs displace older ones, entries are displaced only by entries).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

import numpy as np

from sparsex.cache.block_pool import KVCacheBlock

KGRAM = 8
WINDOW = 9
GUARANTEED_TOKENS = KGRAM + WINDOW - 1     # a common run this long always shares an anchor
MAX_REFS = 8

_rng = np.random.default_rng(0x5EA5E)
_MULT = (_rng.integers(1, 2**63, size=KGRAM, dtype=np.uint64) * np.uint64(2) + np.uint64(1))   # odd constants
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def kgram_hashes(tokens: np.ndarray) -> np.ndarray:
    """[n - KGRAM + 1] uint64: the hash of tokens[i:i + KGRAM] at i (wrapping uint64 arithmetic)."""
    n = len(tokens) - KGRAM + 1
    if n <= 0:
        return np.zeros(0, dtype=np.uint64)
    t = tokens.astype(np.uint64)
    with np.errstate(over="ignore"):
        h = t[:n] * _MULT[0]
        for j in range(1, KGRAM):
            h += t[j:j + n] * _MULT[j]
        h ^= h >> np.uint64(31)
        h *= _MIX
        h ^= h >> np.uint64(29)
    return h


def _sliding(a: np.ndarray, w: int, op) -> np.ndarray:
    """[len(a) - w + 1]: op (np.minimum / np.maximum) over every window a[i:i + w], by doubling
    (log2(w) + 1 vector ops instead of a w-wide reduction)."""
    out, span = a, 1
    while span * 2 <= w:
        out, span = op(out[:-span], out[span:]), span * 2      # out[i] = op(a[i:i + span])
    n = len(a) - w + 1
    if span < w:
        out = op(out[:n], out[w - span:w - span + n])           # [i, i + span) and [i + w - span, i + w)
    return out[:n]


def anchors(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Winnowed anchors of `tokens`: (k-gram start positions [A] int64, sorted; their hashes [A])."""
    h = kgram_hashes(tokens)
    if len(h) == 0:
        return np.zeros(0, dtype=np.int64), h
    if len(h) < WINDOW:
        keep = h == h.min()
    else:
        m = _sliding(h, WINDOW, np.minimum)                       # [S] the minimum of window s
        # i is kept iff it is the minimum of some window holding it: every such window's minimum is
        # <= h[i], so iff h[i] <= the largest of them (zero padding: neutral for uint64 maxima)
        pad = np.zeros(WINDOW - 1, dtype=np.uint64)
        keep = h <= _sliding(np.concatenate([pad, m, pad]), WINDOW, np.maximum)
    pos = np.flatnonzero(keep)
    return pos, h[pos]


@dataclass(eq=False)
class SpanSource:
    """A run of token ids whose KV sits in known blocks: token i was computed at start_pos + i."""
    kind: str                          # "entry" | "request"
    cache_salt: str | None
    tokens: np.ndarray                 # [n] int32
    start_pos: int
    block_size: int
    entry: object | None = None        # segment_index.SegmentEntry (kind "entry"): its blocks may be replaced
    run_blocks: list[KVCacheBlock] = field(default_factory=list)   # kind "request": block j holds
                                       # positions [start_pos + j * block_size, ...) (start_pos block-aligned)
    alive: list[bool] = field(default_factory=list)                # kind "request": block j still holds its KV
    anchor_refs: list[list[tuple[int, int]]] = field(default_factory=list)   # per block (request) or one
                                       # list (entry): the (hash, offset) pairs this source put in the index
    num_dead: int = 0                  # kind "request": blocks whose KV is gone (alive[j] False)

    @property
    def blocks(self) -> list[KVCacheBlock]:
        return self.entry.blocks if self.entry is not None else self.run_blocks

    def clip_to_live(self, start: int, end: int, offset: int) -> tuple[int, int]:
        """[start, end) (offsets, around `offset`) cut to the blocks around `offset` whose KV is still
        there: walks only the blocks of the run being extended, never the whole source."""
        if self.entry is not None or self.num_dead == 0:
            return start, end
        bs, j = self.block_size, offset // self.block_size
        lo = j
        while lo > start // bs and self.alive[lo - 1]:
            lo -= 1
        hi = j + 1
        while hi <= (end - 1) // bs and self.alive[hi]:
            hi += 1
        return max(start, lo * bs), min(end, hi * bs)

    def blocks_for(self, offset: int, length: int) -> tuple[int, tuple[KVCacheBlock, ...]]:
        """(position of tokens[offset], the blocks holding tokens[offset:offset + length], first one
        holding that position's block)."""
        pos = self.start_pos + offset
        bs = self.block_size
        base = self.start_pos // bs
        first, last = pos // bs - base, (pos + length - 1) // bs - base
        return pos, tuple(self.blocks[first:last + 1])


@dataclass(frozen=True)
class SpanMatch:
    """Prompt positions [start, end) equal source.tokens[offset:offset + end - start]."""
    start: int
    end: int
    source: SpanSource
    offset: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays (chunks growing 4x: a long match costs few calls)."""
    n = min(len(a), len(b))
    i, step = 0, 256               # a numpy compare costs about the same up to a few hundred elements
    while i < n:
        j = min(n, i + step)
        neq = np.flatnonzero(a[i:j] != b[i:j])
        if neq.size:
            return i + int(neq[0])
        i, step = j, step * 4
    return n


class SpanIndex:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self._anchors: dict[str | None, dict[int, list[tuple[SpanSource, int]]]] = {}
        self._block_run: dict[int, tuple[SpanSource, int]] = {}   # block_id -> (request run, block index)
        self._entries: dict[int, SpanSource] = {}                 # id(entry) -> its source
        # counters
        self.search_seconds = 0.0       # host seconds finding spans (on the TTFT path)

    # ---- sources ----------------------------------------------------------------------------
    def _put(self, src: SpanSource, hashes: np.ndarray, offsets: np.ndarray, into: list[tuple[int, int]]) -> None:
        table = self._anchors.setdefault(src.cache_salt, {})
        for h, off in zip(hashes.tolist(), offsets.tolist()):
            refs = table.get(h)
            if refs is None:
                table[h] = [(src, off)]
            else:
                if len(refs) >= MAX_REFS:
                    # displace the oldest request run, else (only entries there) the oldest entry;
                    # a request run never displaces an entry
                    victim = next((i for i, (s, _) in enumerate(refs) if s.kind == "request"), None)
                    if victim is None:
                        if src.kind == "request":
                            continue
                        victim = 0
                    del refs[victim]
                refs.append((src, off))
            into.append((h, off))

    def _drop(self, src: SpanSource, pairs: list[tuple[int, int]]) -> None:
        table = self._anchors.get(src.cache_salt)
        if table is None:
            return
        for h, off in pairs:
            refs = table.get(h)
            if refs is None:
                continue
            for i, (s, o) in enumerate(refs):
                if s is src and o == off:
                    del refs[i]
                    break
            if not refs:
                del table[h]

    def add_entry(self, entry) -> None:
        """Index a segment-index entry (`SegmentEntry`)."""
        tokens = np.frombuffer(entry.tokens, dtype=np.int32)
        src = SpanSource("entry", entry.cache_salt, tokens, entry.start_pos, self.block_size, entry=entry,
                         anchor_refs=[[]])
        pos, hashes = anchors(tokens)
        self._put(src, hashes, pos, src.anchor_refs[0])
        self._entries[id(entry)] = src

    def remove_entry(self, entry) -> None:
        src = self._entries.pop(id(entry), None)
        if src is not None:
            self._drop(src, src.anchor_refs[0])

    def add_request_run(self, token_ids: list[int], cache_salt: str | None, first_block: int,
                        blocks: list[KVCacheBlock]) -> None:
        """Index blocks a request just registered on the exact prefix chain: `blocks` hold positions
        [first_block * block_size, ...) of `token_ids` (the request's tokens), exact KV."""
        bs = self.block_size
        a, b = first_block * bs, (first_block + len(blocks)) * bs
        # anchors are picked with the context around the run, as a prompt holding it would pick them
        lo, hi = max(0, a - GUARANTEED_TOKENS), min(len(token_ids), b + GUARANTEED_TOKENS)
        ctx = np.asarray(token_ids[lo:hi], dtype=np.int32)
        src = SpanSource("request", cache_salt, ctx[a - lo:b - lo].copy(), a, bs, run_blocks=list(blocks),
                         alive=[True] * len(blocks), anchor_refs=[[] for _ in blocks])
        pos, hashes = anchors(ctx)
        pos = pos + lo - a                                        # offsets into the run
        inside = (pos >= 0) & (pos < b - a)
        pos, hashes = pos[inside], hashes[inside]
        which = pos // bs
        for j in range(len(blocks)):
            sel = which == j
            self._put(src, hashes[sel], pos[sel], src.anchor_refs[j])
            self._block_run[blocks[j].block_id] = (src, j)

    def on_evict(self, block: KVCacheBlock) -> None:
        """The pool dropped `block`'s hash (reallocated or forgotten): its KV no longer serves."""
        run = self._block_run.pop(block.block_id, None)
        if run is None:
            return
        src, j = run
        src.alive[j] = False
        src.num_dead += 1
        self._drop(src, src.anchor_refs[j])
        src.anchor_refs[j] = []

    def clear(self) -> None:
        self._anchors.clear()
        self._block_run.clear()
        self._entries.clear()

    # ---- search -----------------------------------------------------------------------------
    def find(self, prompt: np.ndarray, lo: int, hi: int, cache_salt: str | None, min_tokens: int,
             taken: list[tuple[int, int]] = (), min_context_tokens: int = 0) -> list[SpanMatch]:
        """Maximal runs of prompt[lo:hi] (int32 token ids) of at least `min_tokens` tokens found in
        the sources of `cache_salt`, disjoint from each other and from `taken` ([start, end) prompt
        intervals already served), sorted by start. A source position computed before
        `min_context_tokens` is not used at or after it (the early-encoding rule of
        `reuse_planner.too_early_for`): such a run loses its early part."""
        t0 = time.perf_counter()
        try:
            table = self._anchors.get(cache_salt)
            if not table or hi - lo < min_tokens:
                return []
            pos, hashes = anchors(prompt[lo:hi])
            if taken:             # anchors inside spans already served start no search
                free = np.ones(hi - lo, dtype=bool)
                for a, b in taken:
                    free[max(a, lo) - lo:max(min(b, hi) - lo, 0)] = False
                keep = free[pos]
                pos, hashes = pos[keep], hashes[keep]
            # looked up lazily: after a run is found, the anchors inside it are skipped unread
            hashes = hashes.tolist()
            starts = (pos + lo).tolist()
            found: list[SpanMatch] = []
            i, n = 0, len(hashes)
            # anchors before this lie inside a single-encoding run already found: there only a merged
            # entry can serve better (resolve_spans puts it first and keeps the run's pieces around it)
            covered_to = -1
            any_merged = None         # does this tenant hold a merged entry at all (asked once, if needed)
            while i < n:
                r = table.get(hashes[i])
                if not r:
                    i += 1
                    continue
                p = starts[i]
                # a merged entry outranks any other source whatever its length: extend only those
                if p < covered_to or any(merged(src) for src, _ in r):
                    r = [(src, off) for src, off in r if merged(src)]
                best = None
                for src, off in r:
                    m = self._extend(prompt, lo, hi, p, src, off, min_context_tokens)
                    if m is not None and m.num_tokens >= min_tokens and (best is None or _rank(m) > _rank(best)):
                        best = m
                if best is None:
                    i += 1
                    continue
                found.append(best)
                if any_merged is None and not merged(best.source):
                    any_merged = any(merged(src) for src in self._entries.values() if src.cache_salt == cache_salt)
                if merged(best.source) or not any_merged:
                    # the anchors inside the run just found were extended over: go on past its end
                    i = max(i + 1, bisect.bisect_left(starts, best.end, i + 1))
                else:
                    covered_to = max(covered_to, best.end)
                    i += 1
            return resolve_spans(found, list(taken), min_tokens)
        finally:
            self.search_seconds += time.perf_counter() - t0

    @staticmethod
    def _extend(prompt: np.ndarray, lo: int, hi: int, p: int, src: SpanSource, off: int,
                min_context_tokens: int) -> SpanMatch | None:
        if src.kind == "request" and not src.alive[off // src.block_size] or prompt[p] != src.tokens[off]:
            return None
        right = _common_prefix(prompt[p:hi], src.tokens[off:])
        # left: compare reversed views (no copy)
        left = _common_prefix(prompt[lo:p][::-1], src.tokens[:off][::-1])
        s_lo, s_hi = src.clip_to_live(off - left, off + right, off)
        start, end, soff = p - (off - s_lo), p + (s_hi - off), s_lo
        src_pos = src.start_pos + soff
        if src_pos < min_context_tokens <= start:
            cut = min_context_tokens - src_pos
            start, soff = start + cut, soff + cut
        if end - start <= 0:
            return None
        return SpanMatch(start, end, src, soff)

    # ---- accounting -------------------------------------------------------------------------
    def num_anchors(self) -> int:
        return sum(len(refs) for table in self._anchors.values() for refs in table.values())

    def check_integrity(self, entries, pool) -> None:
        """Every anchor points at a live source position whose k-gram has that hash; entries are
        indexed exactly while they are in the segment index; a request run's live blocks are still
        cached with their hash."""
        live_entries = {id(e) for e in entries}
        if set(self._entries) != live_entries:
            raise RuntimeError(f"span index tracks {len(self._entries)} entries, the segment index holds {len(live_entries)}")
        for salt, table in self._anchors.items():
            for h, refs in table.items():
                if not refs or len(refs) > MAX_REFS:
                    raise RuntimeError(f"anchor {h:#x} holds {len(refs)} sources")
                for src, off in refs:
                    if src.cache_salt != salt:
                        raise RuntimeError("an anchor is filed under another tenant's salt")
                    if src.kind == "entry" and self._entries.get(id(src.entry)) is not src:
                        raise RuntimeError("an anchor points at an entry that left the segment index")
                    if src.kind == "request" and not src.alive[off // self.block_size]:
                        raise RuntimeError("an anchor points at an evicted block")
                    window = src.tokens[off:off + KGRAM]
                    if len(window) == KGRAM and int(kgram_hashes(window)[0]) != h:
                        raise RuntimeError("an anchor's hash is not its k-gram's")
        for bid, (src, j) in self._block_run.items():
            block = src.run_blocks[j]
            if block.block_id != bid or not src.alive[j] or block.block_hash is None or pool.blocks[bid] is not block:
                raise RuntimeError(f"request run block {bid} is not a cached block any more")


def merged(source: SpanSource) -> bool:
    """A segment entry whose KV is the mean of several encodings: nearer a new context than any one
    encoding (docs/benchmarks/defaults.md, merged encodings), so preferred to a longer single-encoding run."""
    return source.entry is not None and source.entry.num_encodings > 1


def _rank(m: SpanMatch) -> tuple[bool, int]:
    return merged(m.source), m.num_tokens


def resolve_spans(found: list[SpanMatch], taken: list[tuple[int, int]], min_tokens: int) -> list[SpanMatch]:
    """Runs from merged entries first, then longest first: each run keeps its pieces that no earlier
    run or `taken` interval covers, if a piece still has `min_tokens` tokens. (A run that covers a
    merged entry's passage and the template glue around it serves the glue, if long enough, and the
    passage from the mean of its encodings.)"""
    out: list[SpanMatch] = []
    # the served intervals, disjoint and sorted (`taken` merged first): each run looks only at the
    # intervals that overlap it (bisect), so resolving k runs costs O(k log k), not O(k^2)
    starts: list[int] = []
    ends: list[int] = []
    for a, b in sorted(taken):
        if a >= b:
            continue
        if ends and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    for m in sorted(found, key=lambda m: (not merged(m.source), -m.num_tokens, m.start)):
        j = max(bisect.bisect_right(starts, m.start) - 1, 0)
        pieces, s = [], m.start
        while j < len(starts) and starts[j] < m.end:
            if ends[j] > s:
                if starts[j] > s:
                    pieces.append((s, starts[j]))
                s = ends[j]
            j += 1
        if s < m.end:
            pieces.append((s, m.end))
        for s, e in pieces:
            if e - s >= min_tokens:
                out.append(SpanMatch(s, e, m.source, m.offset + s - m.start))
                k = bisect.bisect_left(starts, s)
                starts.insert(k, s)
                ends.insert(k, e)
    return sorted(out, key=lambda m: m.start)
