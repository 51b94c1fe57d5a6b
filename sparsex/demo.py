"""`sparsex demo`: a small interleaved RAG + chat workload through the engine, with segment reuse
on, then the same requests with no cache for a TTFT comparison.

Requests run one at a time, in arrival order, so each TTFT is a single request's own latency and
every request can reuse what the ones before it computed: the RAG queries draw their passages from
a small Zipf-popular pool (the same passage recurs at different positions, behind different
neighbours), and the chat users of two deployments (system prompts) talk about a few shared topics
(the same messages recur behind a different system prompt, i.e. at shifted positions).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from sparsex.bench.workloads import Request, chat_workload, rag_workload
from sparsex.engine.llm_engine import EngineStats
from sparsex.config import parse_dtype
from sparsex.entrypoints.llm import LLM
from sparsex.outputs import RequestOutput
from sparsex.sampling_params import SamplingParams

_QUESTION_WIDTH = 96


@dataclass
class DemoConfig:
    model: str = "smollm2-135m-instruct"
    cache: str = "sparsex"
    dtype: str = "auto"               # bfloat16 where the CPU runs it natively, else float32
    max_tokens: int = 24
    quick: bool = False               # 3 short requests: for tests and a first look
    compare: bool = True              # rerun the requests with cache="none"
    seed: int = 0

    def verify(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max-tokens must be an integer >= 1, got {self.max_tokens!r}")


@dataclass
class DemoResult:
    request: Request
    output: RequestOutput

    @property
    def ttft(self) -> float:
        return self.output.metrics.ttft

    @property
    def answer(self) -> str:
        return self.output.outputs[0].text.strip()


def demo_requests(tokenizer, quick: bool, seed: int) -> list[Request]:
    """RAG and chat requests, alternating. Sizes chosen to show reuse within ~1 min on 2 cores."""
    if quick:
        rag = rag_workload(tokenizer, num_queries=2, k=2, num_passages=3, seed=seed)
        chat = chat_workload(tokenizer, num_users=1, turns_per_user=1, num_deployments=1,
                             context_budget=256, num_topics=2, seed=seed)
    else:
        rag = rag_workload(tokenizer, num_queries=4, k=3, num_passages=6, seed=seed)
        chat = chat_workload(tokenizer, num_users=2, turns_per_user=2, num_deployments=2,
                             context_budget=512, num_topics=3, seed=seed)
    out = []
    for i in range(max(len(rag), len(chat))):
        out += rag[i:i + 1] + chat[i:i + 1]
    return out


def question_of(req: Request) -> str:
    """One line saying what the request asks: the RAG question, or the chat user's last message."""
    text = req.messages[-1]["content"]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    asked = next((ln for ln in lines if ln.startswith("Question:")), lines[-1] if lines else "")
    asked = asked.removeprefix("Question:").strip()
    return asked if len(asked) <= _QUESTION_WIDTH else asked[: _QUESTION_WIDTH - 3] + "..."


def run_requests(llm: LLM, requests: list[Request], max_tokens: int) -> list[DemoResult]:
    # A throwaway request first: first-call allocations would otherwise land on request 1's TTFT.
    # It is shorter than a KV block and has no segments, so it leaves nothing in the caches.
    llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [DemoResult(r, llm.generate(r.engine_prompt(), params, use_tqdm=False)[0]) for r in requests]


def _print_result(console: Console, i: int, n: int, res: DemoResult) -> None:
    o = res.output
    # soft_wrap: a long answer stays one line instead of being re-flowed to the console width
    console.print(f"[bold][{i}/{n}] {res.request.workload}[/bold] Q: {question_of(res.request)}", soft_wrap=True)
    console.print(f"      A: {res.answer!r}", soft_wrap=True, markup=False)
    console.print(f"      TTFT {res.ttft * 1e3:.0f} ms | prompt {len(o.prompt_token_ids)} tok | "
                  f"prefix-cached {o.num_cached_tokens} | segment-reused {o.num_reused_tokens} | "
                  f"recomputed {o.num_recomputed_tokens}", style="dim", soft_wrap=True)


