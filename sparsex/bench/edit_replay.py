"""Edit replay: how much of a prompt that changed in a few tokens is still served from cache.

    sparsex bench edit --kinds chat,agent --caches prefix,sparsex --cases 8 --threads 1 --out runs/edit

(also `python -m sparsex.bench.edit_replay ...`). Two kinds of case, each a pair of requests sent
one after the other through the chat path (`sparsex.inputs.chat_prompt`, the tokenizer's template):

  chat   a conversation about real Wikipedia topics (`load_wiki_entries`: the user quotes a
         summary's first sentence, the assistant replies with the rest of it), a system prompt of
         `workloads.CHAT_SYSTEM_PROMPTS` and about `chat_tokens` tokens of turns. Request 2 is the
         same conversation with one EARLIER message (a message in the first half, never the system
         prompt) edited: one word replaced by, or one word inserted before, a word drawn from
         another message of the conversation, so the edit touches a few tokens (at most
         `MAX_EDIT_TOKENS`). Request 2 also carries the reply to request 1's last message and a new
         user message (`workloads.FOLLOW_UPS`).
  agent  a research agent (`workloads.AGENT_SYSTEM_PROMPT` + BFCL's web_search function docs, a
         BFCL multi-hop question, the call for its first hop) whose tool message returns
         {"request_id", "retrieved_at", "results"}: `results_per_call` search results built from
         real Wikipedia summaries ({"title", "href", "body"}, the shape BFCL's search_engine_query
         returns). Request 2 holds the same tool result with only its request id and timestamp
         changed (the call issued again), then a new turn: the call for the next hop and its result.

Every case runs on a freshly reset engine per cache mode: request 1 (one token), then request 2
(`fidelity_tokens` greedy tokens). On request 2:

  unchanged  its tokens whose text is unchanged from request 1: the matching blocks of a token-level
             diff of the two prompts' ids (`difflib.SequenceMatcher`, no junk heuristic), inside
             the part of request 2 that request 1 already held (the appended turn, never seen, is
             excluded by construction);
  served     [0, num_cached_tokens) (the exact prefix hit) and every `RequestOutput.reused_spans`
             span (reused KV, re-rotated; the few reused tokens the blend recomputes count as
             served, as `num_reused_tokens` counts them);
  share      |served ∩ unchanged| / |unchanged|: token-weighted over cases, and the mean over cases
             with a percentile-bootstrap interval (`stats.bootstrap_mean`). The target (the
             project's edit-replay requirement) is `TARGET_SHARE` = 90%.

Also per case: prompt tokens, exact-prefix tokens, reused tokens by source, TTFT of request 2, and
fidelity of request 2 against full prefill: the reference (cache "none", always run) greedy-decodes
`fidelity_tokens` tokens; each cache mode's greedy tokens are compared with them (first token equal,
tokens before the first disagreement). Unserved unchanged tokens are reported as runs and split into
those before the edit (the tail of the block the edit falls in, which the exact prefix cannot hold)
and those after it.

Outputs in --out: results.json (configuration, environment, summaries, every case record) and
summary.md (the table the command prints).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import difflib
import json
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from sparsex.bench import add_engine_flag, add_threads_arg, set_threads
from sparsex.bench.datasets import (WikiEntry, load_bfcl_tool_docs, load_bfcl_web_search_tasks,
                                    load_wiki_entries)
from sparsex.bench.engine_cache import EngineCache
from sparsex.bench.prompt_forms import served_mask
from sparsex.bench.report import resolved_dtype
from sparsex.bench.stats import Interval, bootstrap_mean
from sparsex.bench.workloads import AGENT_SYSTEM_PROMPT, CHAT_SYSTEM_PROMPTS, FOLLOW_UPS, split_sentences
from sparsex.config import CACHE_MODES, DTYPES, EngineConfig
from sparsex.inputs import TokenizedPrompt, chat_prompt

KINDS = ("chat", "agent")
CACHES = CACHE_MODES
TARGET_SHARE = 0.9           # share of unchanged tokens to serve from cache (the requirement)
MAX_EDIT_TOKENS = 4          # a chat edit changes at most this many tokens (redrawn otherwise)
MIN_EXCHANGES = 3            # chat: user/assistant exchanges before the last user message, at least
AGENT_TOOL_API = "web_search"
_WORD = re.compile(r"(?<![\w'-])[A-Za-z]{3,}(?![\w'-])")     # a whole word, not part of "don't" or "x-ray"
_DONOR = re.compile(r"\b[a-z]{3,10}\b")
_REF_BLOCKS = 512            # KV pool of the full-prefill reference engine (one request at a time)
_EDIT_DRAWS = 64             # redraws before a chat case gives up finding a few-token edit

Message = dict[str, str]


# ============================================================================ cases

@dataclass(frozen=True)
class EditCase:
    """Two requests of one conversation: `second` is `first` with one message changed in a few
    tokens (`edited_message`), followed by `num_new_messages` new messages."""
    case_id: str
    kind: str                          # "chat" | "agent"
    first: tuple[Message, ...]
    second: tuple[Message, ...]
    edited_message: int                # index into both message lists
    change: str                        # what the edit did, for the records

    @property
    def num_new_messages(self) -> int:
        return len(self.second) - len(self.first)


@dataclass(frozen=True)
class CasePrompts:
    """A case's two prompts as the engine takes them, and which tokens of the second are unchanged."""
    case: EditCase
    first: TokenizedPrompt
    second: TokenizedPrompt
    shared_end: int                    # second.token_ids[:shared_end] is request 1's part; the rest is new
    unchanged: np.ndarray              # [len(second.token_ids)] bool: text unchanged from request 1
    edit_span: tuple[int, int]         # [start, end) in the second prompt: from the end of the common
                                       # prefix to the start of the last unchanged run (empty for a deletion)

    @property
    def num_edit_tokens(self) -> int:
        """Tokens the edit touched: the larger of those added to request 2 and those gone from request 1."""
        added = int((~self.unchanged[:self.shared_end]).sum())
        removed = len(self.first.token_ids) - int(self.unchanged.sum())
        return max(added, removed)


