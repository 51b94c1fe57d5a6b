"""`sparsex bench workload` configuration: the workload's size, the replay's options, the stream's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparsex.config import SEGMENT_EVICTION, EngineConfig

WORKLOADS = ("rag", "chat", "agent")
EVICTIONS = SEGMENT_EVICTION       # the stream runs each, in this order
# KV pool per engine when --num-blocks is not given and the whole workload would need more: 7.4 GB of
# fp32 KV for SmolLM2-135M (timed engine + fidelity twin: 15 GB), the pool of the rag headline in
# docs/benchmarks.md (whose workload would occupy 27,758 blocks: the prefix cache evicts, no segment
# entry does)
MAX_AUTO_BLOCKS = 10000


@dataclass
class WorkloadParams:
    """Size of the generated workload (`sparsex.bench.workloads`); only the chosen kind's fields apply.

    The rag defaults are the headline configuration of docs/benchmarks.md (96 queries of 8 passages;
    with `WorkloadBenchConfig`'s defaults: prewarm with 3 passes; it ran in float32); chat and agent default to
    small runs (4 users x 4 turns; 4 agent sessions) that show their reuse patterns in minutes."""
    queries: int = 96                    # rag
    k: int = 8                           # rag: passages per query
    num_passages: int = 60               # rag: corpus size (Zipf popularity over it)
    passage_tokens: tuple[int, int] = (300, 500)   # rag: passage length bounds
    users: int = 4                       # chat
    turns: int = 4                       # chat: turns per user
    context_budget: int = 1024           # chat: prompt token budget (oldest exchanges dropped)
    num_topics: int = 200                # chat: topic pool (Zipf popularity over it)
    sessions: int = 4                    # agent
    results_per_call: int = 3            # agent: search results per tool call
    num_docs: int = 300                  # agent: search-result corpus
    tool_apis: tuple[str, ...] = ("web_search", "math_api")   # agent: BFCL apis in the system prompt
    zipf_a: float = 1.1
    seed: int = 0


@dataclass
class WorkloadBenchConfig:
    workload: str = "rag"
    policies: str = ",".join(("none", "prefix", "naive", "epic16", "epic32", "cacheblend", "sparsex"))
    sweep: bool = False
    model: str = EngineConfig.model
    dtype: str = EngineConfig.dtype
    device: str = EngineConfig.device    # "cuda": replay on a GPU (fidelity at scale; its TTFT is not the CPU's)
    params: WorkloadParams = field(default_factory=WorkloadParams)
    # how the application lays out the prompt (sparsex.bench.prompt_forms): "explicit" sends each unit
    # as a segment; "stuffed", "question-first", "llamaindex" (rag, agent) send the units joined into
    # one message through the chat path, as unchanged LangChain / LlamaIndex clients do
    prompt_form: str = "explicit"
    # teacher-forced continuation: the reference's greedy tokens up to its EOS (included: stopping is a
    # decision too), at most this many. A served request ends at EOS, so what follows it is never seen:
    # `fidelity_past_eos` scores those positions too (template tokens, nearly always agreed on: they
    # dilute the misses)
    fidelity_tokens: int = 32
    fidelity_past_eos: bool = False
    fidelity_every: int = 1              # fidelity on requests 0, N, 2N, ...; 0 = no fidelity
    answer_tokens: int = 32              # rag: greedy answer length cap (EOS stops it earlier)
    num_blocks: int | None = None        # KV pool per engine; default: the whole workload, at most MAX_AUTO_BLOCKS
    # rag: before each policy's replay, prefill every passage the workload uses once (after the system
    # head), untimed, as a service that ingests its corpus ahead of queries: the steady state.
    # None: on for rag, off for chat and agent (which have no corpus to ingest)
    prewarm: bool | None = None
    # rag prewarm: ingest the corpus this many times, each pass after the first in another random
    # grouping and order, sent with reuse blend=False so the engine merges each passage's encodings
    # (ReuseConfig.merge_encodings; docs/benchmarks/defaults.md: one, two and three encodings per passage)
    prewarm_passes: int = 3
    out: str = "workload_bench_out"
    plot_dir: str | None = None          # PNG plots here (matplotlib); None: no plots
    progress: bool = True

    def __post_init__(self) -> None:
        if self.prewarm is None:
            self.prewarm = self.workload == "rag"

    def verify(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"unknown workload {self.workload!r}; choose one of {WORKLOADS}")
        from sparsex.bench.prompt_forms import verify_prompt_form
        from sparsex.config import verify_device
        verify_prompt_form(self.prompt_form, self.workload)
        verify_device(self.device)           # CUDA's presence is checked by the first engine, before it loads
        _positive("fidelity_tokens", self.fidelity_tokens)
        _positive("answer_tokens", self.answer_tokens)
        if not isinstance(self.fidelity_every, int) or self.fidelity_every < 0:
            raise ValueError(f"fidelity_every must be an integer >= 0, got {self.fidelity_every!r}")
        if self.num_blocks is not None:
            _positive("num_blocks", self.num_blocks)
        if self.prewarm and self.workload != "rag":
            raise ValueError(f"prewarm ingests the rag corpus; got workload {self.workload!r}")
        _positive("prewarm_passes", self.prewarm_passes)
        p = self.params
        for name in ("queries", "k", "num_passages", "users", "turns", "context_budget", "num_topics", "sessions",
                     "results_per_call", "num_docs"):
            _positive(name, getattr(p, name))
        lo, hi = p.passage_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"passage_tokens must be MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")
        if not p.zipf_a >= 0:
            raise ValueError(f"zipf_a must be >= 0, got {p.zipf_a!r}")
        _verify_plot_dir(self.plot_dir)


@dataclass
class StreamConfig:
    model: str = EngineConfig.model
    dtype: str = EngineConfig.dtype
    queries: int = 500
    k: int = 2
    num_passages: int = 200
    passage_tokens: tuple[int, int] = (150, 250)
    zipf_a: float = 1.1
    seed: int = 0
    kv_fraction: float = 0.25            # KV pool = this share of the corpus' tokens
    window: int = 50
    evictions: tuple[str, ...] = EVICTIONS
    max_tokens: int = 1
    out: str = "workload_bench_out"
    plot_dir: str | None = None          # PNG plot here (matplotlib); None: no plot
    progress: bool = True

    def verify(self) -> None:
        for name in ("queries", "k", "num_passages", "window", "max_tokens"):
            _positive(name, getattr(self, name))
        if not 0 < self.kv_fraction <= 1:
            raise ValueError(f"kv_fraction must be in (0, 1], got {self.kv_fraction!r}")
        if not self.evictions or any(e not in EVICTIONS for e in self.evictions):
            raise ValueError(f"evictions must be a non-empty subset of {EVICTIONS}, got {self.evictions!r}")
        if len(set(self.evictions)) != len(self.evictions):
            raise ValueError(f"evictions lists a policy twice: {self.evictions!r}")
        lo, hi = self.passage_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"passage_tokens must be MIN:MAX with 1 <= MIN <= MAX, got {lo}:{hi}")
        _verify_plot_dir(self.plot_dir)


def _verify_plot_dir(plot_dir: str | None) -> None:
    if plot_dir is not None:
        from sparsex.bench.pyplot import require_matplotlib
        require_matplotlib()


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
