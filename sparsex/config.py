"""Engine configuration: every knob of `LLM(...)` / `sparsex serve`, validated up front."""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

CACHE_MODES = ("none", "prefix", "sparsex")
SELECTORS = ("sparse_q", "kv_deviation", "boundary", "random", "none", "all")
PROBE_SELECTORS = ("kv_deviation", "sparse_q")     # score tokens with a probe on a full layer
AUTO_RESCORE_LAYERS = 2     # sparse_q's second probe, this many layers below its first (ReuseConfig.resolved)
DTYPES = ("auto", "float32", "bfloat16", "float16")    # what the CLI offers; parse_dtype also takes fp32, ...
SEGMENT_EVICTION = ("frequency", "lru")
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


_NOT_IN_KV_KEY = ("approx_prefix", "merge_encodings", "blend", "transparent_segments")


STORE_FETCH_MODES = ("auto", "always", "never")


def knob(default: Any, help: str, *, advanced: bool = False, choices: Sequence[Any] | None = None,
         ge: float | None = None, le: float | None = None, parse: Callable[[str], Any] | None = None) -> Any:
    """A config field with what the CLI, the HTTP schema and docs/configuration.md derive from it:
    `help` (one line for --help), `advanced` (listed under "advanced segment reuse"), `choices`,
    inclusive bounds `ge` / `le` (CLI argument check and HTTP schema; `verify` / `__post_init__`
    stay the authority, including cross-field rules) and `parse` (the CLI's string -> value)."""
    meta = {"help": help, "advanced": advanced, "choices": tuple(choices) if choices else None,
            "ge": ge, "le": le, "parse": parse}
    return dataclasses.field(default=default, metadata=meta)


def knob_meta(f: dataclasses.Field) -> dict[str, Any]:
    """A field's knob metadata; a field declared without `knob` is an undocumented advanced knob."""
    base = {"help": "", "advanced": True, "choices": None, "ge": None, "le": None, "parse": None}
    return {**base, **dict(f.metadata)}