def token_diff(first_ids: Sequence[int], second_ids: Sequence[int],
               shared_end: int) -> tuple[np.ndarray, tuple[int, int]]:
    """The unchanged tokens of the second prompt and the edit's span in it.

    unchanged: [len(second_ids)] bool, positions of `second_ids[:shared_end]` inside a matching block
    of the token-level diff against `first_ids` (`SequenceMatcher` without its junk heuristic, which
    would drop the template's frequent tokens from the matching). The span runs from the end of the
    common prefix to the start of the last matching run (empty where the edit only removed tokens)."""
    mask = np.zeros(len(second_ids), dtype=bool)
    sm = difflib.SequenceMatcher(None, list(first_ids), list(second_ids), autojunk=False)
    blocks = [m for m in sm.get_matching_blocks() if m.size and m.b < shared_end]
    for m in blocks:
        mask[m.b:min(m.b + m.size, shared_end)] = True
    prefix = blocks[0].size if blocks and blocks[0].a == blocks[0].b == 0 else 0
    tail = blocks[-1].b if blocks and blocks[-1].b >= prefix else shared_end    # no run after the prefix
    return mask, (prefix, tail)


def tokenize_case(tokenizer: Any, case: EditCase, vocab_size: int) -> CasePrompts:
    """Both prompts through the chat path; request 1's part of request 2 ends where the content of
    the first new message starts (the template glue just before it is request 1's generation cue)."""
    first = chat_prompt(tokenizer, list(case.first), vocab_size)
    second = chat_prompt(tokenizer, list(case.second), vocab_size)
    shared_end = len(second.token_ids)
    if case.num_new_messages:
        # one segment span per non-empty message content, in message order
        spans = second.segments
        if len(spans) != len(case.second):
            raise ValueError(f"case {case.case_id}: expected one segment per message, got {len(spans)} "
                             f"for {len(case.second)} messages")
        shared_end = spans[len(case.first)].start
    unchanged, span = token_diff(first.token_ids, second.token_ids, shared_end)
    return CasePrompts(case, first, second, shared_end, unchanged, span)


def _count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _chat_pool() -> list[WikiEntry]:
    """Wikipedia entries long enough for an opener sentence and a reply of two sentences or more."""
    return [e for e in load_wiki_entries() if len(split_sentences(e.extract)) >= 3]


