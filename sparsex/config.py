"""Engine configuration: every knob of `LLM(...)` / `sparsex serve`, validated up front."""
from __future__ import annotations

import dataclasses
import functools
import numbers
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from sparsex.arg_types import parse_bytes
from sparsex.store_urls import parse_mooncake_url, parse_redis_url

# Each choice list, declared once: for the knobs' `choices` and for every component that takes such
# a value (the segment index's eviction policy, the shared store's fetch policy, ...).
CACHE_MODES = ("none", "prefix", "sparsex")
SELECTORS = ("sparse_q", "kv_deviation", "boundary", "random", "none", "all", "query_fused", "chunk_anchor")
PROBE_SELECTORS = ("kv_deviation", "sparse_q", "query_fused", "chunk_anchor")   # score tokens with a probe on full layers
# probe selectors ruled by the query rows' attention over several full layers (selectors.py): one stage only
QUERY_SELECTORS = ("query_fused", "chunk_anchor")
AUTO_RESCORE_LAYERS = 2     # sparse_q's second probe, this many layers below its first (ReuseConfig.resolved)
# recompute_ratio="auto": the bounds of a request's share (the rule: segment/recompute_budget.py)
AUTO_RATIO_MIN = 0.0625
AUTO_RATIO_MAX = 0.25
AUTO = "auto"
# quality_target: the bounds the recompute_ratio moves within (engine/ratio_controller.py)
QUALITY_TARGET_RATIO_MIN = 0.0625
QUALITY_TARGET_RATIO_MAX = 0.5
DTYPES = ("auto", "float32", "bfloat16", "float16")    # EngineConfig.dtype's names; parse_dtype also reads fp32, ...
SEGMENT_EVICTION = ("lru", "frequency")
STORE_FETCH_MODES = ("auto", "always", "never")
BLOCK_SIZES = (8, 16, 32, 64, 128)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_native_bf16() -> bool:
    """True when oneDNN runs bf16 GEMMs natively on this CPU (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX).
    Elsewhere (an AVX2-only CPU such as AMD Zen 3) bf16 GEMMs are emulated and ~3.6x slower than
    fp32 (2 cores: 15.5 against 56 GFLOP/s for [2048, 576] x [576, 1536])."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def verify_device(device: str) -> None:
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """"auto" is bfloat16 on a GPU and on a CPU with native bf16 GEMMs, float32 on other CPUs."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if not device.startswith("cpu") or cpu_has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES) + ['auto']}")
    return _DTYPES[dtype]


_NOT_IN_KV_KEY = ("reuse_profile", "approx_prefix", "merge_encodings", "blend", "transparent_segments")

# Named sets of the knobs that trade prefill work for closeness to full prefill, measured on SmolLM2-135M
# rag (docs/benchmarks/reuse-quality.md, "Reuse profiles"). `default` is ReuseConfig's declared defaults.
REUSE_PROFILES: dict[str, dict[str, Any]] = {
    "fast": {"full_layers": 2, "recompute_ratio": 0.125},
    "default": {"full_layers": 4, "recompute_ratio": 0.125},
    "quality": {"full_layers": 2, "recompute_ratio": 0.5},
}
PROFILE_KNOBS = ("full_layers", "recompute_ratio")      # what a profile sets (every profile sets each)


def knob(default: Any, help: str, *, advanced: bool = False, choices: Sequence[Any] | None = None,
         ge: float | None = None, le: float | None = None, parse: Callable[[str], Any] | None = None) -> Any:
    """A config field with what validation, the CLI, the HTTP schema and docs/configuration.md derive
    from it: `help` (one line for --help), `advanced` (listed under "advanced segment reuse"),
    `choices`, inclusive bounds `ge` / `le` (checked by `check_knob` wherever the value comes from;
    `verify` / `__post_init__` add only what no single field declares, such as cross-field rules)
    and `parse` (the CLI's string -> value)."""
    meta = {"help": help, "advanced": advanced, "choices": tuple(choices) if choices else None,
            "ge": ge, "le": le, "parse": parse}
    return dataclasses.field(default=default, metadata=meta)