def knob_type(cls: type, f: dataclasses.Field) -> type:
    """The value type of a field: its annotation without `None` (first member of any other union)."""
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1.5GiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 1073741824, 512M, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass
class ReuseConfig:
    """Segment-reuse knobs: the engine's defaults, each overridable per request (`reuse=`).

    Measurements behind the defaults: docs/benchmarks/defaults.md (the section named in each comment)."""
    full_layers: int = knob(2, "layers 0..full_layers-1 recompute every token of a reused segment", ge=0)
    # 0.125 with sparse_q's two stages costs what one stage at 0.15 costs, at lower KL
    # (docs/benchmarks/defaults.md, two-stage selection)
    recompute_ratio: float = knob(0.125, "share of reused tokens recomputed in the sparse layers "
                                         "(past full_layers)", ge=0.0, le=1.0)
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

    def verify(self, num_layers: int | None = None) -> None:
        if self.selector not in SELECTORS:
            raise ValueError(f"unknown selector {self.selector!r}; choose one of {SELECTORS}")
        if not isinstance(self.full_layers, int) or self.full_layers < 0:
            raise ValueError(f"full_layers must be an integer >= 0, got {self.full_layers!r}")
        if num_layers is not None and self.full_layers > num_layers:
            raise ValueError(f"full_layers={self.full_layers} exceeds the model's {num_layers} layers")
        if not isinstance(self.recompute_ratio, (int, float)) or not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio!r}")
        if not isinstance(self.boundary_tokens, int) or self.boundary_tokens < 0:
            raise ValueError(f"boundary_tokens must be an integer >= 0, got {self.boundary_tokens!r}")
        if not isinstance(self.boundary_share, (int, float)) or not 0.0 <= self.boundary_share <= 1.0:
            raise ValueError(f"boundary_share must be in [0, 1], got {self.boundary_share!r}")
        if not isinstance(self.min_segment_tokens, int) or self.min_segment_tokens < 1:
            raise ValueError(f"min_segment_tokens must be an integer >= 1, got {self.min_segment_tokens!r}")
        if not isinstance(self.min_context_tokens, int) or self.min_context_tokens < 0:
            raise ValueError(f"min_context_tokens must be an integer >= 0, got {self.min_context_tokens!r}")
        if not isinstance(self.min_blend_tokens, int) or self.min_blend_tokens < 0:
            raise ValueError(f"min_blend_tokens must be an integer >= 0, got {self.min_blend_tokens!r}")
        if not isinstance(self.approx_prefix, bool):
            raise ValueError(f"approx_prefix must be a bool, got {self.approx_prefix!r}")
        if not isinstance(self.merge_encodings, int) or isinstance(self.merge_encodings, bool) or self.merge_encodings < 1:
            raise ValueError(f"merge_encodings must be an integer >= 1, got {self.merge_encodings!r}")
        if not isinstance(self.transparent_segments, bool):
            raise ValueError(f"transparent_segments must be a bool, got {self.transparent_segments!r}")
        if not isinstance(self.blend, bool):
            raise ValueError(f"blend must be a bool, got {self.blend!r}")
        if self.selector in PROBE_SELECTORS and self.full_layers < 1:
            raise ValueError(f"selector {self.selector!r} scores tokens with a full layer: full_layers must be >= 1")
        if self.rescore_layers is not None and (not isinstance(self.rescore_layers, int) or self.rescore_layers < 0):
            raise ValueError(f"rescore_layers must be an integer >= 0 or None (auto), got {self.rescore_layers!r}")
        if not isinstance(self.candidate_ratio, (int, float)) or not 0.0 <= self.candidate_ratio <= 1.0:
            raise ValueError(f"candidate_ratio must be in [0, 1], got {self.candidate_ratio!r}")
        if self.rescore_layers:
            if self.selector not in PROBE_SELECTORS:
                raise ValueError(f"rescore_layers needs a probe selector {PROBE_SELECTORS}, not {self.selector!r}")
            if self.candidate_ratio < self.recompute_ratio:
                raise ValueError(f"candidate_ratio {self.candidate_ratio!r} is below recompute_ratio "
                                 f"{self.recompute_ratio!r}: the second stage keeps a subset of the candidates")
            if num_layers is not None and self.full_layers + self.rescore_layers > num_layers:
                raise ValueError(f"full_layers + rescore_layers = {self.full_layers + self.rescore_layers} "
                                 f"exceeds the model's {num_layers} layers")

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
        two_stage = (self.selector == "sparse_q" and self.candidate_ratio > self.recompute_ratio
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
    cache_dir: str | None = knob(None, "where converted models are cached (unset = $SPARSEX_CACHE_DIR or the "
                                       "user cache)")
    segment_eviction: str = knob("frequency", "which segment-index entries go first when the KV pool is full: "
                                              "frequency (GreedyDual-Size-Frequency) or lru",
                                 advanced=True, choices=SEGMENT_EVICTION)
    # tiers below the device for segment entries (sparsex/kvstore/)
    segment_store: str | None = knob(None, "a store of segment KV shared by replicas: redis://[user:password@]"
                                           "host:port/db (cache=sparsex; docs/deploy.md)")
    host_kv_cache_memory: int = knob(0, "bytes of host memory that keep segment entries evicted from the KV pool "
                                        "(0 = none; CLI: 512M, 2G, ...)", ge=0, parse=parse_bytes)
    segment_store_fetch: str = knob("auto", "when to fetch a span from the shared store: auto (when cheaper "
                                            "than recomputing it, as measured), always, never",
                                    advanced=True, choices=STORE_FETCH_MODES)
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
        return cls(**{k: v for k, v in knobs.items() if k in engine}, reuse=dataclasses.replace(base, **flat))

    def __post_init__(self) -> None:
        self.torch_dtype = parse_dtype(self.dtype, self.device)
        if self.reuse is None:
            self.reuse = ReuseConfig()
        if self.cache not in CACHE_MODES:
            raise ValueError(f"unknown cache mode {self.cache!r}; choose one of {CACHE_MODES}")
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {self.block_size!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks!r}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.segment_eviction not in SEGMENT_EVICTION:
            raise ValueError(f"segment_eviction must be 'lru' or 'frequency', got {self.segment_eviction!r}")
        verify_device(self.device)
        if self.segment_store is not None:
            if not isinstance(self.segment_store, str) or not self.segment_store.startswith(("redis://", "rediss://")):
                raise ValueError(f"segment_store must be a redis:// or rediss:// URL, got {self.segment_store!r}")
        if (self.segment_store is not None or self.host_kv_cache_memory) and self.cache != "sparsex":
            raise ValueError(f"segment_store / host_kv_cache_memory hold segment entries: they need cache='sparsex', "
                             f"got cache={self.cache!r}")
        if not isinstance(self.host_kv_cache_memory, int) or self.host_kv_cache_memory < 0:
            raise ValueError(f"host_kv_cache_memory must be >= 0 bytes, got {self.host_kv_cache_memory!r}")
        if self.segment_store_fetch not in STORE_FETCH_MODES:
            raise ValueError(f"segment_store_fetch must be one of {STORE_FETCH_MODES}, got {self.segment_store_fetch!r}")
        if self.warmup not in (None, True, False):
            raise ValueError(f"warmup must be True, False or None (on for CUDA), got {self.warmup!r}")
        self.reuse.verify()

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