def _exchange(entry: WikiEntry) -> tuple[str, str]:
    """(user, assistant) text of a conversation turn about `entry` (chat_workload's opener form)."""
    sentences = split_sentences(entry.extract)
    user = f'I read this about {entry.title}: "{sentences[0]}" Can you tell me more?'
    return user, " ".join(sentences[1:])


def _edit_text(text: str, donors: list[str], rng: np.random.Generator) -> tuple[str, str]:
    """One word of `text` replaced by, or preceded by, a donor word: (new text, description)."""
    words = list(_WORD.finditer(text))
    if not words:
        raise ValueError(f"no word to edit in {text[:60]!r}")
    m = words[int(rng.integers(len(words)))]
    donor = donors[int(rng.integers(len(donors)))]
    at, word = m.start(), m.group()
    if rng.random() < 0.5 and donor.lower() != word.lower():
        return text[:at] + donor + text[m.end():], f"replace {word!r} -> {donor!r} at char {at}"
    return text[:at] + donor + " " + text[at:], f"insert {donor!r} before {word!r} at char {at}"


def chat_cases(tokenizer: Any, num_cases: int, seed: int = 0, chat_tokens: int = 1200) -> list[EditCase]:
    """`num_cases` chat cases (see the module docstring), deterministic for `seed`."""
    _check_positive("num_cases", num_cases)
    _check_positive("chat_tokens", chat_tokens)
    rng = np.random.default_rng(seed)
    pool = _chat_pool()
    order = rng.permutation(len(pool))
    vocab = len(tokenizer)
    cases, cursor = [], 0

    def next_entry() -> WikiEntry:
        nonlocal cursor
        if cursor >= len(order):
            raise ValueError(f"chat_tokens={chat_tokens} x num_cases={num_cases}: the wiki data runs out of topics")
        cursor += 1
        return pool[int(order[cursor - 1])]

    for c in range(num_cases):
        system = CHAT_SYSTEM_PROMPTS[int(rng.integers(len(CHAT_SYSTEM_PROMPTS)))]
        messages: list[Message] = [{"role": "system", "content": system}]
        used, exchanges = _count_tokens(tokenizer, system), 0
        while exchanges < MIN_EXCHANGES or used < chat_tokens:
            user, reply = _exchange(next_entry())
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            used += _count_tokens(tokenizer, user) + _count_tokens(tokenizer, reply)
            exchanges += 1
        opener, reply = _exchange(next_entry())
        messages.append({"role": "user", "content": opener})
        new_turn = [{"role": "assistant", "content": reply},
                    {"role": "user", "content": FOLLOW_UPS[int(rng.integers(len(FOLLOW_UPS)))]}]
        # the edited message: one starting in the conversation's first half, after the system prompt
        # and never the last one (so most of the prompt follows the edit)
        starts = np.cumsum([0] + [len(m["content"]) for m in messages[:-1]])
        half = starts[-1] / 2
        candidates = [i for i in range(1, len(messages) - 1) if starts[i] < half] or [1]
        for _ in range(_EDIT_DRAWS):
            target = candidates[int(rng.integers(len(candidates)))]
            donors = sorted({w for i, m in enumerate(messages) if i not in (0, target)
                             for w in _DONOR.findall(m["content"])})
            text, change = _edit_text(messages[target]["content"], donors, rng)
            edited = [dict(m) for m in messages]
            edited[target]["content"] = text
            case = EditCase(f"chat-{c}", "chat", tuple(messages), tuple(edited + new_turn), target,
                            f"message {target} ({messages[target]['role']}): {change}")
            if 1 <= tokenize_case(tokenizer, case, vocab).num_edit_tokens <= MAX_EDIT_TOKENS:
                cases.append(case)
                break
        else:
            raise ValueError(f"seed={seed}: no edit of at most {MAX_EDIT_TOKENS} tokens found for chat case {c}")
    return cases


def search_result(entry: WikiEntry) -> dict[str, str]:
    """A search result as BFCL's search_engine_query returns one: {"title", "href", "body"}."""
    href = "https://en.wikipedia.org/wiki/" + entry.title.replace(" ", "_")
    return {"title": entry.title, "href": href, "body": entry.extract}