def stats_table(stats: EngineStats, cache: str) -> Table:
    t = Table(title=f"cache statistics (cache={cache})")
    t.add_column("metric")
    t.add_column("value", justify="right")

    def pct(a: int, b: int) -> str:
        return f"{a} / {b} ({100 * a / b:.0f}%)" if b else "0 / 0"

    t.add_row("prefix-cache hit tokens / looked up", pct(stats.prefix_cache_hits, stats.prefix_cache_queries))
    t.add_row("approximate-prefix hit tokens (blended blocks)", str(stats.approx_prefix_hits))
    t.add_row("segment-cache hit tokens / looked up", pct(stats.segment_cache_hits, stats.segment_cache_queries))
    t.add_row("reused tokens recomputed", str(stats.recomputed_tokens))
    t.add_row("token selection time", f"{stats.selection_seconds * 1e3:.0f} ms")
    t.add_row("segment entries indexed", str(stats.num_segment_entries))
    t.add_row("KV blocks in use", f"{stats.kv_cache_usage:.1%} of {stats.num_blocks}")
    t.add_row("preemptions", str(stats.num_preemptions))
    return t


def comparison_table(ours: list[DemoResult], base: list[DemoResult], cache: str) -> Table:
    t = Table(title=f"TTFT: cache={cache} vs cache=none (same requests, same order)",
              caption="from cache = prefix-cached + segment-reused - recomputed tokens; "
                      "same answer = identical greedy text")
    # short headers: the table must fit an 80-column console
    for name, justify in (("#", "right"), ("kind", "left"), ("prompt", "right"), ("from cache", "right"),
                          ("TTFT none", "right"), (f"TTFT {cache}", "right"), ("speedup", "right"),
                          ("same answer", "center")):
        t.add_column(name, justify=justify)
    for i, (a, b) in enumerate(zip(ours, base), 1):
        o = a.output
        served = o.num_cached_tokens + o.num_reused_tokens - o.num_recomputed_tokens
        t.add_row(str(i), a.request.workload, str(len(o.prompt_token_ids)), str(served),
                  f"{b.ttft * 1e3:.0f} ms", f"{a.ttft * 1e3:.0f} ms", f"{b.ttft / a.ttft:.2f}x",
                  "yes" if a.answer == b.answer else "no")
    tot_a, tot_b = sum(r.ttft for r in ours), sum(r.ttft for r in base)
    t.add_row("", "total", "", "", f"{tot_b * 1e3:.0f} ms", f"{tot_a * 1e3:.0f} ms", f"{tot_b / tot_a:.2f}x", "",
              style="bold")
    return t


def run_demo(cfg: DemoConfig, console: Console | None = None) -> int:
    cfg.verify()
    console = console or Console(highlight=False)
    t0 = time.perf_counter()
    dtype = str(parse_dtype(cfg.dtype)).removeprefix("torch.")
    console.print(f"loading {cfg.model} ({dtype}, cache={cfg.cache}) ...")
    llm = LLM(model=cfg.model, dtype=cfg.dtype, cache=cfg.cache, seed=cfg.seed)
    requests = demo_requests(llm.get_tokenizer(), cfg.quick, cfg.seed)
    console.print(f"{len(requests)} requests (RAG over Wikipedia passages + multi-turn chat), "
                  f"greedy, max_tokens={cfg.max_tokens}\n")
    ours = run_requests(llm, requests, cfg.max_tokens)
    for i, res in enumerate(ours, 1):
        _print_result(console, i, len(ours), res)
    console.print()
    console.print(stats_table(llm.llm_engine.stats(), cfg.cache))
    del llm
    if cfg.compare and cfg.cache != "none":
        console.print("\nrerunning the same requests with cache=none ...")
        base_llm = LLM(model=cfg.model, dtype=cfg.dtype, cache="none", seed=cfg.seed)
        base = run_requests(base_llm, requests, cfg.max_tokens)
        del base_llm
        console.print(comparison_table(ours, base, cfg.cache))
    console.print(f"\ndone in {time.perf_counter() - t0:.0f} s")
    return 0