def knob_field(cls: type, name: str) -> dataclasses.Field:
    """The field `name` of config dataclass `cls`."""
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def knob_meta(f: dataclasses.Field) -> dict[str, Any]:
    """A field's knob metadata; a field declared without `knob` is an undocumented advanced knob."""
    base = {"help": "", "advanced": True, "choices": None, "ge": None, "le": None, "parse": None}
    return {**base, **dict(f.metadata)}


@functools.cache
def _annotations(cls: type) -> dict[str, tuple[tuple[type, ...], bool]]:
    """Per field of `cls`: the members of its annotation's union other than `None` (in order; one
    member if it is no union), and whether `None` is allowed."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        out[name] = (tuple(m for m in members if m is not type(None)), type(None) in members)
    return out


def knob_type(cls: type, f: dataclasses.Field) -> type:
    """The value type of a field: its annotation without `None` (first member of any other union)."""
    return _annotations(cls)[f.name][0][0]


def knob_others(cls: type, f: dataclasses.Field) -> tuple[type, ...]:
    """The other members of a field's annotation besides its value type and `None` (e.g.
    `Literal["auto"]` for recompute_ratio, torch.dtype for dtype)."""
    return _annotations(cls)[f.name][0][1:]


def _is_a(value: Any, kind: type) -> bool:
    """isinstance, where a bool is no number and an int is a float (as in a dataclass annotation);
    for a `Literal[...]`, one of its values."""
    if typing.get_origin(kind) is typing.Literal:
        return isinstance(value, str) and value in typing.get_args(kind)
    if kind is bool:
        return isinstance(value, bool)
    if kind in (int, float):
        number = numbers.Integral if kind is int else numbers.Real
        return isinstance(value, number) and not isinstance(value, bool)
    return isinstance(value, kind)


_KIND_NAMES = {bool: "a bool", int: "an integer", float: "a number", str: "a string"}


def knob_rule(cls: type, f: dataclasses.Field) -> str:
    """What a knob accepts, in the words its ValueError uses: "an integer >= 1", "a number in
    [0.0, 1.0]", "one of ('lru', 'frequency')", "a bool or None", ..."""
    meta = knob_meta(f)
    (kind, *others), optional = _annotations(cls)[f.name]
    if meta["choices"] is not None:
        rule = f"one of {meta['choices']}"
    else:
        rule = _KIND_NAMES.get(kind, f"a {kind.__name__}")
        if meta["ge"] is not None and meta["le"] is not None:
            rule += f" in [{meta['ge']}, {meta['le']}]"
        elif meta["ge"] is not None:
            rule += f" >= {meta['ge']}"
        elif meta["le"] is not None:
            rule += f" <= {meta['le']}"
    rule += "".join(f" or {' or '.join(map(repr, typing.get_args(m)))}" if typing.get_origin(m) is typing.Literal
                    else f" or a {m.__module__}.{m.__qualname__}" for m in others)
    return rule + (" or None" if optional else "")


def check_knob(cls: type, f: dataclasses.Field, value: Any) -> None:
    """`value` against the field's declaration: its type, then its `choices` or `ge` / `le` bounds
    (another member of the annotation's union, like dtype's torch.dtype, is checked by type only).
    ValueError naming the field, the value and what is allowed. A field with none of these declared
    and no bool type (a model name, a path) is left to its own checks."""
    meta = knob_meta(f)
    (kind, *others), optional = _annotations(cls)[f.name]
    if meta["choices"] is None and meta["ge"] is None and meta["le"] is None and kind is not bool:
        return
    if (value is None and optional) or any(_is_a(value, m) for m in others):
        return
    ok = _is_a(value, kind)
    if ok and meta["choices"] is not None:
        ok = value in meta["choices"]
    if ok and meta["ge"] is not None:
        ok = value >= meta["ge"]            # False for nan: outside every bound
    if ok and meta["le"] is not None:
        ok = value <= meta["le"]
    if not ok:
        raise ValueError(f"{f.name} must be {knob_rule(cls, f)}, got {value!r}")