def tool_result(request_id: str, retrieved_at: str, results: list[dict[str, str]]) -> str:
    """The tool message's content: the call's id and time, then its results (compact JSON)."""
    return json.dumps({"request_id": request_id, "retrieved_at": retrieved_at, "results": results},
                      ensure_ascii=False)


def _request_id(rng: np.random.Generator) -> str:
    return str(uuid.UUID(bytes=rng.bytes(16), version=4))


def _iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def agent_cases(tokenizer: Any, num_cases: int, seed: int = 0, results_per_call: int = 3) -> list[EditCase]:
    """`num_cases` agent cases (see the module docstring), deterministic for `seed`."""
    _check_positive("num_cases", num_cases)
    _check_positive("results_per_call", results_per_call)
    rng = np.random.default_rng(seed)
    tasks = [t for t in load_bfcl_web_search_tasks() if len(t.subquestions) >= 2]
    task_order = rng.permutation(len(tasks))
    # summaries of a few sentences: a result list long enough for the reuse to matter
    docs = [e for e in load_wiki_entries() if 400 <= len(e.extract) <= 1500]
    if 2 * results_per_call > len(docs):
        raise ValueError(f"results_per_call={results_per_call}: only {len(docs)} documents")
    system = AGENT_SYSTEM_PROMPT + "".join(json.dumps(d, ensure_ascii=False) + "\n"
                                           for d in load_bfcl_tool_docs(AGENT_TOOL_API))
    epoch = dt.datetime(2025, 1, 1, tzinfo=dt.timezone.utc)
    cases = []
    for c in range(num_cases):
        task = tasks[int(task_order[c % len(tasks)])]
        picked = rng.choice(len(docs), size=2 * results_per_call, replace=False)
        results = [search_result(docs[int(i)]) for i in picked[:results_per_call]]
        next_results = [search_result(docs[int(i)]) for i in picked[results_per_call:]]
        t1 = epoch + dt.timedelta(seconds=int(rng.integers(365 * 86400)))
        t2 = t1 + dt.timedelta(seconds=int(rng.integers(1, 3600)))       # the call issued again
        t3 = t2 + dt.timedelta(seconds=int(rng.integers(1, 60)))
        id1, id2, id3 = _request_id(rng), _request_id(rng), _request_id(rng)
        head = [{"role": "system", "content": system}, {"role": "user", "content": task.question},
                {"role": "assistant", "content": f"search_engine_query(keywords={task.subquestions[0]!r})"}]
        first = head + [{"role": "tool", "content": tool_result(id1, _iso(t1), results)}]
        second = head + [{"role": "tool", "content": tool_result(id2, _iso(t2), results)},
                         {"role": "assistant", "content": f"search_engine_query(keywords={task.subquestions[1]!r})"},
                         {"role": "tool", "content": tool_result(id3, _iso(t3), next_results)}]
        cases.append(EditCase(f"agent-{c}", "agent", tuple(first), tuple(second), len(head),
                              f"tool result: request_id {id1} -> {id2}, retrieved_at {_iso(t1)} -> {_iso(t2)}"))
    return cases


def build_cases(tokenizer: Any, kinds: Sequence[str], num_cases: int, seed: int = 0, chat_tokens: int = 1200,
                results_per_call: int = 3) -> list[EditCase]:
    """`num_cases` cases of every kind in `kinds`, in that order."""
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown case kind {k!r}; choose from {', '.join(KINDS)}")
    out: list[EditCase] = []
    for k in kinds:
        out += (chat_cases(tokenizer, num_cases, seed, chat_tokens) if k == "chat"
                else agent_cases(tokenizer, num_cases, seed, results_per_call))
    return out


# ============================================================================ configuration

