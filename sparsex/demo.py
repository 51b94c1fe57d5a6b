"""`sparsex demo`: retrieval-augmented questions over Wikipedia passages that were ingested once,
each answered with segment reuse and again with full prefill, side by side.

1. Ingest: a small corpus of real Wikipedia lead summaries (one article each, 150-250 tokens) goes
   through the engine in a few seeded groupings, each passage behind other passages (one token is
   generated; only the KV matters). The engine indexes every passage as a segment.
2. Ask: each question's prompt is `[system, *passages, question]` over a few of those passages in a
   new order, as explicit segments. The passages' KV is reused at their new positions (keys
   re-rotated) and a few selected tokens are recomputed, instead of prefilling the whole prompt.
3. Compare: the same prompts on a `cache="none"` engine (full prefill of every token), greedy both
   times: TTFT side by side and whether the answers are identical.

Requests run one at a time, so each TTFT is one request's own latency, and each question runs with
reuse and then with full prefill, back to back.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from rich import box
from rich.console import Console
from rich.table import Table

from sparsex.bench.datasets import WikiEntry, load_wiki_entries
from sparsex.bench.workloads import RAG_SYSTEM_PROMPT, ChatFormat, is_answerable, rag_question
from sparsex.config import EngineConfig, parse_dtype
from sparsex.entrypoints.llm import LLM
from sparsex.outputs import RequestOutput
from sparsex.sampling_params import SamplingParams

PASSAGE_TOKENS = (150, 250)       # one Wikipedia lead summary, with its title line


@dataclass
class DemoConfig:
    model: str = EngineConfig.model
    cache: str = EngineConfig.cache
    dtype: str = EngineConfig.dtype   # auto: bfloat16 where the CPU runs it natively, else float32
    max_tokens: int = 24
    quick: bool = False               # 2 questions over 4 passages: for tests and a first look
    compare: bool = True              # answer every question again with full prefill (cache="none")
    seed: int = EngineConfig.seed

    def verify(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max-tokens must be an integer >= 1, got {self.max_tokens!r}")

    @property
    def num_passages(self) -> int:
        return 4 if self.quick else 8

    @property
    def num_questions(self) -> int:
        return 2 if self.quick else 5

    @property
    def passages_per_question(self) -> int:
        return 3 if self.quick else 4


@dataclass(frozen=True)
class Passage:
    entry: WikiEntry
    text: str                         # "Title: ...\n<summary>\n\n": a segment, the same ids wherever it appears
    num_tokens: int


@dataclass(frozen=True)
class Question:
    text: str                         # what is asked, one line
    segments: list[str]               # [system, *passages, question]: the prompt's pieces


@dataclass
class DemoRow:
    """One question: the counters and TTFT of its answer with reuse, and of full prefill's."""
    question: str
    prompt_tokens: int
    num_cached_tokens: int            # exact prefix-cache hit tokens
    num_reused_tokens: int            # tokens served from the segment cache (before recomputation)
    num_recomputed_tokens: int        # reused tokens that were recomputed
    ttft: float                       # seconds, with reuse
    answer: str
    ttft_full: float | None = None    # seconds, full prefill; None without the comparison
    answer_full: str | None = None

    @classmethod
    def from_outputs(cls, question: str, out: RequestOutput, full: RequestOutput | None) -> DemoRow:
        return cls(question=question, prompt_tokens=len(out.prompt_token_ids),
                   num_cached_tokens=out.num_cached_tokens, num_reused_tokens=out.num_reused_tokens,
                   num_recomputed_tokens=out.num_recomputed_tokens, ttft=out.metrics.ttft,
                   answer=out.outputs[0].text.strip(),
                   ttft_full=None if full is None else full.metrics.ttft,
                   answer_full=None if full is None else full.outputs[0].text.strip())

    @property
    def speedup(self) -> float | None:
        return None if self.ttft_full is None else self.ttft_full / self.ttft

    @property
    def same_answer(self) -> bool | None:
        return None if self.answer_full is None else self.answer == self.answer_full


@dataclass
class DemoReport:
    rows: list[DemoRow]
    outputs: list[RequestOutput]                  # with reuse, one per question
    full_outputs: list[RequestOutput] = field(default_factory=list)   # full prefill; empty without compare
    ingest_prompts: int = 0
    ingest_seconds: float = 0.0


# ---------------------------------------------------------------------------- corpus and questions