def check_knobs(config: Any) -> None:
    """Every knob of a config dataclass against its declaration (`check_knob`), in field order."""
    for f in dataclasses.fields(config):
        if not f.metadata.get("nested"):
            check_knob(type(config), f, getattr(config, f.name))


def parse_ratio(text: str) -> float | str:
    """A recompute_ratio on the command line: a number, or "auto"."""
    return AUTO if text.strip().lower() == AUTO else float(text)




@dataclass
class ReuseConfig:
    """Segment-reuse knobs: the engine's defaults, each overridable per request (`reuse=`).

    Measurements behind the defaults: docs/benchmarks/defaults.md (the section named in each comment).
    `reuse_profile` sets full_layers and recompute_ratio together (`with_overrides`); the declared
    defaults below are the `default` profile's."""
    reuse_profile: str = knob("default", "a named set of full_layers and recompute_ratio: fast (least compute), "
                                         "default, quality (closest to full prefill); an explicit full_layers or "
                                         "recompute_ratio wins over it", choices=tuple(REUSE_PROFILES))
    # 4 full layers: at 1.3x the compute of 2, half the answer-F1 cost and a lower KL on rag
    # (docs/benchmarks/reuse-quality.md, "RAG answers: where the cost comes from")
    full_layers: int = knob(4, "layers 0..full_layers-1 recompute every token of a reused segment", ge=0)
    # 0.125 with sparse_q's two stages costs what one stage at 0.15 costs, at lower KL
    # (docs/benchmarks/defaults.md, two-stage selection)
    recompute_ratio: float | typing.Literal["auto"] = knob(
        0.125, "share of reused tokens recomputed in the sparse layers (past full_layers); auto = each "
               "request's own share, from how much of its prompt is reused (between "
               "AUTO_RATIO_MIN and AUTO_RATIO_MAX: docs/configuration.md)", ge=0.0, le=1.0, parse=parse_ratio)
    selector: str = knob("sparse_q", "how the tokens to recompute are chosen", choices=SELECTORS)
    boundary_tokens: int = knob(0, "also recompute the first k tokens of each reused segment", advanced=True, ge=0)
    # 0.25 measured below 0.5 and 0 on SmolLM2 and Qwen2.5-Coder rag at equal compute
    # (docs/benchmarks/defaults.md, boundary share)
    boundary_share: float = knob(0.25, "share of sparse_q's budget spent on the first tokens of each reused "
                                       "segment (split evenly); the rest goes by score", advanced=True, ge=0.0, le=1.0)
    min_segment_tokens: int = knob(16, "segments shorter than this are not indexed (too short to be worth it)",
                                   advanced=True, ge=1)
    # a segment computed right after the prompt's start carries that start's attention-sink shape in its
    # keys (docs/benchmarks/defaults.md, early encodings)
    min_context_tokens: int = knob(128, "a segment whose KV was computed starting before this position is "
                                        "reused only before it too; elsewhere it is recomputed and its index "
                                        "entry replaced by that encoding. 0 = reuse every entry anywhere",
                                   advanced=True, ge=0)
    # blending a few short pieces saves little work and costs fidelity (docs/benchmarks/defaults.md, min_blend_tokens)
    min_blend_tokens: int = knob(256, "a request blends only when its segment hits add up to at least this many "
                                      "tokens; below it they are recomputed and the request is served exact. "
                                      "0 = always blend", advanced=True, ge=0)
    approx_prefix: bool = knob(True, "continue an exact prefix hit with blocks an earlier blended request left "
                                     "(approximate KV, as it is); off: blend every reused segment afresh "
                                     "(slower, closer to full prefill)", advanced=True)
    # two-stage selection: the first selection (layer full_layers-1) keeps candidate_ratio of the reused
    # tokens; they run rescore_layers more layers, where a second probe scores them again from fresher,
    # deeper K/V and keeps recompute_ratio for the remaining layers (docs/benchmarks/defaults.md, two-stage selection)
    rescore_layers: int | None = knob(None, "two-stage selection: the first selection's candidates run this many "
                                            "more layers, then are scored again. 0 = one stage; unset = "
                                            f"{AUTO_RESCORE_LAYERS} for sparse_q, one stage otherwise",
                                      advanced=True, ge=0)
    candidate_ratio: float = knob(0.5, "two-stage selection: share of reused tokens the first selection keeps",
                                  advanced=True, ge=0.0, le=1.0)
    # a mean over contexts is nearer any new context than one encoding: on rag it lowers the default's
    # KL by about a third with three encodings (docs/benchmarks/defaults.md, merged encodings)
    merge_encodings: int = knob(4, "when a request computes a segment the index already holds exactly (no "
                                   "blend), the entry becomes the mean of up to this many encodings. "
                                   "1 = keep the first", advanced=True, ge=1)
    transparent_segments: bool = knob(True, "also reuse every run of at least min_segment_tokens tokens found by "
                                            "content anywhere in the prompt (inside indexed segments or the cached "
                                            "KV of earlier requests), not only explicit segments found whole")
    blend: bool = knob(True, "off: the request reuses no segment (computed exactly; exact prefix caching still "
                             "applies) but indexes or merges its segments, as an ingestion pass does",
                       advanced=True)

    def with_overrides(self, overrides: dict[str, Any] | None,
                       profiles: dict[str, dict[str, Any]] | None = None) -> ReuseConfig:
        """This config with `overrides` (ReuseConfig fields by name): a `reuse_profile` among them sets
        that profile's knobs first, then the other overrides apply over it (explicit knobs win).
        `profiles`: the engine's profile table (a calibrated one, sparsex/reuse_profiles.py), else
        REUSE_PROFILES. An unknown name raises ValueError naming it."""
        if not overrides:
            return self
        fields = {f.name for f in dataclasses.fields(ReuseConfig)}
        unknown = set(overrides) - fields
        if unknown:
            raise ValueError(f"unknown segment-reuse option(s) {sorted(unknown)}; known: {sorted(fields)}")
        rest = dict(overrides)
        profile = rest.pop("reuse_profile", None)
        base = self
        if profile is not None:
            check_knob(ReuseConfig, knob_field(ReuseConfig, "reuse_profile"), profile)
            base = dataclasses.replace(self, reuse_profile=profile, **(profiles or REUSE_PROFILES)[profile])
        return dataclasses.replace(base, **rest)

    def for_model(self, num_layers: int, profiles: dict[str, dict[str, Any]] | None = None) -> ReuseConfig:
        """A profile's full_layers fitted to a shallow model: at most half its layers (at least 2, at
        most all), so blending still has sparse layers to save. A full_layers other than the
        profile's (in `profiles`, else REUSE_PROFILES) is the caller's and left as given (`verify`
        names one beyond the model)."""
        profile_layers = (profiles or REUSE_PROFILES)[self.reuse_profile]["full_layers"]
        cap = min(num_layers, max(2, num_layers // 2))
        if self.full_layers == profile_layers and self.full_layers > cap:
            return dataclasses.replace(self, full_layers=cap)
        return self

    def verify(self, num_layers: int | None = None) -> None:
        """Each knob against its declaration (`check_knobs`), then the rules between knobs and the
        model's depth."""
        check_knobs(self)
        if num_layers is not None and self.full_layers > num_layers:
            raise ValueError(f"full_layers={self.full_layers} exceeds the model's {num_layers} layers")
        if self.selector in PROBE_SELECTORS and self.full_layers < 1:
            raise ValueError(f"selector {self.selector!r} scores tokens with a full layer: full_layers must be >= 1")
        if self.rescore_layers:
            if self.selector in QUERY_SELECTORS:
                raise ValueError(f"selector {self.selector!r} selects in one stage (its query mass is fused over the "
                                 f"full layers already): rescore_layers must be 0, got {self.rescore_layers!r}")
            if self.selector not in PROBE_SELECTORS:
                raise ValueError(f"rescore_layers needs a probe selector {PROBE_SELECTORS}, not {self.selector!r}")
            if self.candidate_ratio < self.max_recompute_ratio:
                raise ValueError(f"candidate_ratio {self.candidate_ratio!r} is below recompute_ratio "
                                 f"{self.recompute_ratio!r} (at most {self.max_recompute_ratio!r}): the second "
                                 f"stage keeps a subset of the candidates")
            if num_layers is not None and self.full_layers + self.rescore_layers > num_layers:
                raise ValueError(f"full_layers + rescore_layers = {self.full_layers + self.rescore_layers} "
                                 f"exceeds the model's {num_layers} layers")

    @property
    def max_recompute_ratio(self) -> float:
        """The largest share of reused tokens a request recomputes: recompute_ratio, or with "auto"
        the most the rule gives (segment/recompute_budget.py)."""
        return AUTO_RATIO_MAX if self.recompute_ratio == AUTO else self.recompute_ratio

    @property
    def kv_key(self) -> tuple:
        """Every knob the KV of a blend depends on (all but `approx_prefix`, which only says whether
        the approximate prefix chain is read and written, and `merge_encodings` / `blend`, which
        decide what the index keeps and whether a request blends at all): that chain's key
        (cache/block_hash.py), so a request never continues KV blended under other knobs, e.g. with
        fewer recomputed tokens. Numbers are floats here, so recompute_ratio=0 and 0.0 name the same chain."""
        def norm(v):
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        return tuple((f.name, norm(getattr(self, f.name))) for f in dataclasses.fields(self) if f.name not in _NOT_IN_KV_KEY)

    def resolved(self, num_layers: int) -> ReuseConfig:
        """This config with `rescore_layers=None` made explicit: AUTO_RESCORE_LAYERS for sparse_q when
        its candidates outnumber what it keeps (candidate_ratio > recompute_ratio) and the model has the
        layers for it; 0 (one stage) otherwise, e.g. recompute_ratio=1.0 or selector="boundary"."""
        if self.rescore_layers is not None:
            return self
        two_stage = (self.selector == "sparse_q" and self.candidate_ratio > self.max_recompute_ratio
                     and self.full_layers + AUTO_RESCORE_LAYERS <= num_layers)
        return dataclasses.replace(self, rescore_layers=AUTO_RESCORE_LAYERS if two_stage else 0)


@dataclass
class EngineConfig:
    """Every knob of `LLM(...)` and `sparsex serve`: the engine's fields here, the segment-reuse ones
    in `reuse` (ReuseConfig). `from_knobs` builds one from flat keyword arguments."""
    model: str = knob("smollm2-135m-instruct", "model name, .gguf file, HF model directory or dummy:<shape>")
    cache: str = knob("sparsex", "KV reuse: none, prefix (exact prefix caching), sparsex (prefix caching + "
                                 "segment reuse)", choices=CACHE_MODES)
    dtype: str | torch.dtype = knob("auto", "weights and KV dtype; auto = bfloat16 on a GPU and on a CPU with "
                                            "native bf16 GEMMs, else float32", choices=DTYPES)
    device: str = knob("cpu", "cpu | cuda | cuda:N")
    seed: int = knob(0, "seed of the model's random state (dummy weights, random selector)")
    num_blocks: int | None = knob(None, "KV pool size in blocks (overrides kv_cache_memory)", ge=1)
    kv_cache_memory: int = knob(1 << 30, "bytes for the KV pool when num_blocks is not given (CLI: 512M, 2G, ...)",
                                ge=1, parse=parse_bytes)
    max_model_len: int | None = knob(None, "longest prompt + completion in tokens; unset = the model's context "
                                           "length", ge=2)
    max_num_batched_tokens: int = knob(8192, "tokens one engine step computes at most", ge=1)
    max_num_seqs: int = knob(64, "requests running at once at most", ge=1)
    block_size: int = knob(16, "tokens per KV block (the granularity of prefix caching)", choices=BLOCK_SIZES)
    # start-up requests compile kernels and capture graphs (sparsex/engine/warmup.py)
    warmup: bool | None = knob(None, "run a few small requests at start-up so the first real one compiles "
                                     "nothing; unset = on for CUDA, off for the CPU")
    enforce_eager: bool = knob(False, "run decode steps eagerly on CUDA: they replay CUDA graphs unless set")
    cache_dir: str | None = knob(None, "where converted models are cached (unset = $SPARSEX_CACHE_DIR or the "
                                       "user cache)")
    segment_eviction: str = knob("frequency", "which segment-index entries go first when the KV pool is full: "
                                              "frequency (GreedyDual-Size-Frequency) or lru",
                                 advanced=True, choices=SEGMENT_EVICTION)
    # tiers below the device for segment entries (sparsex/kvstore/)
    segment_store: str | None = knob(None, "a store of segment KV shared by replicas: redis://[user:password@]"
                                           "host:port/db, or mooncake://master:port?metadata=http://host:port/"
                                           "metadata&protocol=tcp with segment_index (cache=sparsex; docs/deploy.md)")
    segment_index: str | None = knob(None, "the Redis index of a mooncake:// segment_store: redis://[user:password@]"
                                           "host:port/db")
    segment_store_spans: bool = knob(False, "share spans found by content between replicas: the shared store also "
                                            "gets the stretches this replica reuses by content (what recurs) and "
                                            "every published record's content anchors (in Redis), and a prompt's "
                                            "stretches no local source serves are looked up there, fetched and "
                                            "verified token by token (needs segment_store; docs/deploy.md)")
    host_kv_cache_memory: int = knob(0, "bytes of host memory that keep segment entries evicted from the KV pool "
                                        "(0 = none; CLI: 512M, 2G, ...)", ge=0, parse=parse_bytes)
    segment_store_fetch: str = knob("auto", "when to fetch a span from the shared store: auto (when cheaper "
                                            "than recomputing it, as measured), always, never",
                                    advanced=True, choices=STORE_FETCH_MODES)
    # sparsex/engine/tp_executor.py; docs/architecture.md, "Tensor parallelism"
    tensor_parallel_size: int = knob(1, "ranks the model is split over (one process per rank; NCCL on CUDA, "
                                        "gloo on the CPU): heads, MLP columns and vocabulary divided between them",
                                     ge=1)
    tp_timeout: float = knob(120.0, "seconds a tensor-parallel collective waits for a rank before the engine "
                                    "reports the rank lost and stops", advanced=True, ge=1.0)
    # sparsex/engine/quality_monitor.py; docs/server.md, "Live quality monitor"
    quality_sample: float = knob(0.0, "share of blended requests whose served answer is scored against full "
                                      "prefill (teacher-forced KL, top-1) in idle capacity only; 0 = off",
                                 ge=0.0, le=1.0)
    quality_target: float | None = knob(None, "with quality_sample: move recompute_ratio between 0.0625 and 0.5 "
                                              "so the monitored KL (nats) stays at most this; unset = a fixed ratio")
    reuse: ReuseConfig | None = dataclasses.field(default=None, metadata={"nested": True})

    @classmethod
    def from_knobs(cls, **knobs: Any) -> EngineConfig:
        """EngineConfig(..., reuse=ReuseConfig(...)) from flat keyword arguments: every EngineConfig
        field and every ReuseConfig field by name. An unknown name raises TypeError naming it."""
        engine, reuse = engine_knob_names(), reuse_knob_names()
        unknown = sorted(set(knobs) - set(engine) - set(reuse) - {"reuse"})
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid: {sorted(engine + reuse)}")
        base = knobs.get("reuse") or ReuseConfig()
        if not isinstance(base, ReuseConfig):
            raise TypeError(f"reuse must be a ReuseConfig, got {type(base).__name__}")
        flat = {k: v for k, v in knobs.items() if k in reuse}
        return cls(**{k: v for k, v in knobs.items() if k in engine}, reuse=base.with_overrides(flat))

    def __post_init__(self) -> None:
        if self.reuse is None:
            self.reuse = ReuseConfig()
        check_knobs(self)
        self.torch_dtype = parse_dtype(self.dtype, self.device)
        # what no field's bounds or choices express: formats, and rules between fields
        verify_device(self.device)
        self._verify_store_urls()
        if self.quality_sample and self.cache != "sparsex":
            raise ValueError(f"quality_sample scores segment reuse: it needs cache='sparsex', got cache={self.cache!r}")
        if self.quality_target is not None:
            q = self.quality_target         # > 0, which no inclusive bound declares
            if isinstance(q, bool) or not isinstance(q, (int, float)) or not q > 0:
                raise ValueError(f"quality_target must be a KL > 0 (nats), got {self.quality_target!r}")
            if not self.quality_sample:
                raise ValueError("quality_target follows the quality monitor's scores: it needs quality_sample > 0")
            if self.reuse is not None and self.reuse.recompute_ratio == AUTO:
                raise ValueError("quality_target moves a fixed recompute_ratio; it cannot be combined with "
                                 "recompute_ratio='auto'")
        if self.segment_store_spans and self.segment_store is None:
            raise ValueError("segment_store_spans shares spans through the shared store: it needs segment_store")
        if (self.segment_store is not None or self.host_kv_cache_memory) and self.cache != "sparsex":
            raise ValueError(f"segment_store / host_kv_cache_memory hold segment entries: they need cache='sparsex', "
                             f"got cache={self.cache!r}")
        if self.tensor_parallel_size > 1:
            self._verify_tensor_parallel()
        self.reuse.verify()

    def _verify_tensor_parallel(self) -> None:
        """What tensor parallelism does not cover: a shared store would need every rank's shard written
        and fetched under one key, all or none (the host tier follows rank 0's moves on every rank)."""
        if self.segment_store is not None:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} does not support segment_store: "
                             f"a shared record holds one rank's KV, not every rank's shard")
        if self.device.startswith("cuda:"):
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} places rank r on cuda:r: give "
                             f"device='cuda', got {self.device!r}")

    def _verify_store_urls(self) -> None:
        """segment_store: redis:// or rediss://, or mooncake:// with a redis:// segment_index (each url
        parsed: a ValueError names the bad one)."""
        store, index = self.segment_store, self.segment_index
        if store is not None and (not isinstance(store, str) or not store.startswith(("redis://", "rediss://", "mooncake://"))):
            raise ValueError(f"segment_store must be a redis://, rediss:// or mooncake:// URL, got {store!r}")
        if index is not None and not isinstance(index, str):
            raise ValueError(f"segment_index must be a redis:// or rediss:// URL, got {index!r}")
        if isinstance(store, str) and store.startswith("mooncake://"):
            parse_mooncake_url(store)
            if index is None:
                raise ValueError(f"segment_store {store!r} keeps its payloads in Mooncake and its index in Redis: "
                                 f"it needs segment_index=redis://host:port/db")
        elif index is not None:
            raise ValueError(f"segment_index {index!r} is the index of a mooncake:// segment_store, got "
                             f"segment_store={store!r}")
        if index is not None:
            parse_redis_url(index)

    @property
    def warmup_enabled(self) -> bool:
        return self.device != "cpu" if self.warmup is None else self.warmup

    @property
    def enable_prefix_caching(self) -> bool:
        return self.cache in ("prefix", "sparsex")

    @property
    def enable_segment_reuse(self) -> bool:
        return self.cache == "sparsex"


def engine_knob_names() -> list[str]:
    """EngineConfig's own knobs (all fields but the nested `reuse`)."""
    return [f.name for f in dataclasses.fields(EngineConfig) if not f.metadata.get("nested")]


def reuse_knob_names() -> list[str]:
    return [f.name for f in dataclasses.fields(ReuseConfig)]