def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def parse_names(text: str, allowed: Sequence[str], option: str) -> tuple[str, ...]:
    """`"chat, agent"` -> ("chat", "agent"); an unknown, repeated or missing name raises ValueError."""
    names = tuple(p.strip() for p in text.split(",") if p.strip())
    if not names:
        raise ValueError(f"{option}: expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
    for n in names:
        if n not in allowed:
            raise ValueError(f"{option}: unknown value {n!r}; choose from {', '.join(allowed)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{option}: a value is repeated in {text!r}")
    return names


@dataclass(frozen=True)
class EditReplayConfig:
    kinds: tuple[str, ...] = KINDS
    caches: tuple[str, ...] = ("prefix", "sparsex")
    cases: int = 8                     # per kind
    seed: int = 0
    model: str = EngineConfig.model
    dtype: str = EngineConfig.dtype
    chat_tokens: int = 1200            # chat: tokens of turns before request 1's last message, at least
    results_per_call: int = 3          # agent: search results per tool message
    fidelity_tokens: int = 16          # request 2's greedy tokens, compared with full prefill's
    num_blocks: int | None = None      # KV pool of each caching engine; None: what the largest case needs
    out: str | None = None

    def verify(self) -> None:
        for name, values, allowed in (("kinds", self.kinds, KINDS), ("caches", self.caches, CACHES)):
            parse_names(",".join(values), allowed, name)
        for name in ("cases", "chat_tokens", "results_per_call", "fidelity_tokens"):
            _check_positive(name, getattr(self, name))
        if self.num_blocks is not None:
            _check_positive("num_blocks", self.num_blocks)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")


# ============================================================================ replay

@dataclass
class CaseRecord:
    """Request 2 of one case under one cache mode."""
    case_id: str
    kind: str
    cache: str
    change: str
    prompt_tokens: int
    unchanged_tokens: int
    edit_tokens: int                   # changed by the edit (see CasePrompts.num_edit_tokens)
    new_tokens: int                    # the appended turn (never seen)
    edit_start: int                    # first changed position of request 2
    prefix_tokens: int                 # exact prefix hit (num_cached_tokens)
    reused_tokens: int                 # in reused spans (num_reused_tokens)
    recomputed_tokens: int             # of the reused ones, recomputed by the blend
    reused_by_source: dict[str, int]
    served_unchanged: int              # unchanged tokens served from cache
    unserved_before_edit: int          # unchanged, not served, before the edit
    unserved_after_edit: int
    unserved_runs: list[tuple[int, int]]   # maximal [start, end) runs of unchanged tokens not served
    reuse_skipped: str | None
    ttft_ms: float
    full_prefill_ttft_ms: float        # the reference's (cache "none") on the same prompt
    first_token_match: bool            # the first greedy token equals full prefill's
    match_len: int                     # greedy tokens before the first disagreement with full prefill
    fidelity_tokens: int

    @property
    def served_share(self) -> float:
        return self.served_unchanged / self.unchanged_tokens if self.unchanged_tokens else 1.0


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of True in a 1-d bool array."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def _record(cp: CasePrompts, cache: str, out: Any, ref_tokens: list[int], ref_ttft: float) -> CaseRecord:
    n = len(cp.second.token_ids)
    served = served_mask(n, out.num_cached_tokens, out.reused_spans)
    missed = cp.unchanged & ~served                           # [n]
    edit_start, edit_end = cp.edit_span
    by_source: dict[str, int] = {}
    for s in out.reused_spans:
        by_source[s.source] = by_source.get(s.source, 0) + s.num_tokens
    toks = out.outputs[0].token_ids
    match = next((i for i, (a, b) in enumerate(zip(toks, ref_tokens)) if a != b), min(len(toks), len(ref_tokens)))
    return CaseRecord(
        case_id=cp.case.case_id, kind=cp.case.kind, cache=cache, change=cp.case.change, prompt_tokens=n,
        unchanged_tokens=int(cp.unchanged.sum()), edit_tokens=cp.num_edit_tokens, new_tokens=n - cp.shared_end,
        edit_start=edit_start, prefix_tokens=out.num_cached_tokens, reused_tokens=out.num_reused_tokens,
        recomputed_tokens=out.num_recomputed_tokens, reused_by_source=by_source,
        served_unchanged=int((cp.unchanged & served).sum()),
        unserved_before_edit=int(missed[:edit_start].sum()), unserved_after_edit=int(missed[edit_end:].sum()),
        unserved_runs=_runs(missed), reuse_skipped=out.reuse_skipped, ttft_ms=1e3 * (out.metrics.ttft or 0.0),
        full_prefill_ttft_ms=1e3 * ref_ttft, first_token_match=bool(toks[:1] == ref_tokens[:1]),
        match_len=match, fidelity_tokens=len(ref_tokens))


def _run(engine: Any, prompt: TokenizedPrompt, max_tokens: int) -> Any:
    from sparsex.bench.fidelity import run_to_completion
    from sparsex.sampling_params import SamplingParams
    out, _ = run_to_completion(engine, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return out


def _blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def _blocks_needed(prompts: list[CasePrompts], extra: int, block_size: int) -> int:
    """The largest case's KV footprint on one caching engine: both requests' blocks, twice (a segment
    entry may copy its blocks), and a margin."""
    per = [_blocks(len(p.first.token_ids), block_size) + _blocks(len(p.second.token_ids) + extra, block_size)
           for p in prompts]
    return 2 * max(per) + 32


def replay(cfg: EditReplayConfig, engines: EngineCache) -> tuple[list[CasePrompts], list[CaseRecord]]:
    """Build the cases, run the full-prefill reference, then every cache mode of `cfg.caches`:
    request 1 then request 2 on a freshly reset engine per case. Returns the prompts and the records
    (cache-mode order of `cfg.caches`, then case order)."""
    ref_engine = engines.take("none", "timed", _REF_BLOCKS)
    cases = build_cases(ref_engine.tokenizer, cfg.kinds, cfg.cases, cfg.seed, cfg.chat_tokens, cfg.results_per_call)
    prompts = [tokenize_case(ref_engine.tokenizer, c, ref_engine.model_config.vocab_size) for c in cases]
    bs = ref_engine.config.block_size
    longest = max(len(p.second.token_ids) for p in prompts) + cfg.fidelity_tokens
    if _blocks(longest, bs) > _REF_BLOCKS:
        raise ValueError(f"chat_tokens={cfg.chat_tokens}, results_per_call={cfg.results_per_call}: a request of "
                         f"{longest} tokens exceeds the reference engine's pool of {_REF_BLOCKS * bs} tokens")
    num_blocks = cfg.num_blocks or _blocks_needed(prompts, cfg.fidelity_tokens, bs)
    refs = []          # (request 2's output, its greedy tokens) under full prefill, per case
    for p in prompts:
        ref_engine.reset_cache()
        out = _run(ref_engine, p.second, cfg.fidelity_tokens)
        refs.append((out, list(out.outputs[0].token_ids)))
    del ref_engine
    engines.release("none")
    records: list[CaseRecord] = []
    for cache in cfg.caches:
        if cache == "none":          # the reference itself: served nothing, exact by definition
            records += [_record(p, cache, out, toks, out.metrics.ttft or 0.0) for p, (out, toks) in zip(prompts, refs)]
            continue
        engine = engines.take(cache, "timed", num_blocks)
        for p, (ref, toks) in zip(prompts, refs):
            engine.reset_cache()
            first = _run(engine, p.first, 1)
            if first.num_cached_tokens or first.reused_spans:      # the reset left something behind
                raise RuntimeError(f"{p.case.case_id}: request 1 was served from cache under {cache}")
            out = _run(engine, p.second, cfg.fidelity_tokens)
            engine.check_integrity()
            records.append(_record(p, cache, out, toks, ref.metrics.ttft or 0.0))
        del engine
        engines.release(cache)
    return prompts, records


# ============================================================================ summaries

@dataclass
class EditSummary:
    """One (kind, cache mode) over its cases; kind "all" pools every kind."""
    kind: str
    cache: str
    cases: int
    prompt_tokens: float               # means per case
    unchanged_tokens: float
    edit_tokens: float
    prefix_tokens: float
    reused_tokens: float
    recomputed_tokens: float
    served_share: float                # token-weighted over cases
    served_share_mean: Interval        # mean over cases, bootstrap interval
    min_case_share: float
    unserved_before_edit: float        # means per case
    unserved_after_edit: float
    ttft_ms: float
    full_prefill_ttft_ms: float
    first_token_agreement: float
    match_len: float
    fidelity_tokens: int
    meets_target: bool
    skipped: list[str] = field(default_factory=list)   # distinct reuse_skipped reasons

    @property
    def ttft_ratio(self) -> float:
        return self.ttft_ms / self.full_prefill_ttft_ms if self.full_prefill_ttft_ms > 0 else float("nan")


def summarize(records: list[CaseRecord], kind: str, cache: str, seed: int = 0) -> EditSummary:
    rs = [r for r in records if r.cache == cache and (kind == "all" or r.kind == kind)]
    if not rs:
        raise ValueError(f"no records of kind {kind!r} under cache {cache!r}")

    def mean(attr: str) -> float:
        return float(np.mean([getattr(r, attr) for r in rs]))

    unchanged = sum(r.unchanged_tokens for r in rs)
    share = sum(r.served_unchanged for r in rs) / unchanged if unchanged else 1.0
    return EditSummary(
        kind=kind, cache=cache, cases=len(rs), prompt_tokens=mean("prompt_tokens"),
        unchanged_tokens=mean("unchanged_tokens"), edit_tokens=mean("edit_tokens"), prefix_tokens=mean("prefix_tokens"),
        reused_tokens=mean("reused_tokens"), recomputed_tokens=mean("recomputed_tokens"), served_share=share,
        served_share_mean=bootstrap_mean([r.served_share for r in rs], seed=seed),
        min_case_share=min(r.served_share for r in rs), unserved_before_edit=mean("unserved_before_edit"),
        unserved_after_edit=mean("unserved_after_edit"), ttft_ms=mean("ttft_ms"),
        full_prefill_ttft_ms=mean("full_prefill_ttft_ms"), first_token_agreement=mean("first_token_match"),
        match_len=mean("match_len"), fidelity_tokens=rs[0].fidelity_tokens, meets_target=share >= TARGET_SHARE,
        skipped=sorted({r.reuse_skipped for r in rs if r.reuse_skipped}))


def summaries(cfg: EditReplayConfig, records: list[CaseRecord]) -> list[EditSummary]:
    kinds = list(cfg.kinds) + (["all"] if len(cfg.kinds) > 1 else [])
    return [summarize(records, k, c, cfg.seed) for k in kinds for c in cfg.caches]


def summary_markdown(rows: list[EditSummary]) -> str:
    head = ["kind", "cache", "cases", "prompt tok", "unchanged tok", "edit tok", "exact prefix tok", "reused tok",
            "served of unchanged", "case mean [95% CI]", "worst case", "unserved before / after edit",
            "TTFT ms (full prefill)", "first token = full", "greedy match"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in rows:
        ci = s.served_share_mean
        lines.append("| " + " | ".join([
            s.kind, s.cache, str(s.cases), f"{s.prompt_tokens:.0f}", f"{s.unchanged_tokens:.0f}",
            f"{s.edit_tokens:.1f}",
            f"{s.prefix_tokens:.0f}", f"{s.reused_tokens:.0f}", f"**{s.served_share:.1%}**",
            f"{ci.mean:.1%} [{ci.low:.1%}, {ci.high:.1%}]", f"{s.min_case_share:.1%}",
            f"{s.unserved_before_edit:.1f} / {s.unserved_after_edit:.1f}",
            f"{s.ttft_ms:.0f} ({s.full_prefill_ttft_ms:.0f})", f"{s.first_token_agreement:.0%}",
            f"{s.match_len:.1f} / {s.fidelity_tokens}"]) + " |")
    notes = [f"served of unchanged: request 2's tokens unchanged from request 1 (token diff) that came from cache "
             f"(exact prefix or reused spans), token-weighted over cases; target {TARGET_SHARE:.0%}. Token counts "
             f"are means per case; unserved before / after edit: unchanged tokens not served, per case."]
    for s in rows:
        if s.cache == "sparsex" and s.kind != "all":
            notes.append(f"{s.kind} / sparsex: {'meets' if s.meets_target else 'MISSES'} the {TARGET_SHARE:.0%} target"
                         + (f"; reuse skipped: {'; '.join(s.skipped)}" if s.skipped else ""))
    return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"


# ============================================================================ run and outputs

def _environment(cfg: EditReplayConfig) -> dict[str, Any]:
    import torch
    return {"model": cfg.model, "dtype": resolved_dtype(cfg.dtype), "threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "torch": torch.__version__,
            "load_avg": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def run_edit_replay(cfg: EditReplayConfig, engines: EngineCache | None = None) -> list[EditSummary]:
    """Replay every case under every cache mode; with `cfg.out`, write results.json and summary.md.
    `engines`: reuse engines across calls (tests); each mode's engine is released after use."""
    cfg.verify()
    t0 = time.time()
    engines = engines or EngineCache(cfg.model, cfg.dtype)
    prompts, records = replay(cfg, engines)
    rows = summaries(cfg, records)
    if cfg.out is not None:
        os.makedirs(cfg.out, exist_ok=True)
        env = {**_environment(cfg), "wall_seconds": round(time.time() - t0, 1)}
        doc = {"config": dataclasses.asdict(cfg), "environment": env, "target_share": TARGET_SHARE,
               "summaries": [{**dataclasses.asdict(s), "ttft_ratio": s.ttft_ratio} for s in rows],
               "cases": [{"case_id": p.case.case_id, "kind": p.case.kind, "change": p.case.change,
                          "edited_message": p.case.edited_message, "first": list(p.case.first),
                          "second": list(p.case.second)} for p in prompts],
               "records": [{**dataclasses.asdict(r), "served_share": r.served_share} for r in records]}
        with open(os.path.join(cfg.out, "results.json"), "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
        with open(os.path.join(cfg.out, "summary.md"), "w", encoding="utf-8") as f:
            f.write(summary_markdown(rows))
    return rows


# ============================================================================ CLI

def add_edit_replay_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `edit` under `sparsex bench`; the handler is `run_edit_replay_cli`."""
    d = EditReplayConfig()
    p = subparsers.add_parser(
        "edit", help="edit replay: share of unchanged tokens served from cache after a few-token edit",
        description="A chat conversation sent again with an earlier message edited in a few tokens, and an agent "
                    "tool result sent again with only its request id and timestamp changed: the share of the "
                    "unchanged tokens served from cache per cache mode, TTFT, and greedy agreement with full prefill.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--kinds", default=",".join(d.kinds), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--caches", default=",".join(d.caches), help=f"comma-separated cache modes, of {', '.join(CACHES)}")
    p.add_argument("--cases", type=int, default=d.cases, help="cases per kind")
    p.add_argument("--seed", type=int, default=d.seed)
    add_engine_flag(p, "model")
    add_engine_flag(p, "dtype")
    p.add_argument("--chat-tokens", type=int, default=d.chat_tokens,
                   help="chat: tokens of turns before request 1's last message, at least")
    p.add_argument("--results-per-call", type=int, default=d.results_per_call,
                   help="agent: search results per tool message")
    p.add_argument("--fidelity-tokens", type=int, default=d.fidelity_tokens,
                   help="greedy tokens of request 2 compared with full prefill")
    add_threads_arg(p)
    p.add_argument("--out", required=True, help="directory for results.json and summary.md")
    p.set_defaults(func=run_edit_replay_cli)
    return p


def config_from_args(args: argparse.Namespace) -> EditReplayConfig:
    cfg = EditReplayConfig(kinds=parse_names(args.kinds, KINDS, "--kinds"),
                           caches=parse_names(args.caches, CACHES, "--caches"), cases=args.cases, seed=args.seed,
                           model=args.model, dtype=args.dtype, chat_tokens=args.chat_tokens,
                           results_per_call=args.results_per_call, fidelity_tokens=args.fidelity_tokens, out=args.out)
    cfg.verify()
    return cfg


def run_edit_replay_cli(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)             # before anything loads
    from sparsex.models.loader import resolve_model_name
    resolve_model_name(cfg.model)
    set_threads(args.threads)
    rows = run_edit_replay(cfg)
    print(summary_markdown(rows), end="")
    print(f"outputs: {cfg.out}/ (results.json, summary.md)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m sparsex.bench.edit_replay ...` (same options as `sparsex bench edit`)."""
    from sparsex.bench import module_main
    return module_main("edit_replay", "edit", add_edit_replay_parser, argv)


if __name__ == "__main__":
    sys.exit(main())