def pick_passages(tokenizer, num: int, seed: int) -> list[Passage]:
    """`num` Wikipedia lead summaries of PASSAGE_TOKENS tokens, a seeded draw spread over topics, each
    with a one-line answer (its Wikidata description) so that a question about it has one."""
    entries = [e for e in load_wiki_entries() if is_answerable(e)]
    random.Random(seed).shuffle(entries)
    per_topic = -(-num // len({e.topic for e in entries}))
    used: dict[str, int] = {}
    out: list[Passage] = []
    for e in entries:
        if used.get(e.topic, 0) >= per_topic:
            continue
        text = f"Title: {e.title}\n{e.extract}\n\n"
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if PASSAGE_TOKENS[0] <= n <= PASSAGE_TOKENS[1]:
            out.append(Passage(e, text, n))
            used[e.topic] = used.get(e.topic, 0) + 1
            if len(out) == num:
                return out
    raise ValueError(f"the wiki data has only {len(out)} answerable summaries of {PASSAGE_TOKENS} tokens, need {num}")


def build_questions(tokenizer, passages: list[Passage], num: int, k: int, seed: int) -> list[Question]:
    """`num` questions, each over `k` of the passages in a seeded order, asking about one of them
    (a different passage each time)."""
    if not 1 <= k <= len(passages) or num > len(passages):
        raise ValueError(f"need k <= {len(passages)} passages and at most one question per passage; got k={k}, num={num}")
    fmt = ChatFormat.from_tokenizer(tokenizer)
    user_pre, user_post = fmt.wrappers["user"]
    system = fmt.render("system", RAG_SYSTEM_PROMPT) + user_pre
    rng = random.Random(seed + 1)
    targets = rng.sample(passages, num)
    out = []
    for target in targets:
        others = rng.sample([p for p in passages if p is not target], k - 1)
        chosen = [target, *others]
        rng.shuffle(chosen)
        asked = rag_question(target.entry)
        out.append(Question(asked.removeprefix("Question: ").removesuffix("\nAnswer:"),
                            [system, *(p.text for p in chosen), asked + user_post + fmt.generation_cue]))
    return out


def ingest(llm: LLM, system: str, passages: list[Passage], lead: Passage, seed: int = 0) -> int:
    """Put every passage's KV in the segment cache (`LLM.ingest`); returns the number of prompts sent.

    The prefix is the system prompt and `lead`, a passage no question uses: it keeps the passages past
    `ReuseConfig.min_context_tokens`, since an encoding computed right after a short head is reused
    only at an early position."""
    if not llm.llm_engine.config.enable_prefix_caching:      # cache="none" keeps nothing
        return 0
    result = llm.ingest([p.text for p in passages], prefix=system + lead.text, group_size=4,
                        seed=seed, use_tqdm=False)
    return result.num_prompts


def answer(llm: LLM, question: Question, max_tokens: int) -> RequestOutput:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return llm.generate({"segments": question.segments}, params, use_tqdm=False)[0]


def _engine(cfg: DemoConfig, cache: str) -> LLM:
    # warmup: the engine first runs a few small requests through every path its cache mode uses (then
    # empties its caches), so no TTFT below includes a first call's allocations or kernel builds
    return LLM(model=cfg.model, dtype=cfg.dtype, cache=cache, seed=cfg.seed, warmup=True)


# ---------------------------------------------------------------------------- the run


def demo(cfg: DemoConfig, console: Console | None = None) -> DemoReport:
    """Ingest, ask, compare; prints as it goes and returns the rows the table was built from."""
    cfg.verify()
    console = console or Console(highlight=False)
    dtype = str(parse_dtype(cfg.dtype)).removeprefix("torch.")
    console.print(f"loading {cfg.model} ({dtype}, cache={cfg.cache}"
                  + (', and cache="none" for full prefill' if cfg.compare else "") + ") ...")
    llm = _engine(cfg, cfg.cache)
    tokenizer = llm.get_tokenizer()
    corpus = pick_passages(tokenizer, cfg.num_passages + 1, cfg.seed)
    lead, passages = corpus[0], corpus[1:]
    questions = build_questions(tokenizer, passages, cfg.num_questions, cfg.passages_per_question, cfg.seed)

    # both engines up front: each question runs with reuse and then with full prefill, back to back,
    # so a load change on the machine touches both of its TTFTs alike
    base = _engine(cfg, "none") if cfg.compare else None

    t0 = time.perf_counter()
    n_ingest = ingest(llm, questions[0].segments[0], passages, lead, seed=cfg.seed)
    ingest_s = time.perf_counter() - t0
    console.print(f"ingested {len(passages)} Wikipedia passages ({sum(p.num_tokens for p in passages)} tokens: "
                  + ", ".join(p.entry.title for p in passages) + f") in {n_ingest} prompts, {ingest_s:.1f} s")
    console.print(f"asking {len(questions)} questions, each over {cfg.passages_per_question} of them in a new "
                  f"order (greedy, max_tokens={cfg.max_tokens})"
                  + (', each again with full prefill (cache="none")' if base is not None else "") + " ...")
    outputs: list[RequestOutput] = []
    full: list[RequestOutput] = []
    for q in questions:
        outputs.append(answer(llm, q, cfg.max_tokens))
        if base is not None:
            full.append(answer(base, q, cfg.max_tokens))
    del llm, base
    rows = [DemoRow.from_outputs(q.text, o, f) for q, o, f in zip(questions, outputs, full or [None] * len(outputs))]
    report = DemoReport(rows, outputs, full, n_ingest, ingest_s)
    console.print()
    console.print(demo_table(rows, cfg.cache))
    for i, r in enumerate(rows, 1):
        console.print(f"[bold]{i}.[/bold] {r.question}", soft_wrap=True)
        console.print(f"   {cfg.cache}: {_one_line(r.answer)}", soft_wrap=True, markup=False)
        if r.answer_full is not None and not r.same_answer:
            console.print(f"   full prefill: {_one_line(r.answer_full)}", soft_wrap=True, markup=False)
    if base_dtype_note(dtype, rows):
        console.print(base_dtype_note(dtype, rows), soft_wrap=True)
    return report


def base_dtype_note(dtype: str, rows: list[DemoRow]) -> str | None:
    """In bfloat16, rounding alone flips near-tied tokens between any two prefills, so answers that
    differ need not be reuse's doing (docs/benchmarks.md, "Where SparseX loses")."""
    if dtype != "bfloat16" or all(r.same_answer in (True, None) for r in rows):
        return None
    return ("note: in bfloat16, rounding alone changes near-tied tokens between two prefills; "
            "`sparsex demo --dtype float32` compares the answers without it")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def demo_table(rows: list[DemoRow], cache: str) -> Table:
    compare = bool(rows) and rows[0].ttft_full is not None
    t = Table(title=f"time to first token, cache={cache}" + (" vs full prefill" if compare else ""),
              caption="prefix cache: exact prefix hit; reused: from the segment cache, keys re-rotated; "
                      "recomputed: reused tokens computed again" + ("; same answer: identical greedy text" if compare else ""),
              box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, collapse_padding=True)
    # two-line headers: the table must fit an 80-column console
    cols = ["#", "prompt\ntokens", "prefix\ncache", "reused", "recom-\nputed", f"TTFT\n{cache}"]
    if compare:
        cols += ["TTFT\nfull", "speedup", "same\nanswer"]
    for name in cols:
        t.add_column(name, justify="center" if name == "same\nanswer" else "right", no_wrap=True)
    for i, r in enumerate(rows, 1):
        cells = [str(i), str(r.prompt_tokens), str(r.num_cached_tokens), str(r.num_reused_tokens),
                 str(r.num_recomputed_tokens), f"{r.ttft * 1e3:.0f} ms"]
        if compare:
            cells += [f"{r.ttft_full * 1e3:.0f} ms", f"{r.speedup:.2f}x", "yes" if r.same_answer else "no"]
        t.add_row(*cells)
    t.add_section()
    total = sum(r.ttft for r in rows)
    cells = ["total", str(sum(r.prompt_tokens for r in rows)), str(sum(r.num_cached_tokens for r in rows)),
             str(sum(r.num_reused_tokens for r in rows)), str(sum(r.num_recomputed_tokens for r in rows)),
             f"{total * 1e3:.0f} ms"]
    if compare:
        total_full = sum(r.ttft_full for r in rows)
        cells += [f"{total_full * 1e3:.0f} ms", f"{total_full / total:.2f}x",
                  f"{sum(bool(r.same_answer) for r in rows)}/{len(rows)}"]
    t.add_row(*cells, style="bold")
    return t


def run_demo(cfg: DemoConfig, console: Console | None = None) -> int:
    """`sparsex demo`: the exit status."""
    t0 = time.perf_counter()
    console = console or Console(highlight=False)
    demo(cfg, console)
    console.print(f"\ndone in {time.perf_counter() - t0:.0f} s")
    return 0
