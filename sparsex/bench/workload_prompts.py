"""The workload's requests as token ids, and the rag corpus-ingestion prompts (`--prewarm`)."""
from __future__ import annotations

import random

import numpy as np
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from sparsex.bench.flop_model import FlopModel
from sparsex.bench.workload_config import WorkloadBenchConfig

if TYPE_CHECKING:
    from sparsex.bench.engine_cache import EngineCache
    from sparsex.bench.workloads import Request
    from sparsex.engine.llm_engine import LLMEngine
    from sparsex.inputs import TokenizedPrompt


def ingestion_preamble(cfg: WorkloadBenchConfig, tokenizer: Any, used: set[str]) -> str:
    """rag --prewarm: the text that opens every ingestion prompt: wiki passages from past the
    workload's corpus that no query uses, at least `ReuseConfig.min_context_tokens` tokens of them."""
    from sparsex.bench import workloads
    from sparsex.config import ReuseConfig
    p = cfg.params
    need = ReuseConfig().min_context_tokens
    extra = workloads.build_passages(tokenizer, p.num_passages + 8, *p.passage_tokens)[p.num_passages:]
    body = ""
    for x in extra:
        text = x.text + workloads._PASSAGE_SEP
        if text not in used:
            body += text
            if len(tokenizer.encode(body, add_special_tokens=False)) >= need:
                break
    return body


def build_workload(cfg: WorkloadBenchConfig, tokenizer: Any) -> list[Request]:
    from sparsex.bench.prompt_forms import apply_form
    return apply_form(_build(cfg, tokenizer), cfg.prompt_form)


def _build(cfg: WorkloadBenchConfig, tokenizer: Any) -> list[Request]:
    from sparsex.bench import workloads
    p = cfg.params
    if cfg.workload == "rag":
        return workloads.rag_workload(tokenizer, num_queries=p.queries, k=p.k, num_passages=p.num_passages,
                                      zipf_a=p.zipf_a, seed=p.seed, min_passage_tokens=p.passage_tokens[0],
                                      max_passage_tokens=p.passage_tokens[1])
    if cfg.workload == "chat":
        return workloads.chat_workload(tokenizer, num_users=p.users, turns_per_user=p.turns,
                                       context_budget=p.context_budget, num_topics=p.num_topics, zipf_a=p.zipf_a,
                                       seed=p.seed)
    return workloads.agent_workload(tokenizer, num_sessions=p.sessions, tool_apis=p.tool_apis,
                                    results_per_call=p.results_per_call, num_docs=p.num_docs, zipf_a=p.zipf_a,
                                    seed=p.seed)


@dataclass
class TokenizedWorkload:
    requests: list[Request]
    prompts: list[TokenizedPrompt]
    flops: FlopModel
    block_size: int
    tokenizer: Any
    warm_prompts: list[TokenizedPrompt] = field(default_factory=list)   # rag prewarm: head + k passages
    # rag prewarm, passes 2..: the same passages in other groups and orders (computed exactly, merged)
    rewarm_prompts: list[TokenizedPrompt] = field(default_factory=list)
    # per request, its tokens inside a unit (rag passage, agent search result) that the ingestion or
    # an earlier request already held (sparsex.bench.prompt_forms.recurring_masks)  # each [num_tokens] bool
    recurring: list[np.ndarray] = field(default_factory=list)


def tokenized_workload(engines: EngineCache, make: Callable[[Any], list[Request]], prewarm: bool = False,
                        make_preamble: Callable[[Any, set[str]], str] | None = None, prewarm_passes: int = 1,
                        seed: int = 0) -> TokenizedWorkload:
    """The workload built with a one-block engine's tokenizer: only the tokenizer and the model's
    shape are needed, and the KV pools are sized from the prompts."""
    from sparsex.bench.fidelity import pieces_prompt
    from sparsex.bench.prompt_forms import form_prompt, recurring_masks
    probe = engines.take("none", "timed", 1, warm=False)
    requests = make(probe.tokenizer)
    formed = [form_prompt(probe.tokenizer, probe.model_config.vocab_size, r) for r in requests]
    prompts = [f[0] for f in formed]
    warm, rewarm = [], []
    if prewarm:
        # rag: segments = [system head, k passages, question]. Every distinct passage once, k to a prompt
        # in first-use order, so each one's KV is computed after other passages, as in a query: KV of a
        # passage encoded alone after the system head was measured to make every reuse policy far worse
        # (docs/benchmarks/defaults.md, early encodings). Each ingestion prompt opens with a preamble, a passage
        # from outside the workload's corpus, so that no passage is computed right after the head
        # (the engine would not reuse such an early encoding later in a prompt: min_context_tokens)
        passages = list(dict.fromkeys(p for r in requests for p in r.segments[1:-1]))
        head, k = requests[0].segments[0], max(1, len(requests[0].segments) - 2)
        preamble = make_preamble(probe.tokenizer, set(passages)) if make_preamble is not None else None
        lead = [preamble] if preamble is not None else []
        # passes after the first: each passage again after other passages, a seeded shuffle per pass,
        # so the engine can merge its encodings over several contexts
        rng = random.Random(seed)
        for p in range(prewarm_passes):
            order = passages if p == 0 else rng.sample(passages, len(passages))
            for i in range(0, len(order), k):
                chunk = order[i:i + k]
                (warm if p == 0 else rewarm).append(pieces_prompt(
                    probe, [head, *lead, *chunk, "\n"], [True] + [False] * len(lead) + [True] * (len(chunk) + 1)))
    # the ingestion held every rag passage (the warm prompts send the explicit pieces, whatever the form)
    ingested = {u for r in requests for u in r.passages} if prewarm else set()
    recurring = recurring_masks(requests, [f[2] for f in formed], [f[1] for f in formed], ingested)
    return TokenizedWorkload(requests, prompts, FlopModel.from_config(probe.model_config),
                             probe.config.block_size, probe.tokenizer, warm, rewarm, recurring)


def ingest_corpus(engine: LLMEngine, w: TokenizedWorkload) -> None:
    """Ingest the corpus: untimed prefills of k passages each (their KV then serves as segments;
    for prefix caching the head + first passage blocks are cached), then the later passes, which
    compute every passage exactly (`blend=False`) in other contexts: the engine merges those
    encodings into the entries (a prefix-caching engine just caches more blocks)."""
    from sparsex.bench.fidelity import run_to_completion
    from sparsex.sampling_params import SamplingParams
    one = SamplingParams(temperature=0, max_tokens=1)
    for prompt in w.warm_prompts:
        run_to_completion(engine, prompt, one)
    for prompt in w.rewarm_prompts:
        run_to_completion(engine, prompt, one, reuse={"blend": False} if engine.segment_index is not None else None)


def pool_blocks(prompts: list[TokenizedPrompt], extra: int, block_size: int, whole: bool) -> int:
    """KV blocks for the workload: all of it (nothing ever evicted) or just the largest request."""
    sizes = [-(-(len(p.token_ids) + extra) // block_size) for p in prompts]
    return (sum(sizes) if whole else max(sizes)) + 2
