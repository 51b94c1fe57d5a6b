"""Engine configuration: every knob of `LLM(...)` / `sparsex serve`, validated up front."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

CACHE_MODES = ("none", "prefix", "sparsex")
SELECTORS = ("sparse_q", "kv_deviation", "boundary", "random", "none", "all")
PROBE_SELECTORS = ("kv_deviation", "sparse_q")     # score tokens with a probe on a full layer
AUTO_RESCORE_LAYERS = 2     # sparse_q's second probe, this many layers below its first (ReuseConfig.resolved)
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


_NOT_IN_KV_KEY = ("approx_prefix", "merge_encodings", "blend")


@dataclass
class ReuseConfig:
    """Segment-reuse knobs (engine defaults; each can be overridden per request)."""
    full_layers: int = 2                 # layers 0..full_layers-1 run every token
    # share of reused tokens recomputed in the sparse layers. 0.125 with sparse_q's two stages (below)
    # costs what one stage at 0.15 cost (token-layers and the H200's 8k step) at lower KL:
    # docs/benchmarks.md, "fifteenth session"
    recompute_ratio: float = 0.125
    selector: str = "sparse_q"
    boundary_tokens: int = 0             # also recompute the first k tokens of each reused segment
    # sparse_q spends this share of its budget on the first tokens of each reused segment (split
    # evenly), the rest by score. 0.25 was measured below 0.5 (the earlier default) and 0 on SmolLM2
    # and Qwen2.5-Coder rag at equal compute: docs/benchmarks.md, "boundary share".
    boundary_share: float = 0.25
    min_segment_tokens: int = 16         # shorter pieces are not worth indexing
    # a segment whose KV was computed starting before this position (with only the prompt's start
    # before it: its keys carry that start's attention-sink shape) is reused only at a position
    # before it too; later in a prompt it is recomputed, and its index entry replaced by that
    # encoding. 0 = reuse every entry anywhere. docs/benchmarks.md, "early encodings".
    min_context_tokens: int = 128
    # a request blends only when its segment hits add up to at least this many tokens; below it the
    # hits are recomputed (exact prefix caching alone serves the request): blending a few short
    # pieces saves little work and costs fidelity (docs/benchmarks.md, "min_blend_tokens"). 0 = always.
    min_blend_tokens: int = 256
    # continue an exact prefix hit with blocks an earlier blended request left behind (its KV as it
    # is: approximate); off = blend every reused segment afresh (what fidelity evaluation needs)
    approx_prefix: bool = True
    # two-stage selection: the first selection (layer F-1) keeps `candidate_ratio` of the reused
    # tokens as candidates; they run `rescore_layers` more layers, where a second probe scores them
    # again (from fresher, deeper K/V) and keeps `recompute_ratio` for the remaining layers.
    # 0 = one stage. None (the default) = AUTO_RESCORE_LAYERS for sparse_q where two stages apply
    # (`resolved`), one stage for every other selector. docs/benchmarks.md, "two-stage selection".
    rescore_layers: int | None = None
    candidate_ratio: float = 0.5
    # merged encodings: when a request computes exactly (no blend) a segment the index already holds,
    # the entry becomes the mean of up to this many encodings (keys re-rotated to one position). A
    # mean over contexts is nearer any new context than one encoding: on rag, deep-layer K/V deviation
    # falls by a third with two, and with three the default's KL by 32% (docs/benchmarks.md,
    # "nineteenth session"). 1 = keep the first encoding.
    merge_encodings: int = 4
    # False: this request reuses no segment (computed exactly; exact prefix caching still applies) but
    # indexes its segments, or merges them into the entries: what a corpus ingestion pass sends
    blend: bool = True

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
    model: str = "smollm2-135m-instruct"
    dtype: str | torch.dtype = "float32"  # or "auto": bfloat16 where it runs natively (config.parse_dtype)
    device: str = "cpu"
    cache: str = "prefix"                # "none" | "prefix" | "sparsex"
    seed: int = 0
    block_size: int = 16
    num_blocks: int | None = None        # explicit pool size; else sized from kv_cache_memory
    kv_cache_memory: int = 1 << 30       # bytes for the KV pool when num_blocks is not given
    max_model_len: int | None = None     # default: the model's max_position_embeddings
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    segment_eviction: str = "frequency"  # "frequency" (GreedyDual-Size-Frequency) | "lru"
    reuse: ReuseConfig | None = None
    cache_dir: str | None = None
    # run a few small requests at start-up so the first real one does not compile kernels or
    # capture graphs (sparsex/engine/warmup.py); None = on for CUDA, off for the CPU
    warmup: bool | None = None

    def __post_init__(self) -> None:
        self.torch_dtype = parse_dtype(self.dtype, self.device)
        if self.reuse is None:
            self.reuse = ReuseConfig()
        if self.cache not in CACHE_MODES:
            raise ValueError(f"unknown cache mode {self.cache!r}; choose one of {CACHE_MODES}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks!r}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs!r}")
        if self.segment_eviction not in ("lru", "frequency"):
            raise ValueError(f"segment_eviction must be 'lru' or 'frequency', got {self.segment_eviction!r}")
        verify_device(self.device)
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
