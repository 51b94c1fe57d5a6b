"""Deterministic benchmark workloads whose prompts are made of recurring segments.

Every workload is a list of `Request`s. A request's ``segments`` are the
reusable units of its prompt (system prompt, each passage, each tool schema,
each message, ...) and concatenate to exactly what the tokenizer's chat
template renders for its ``messages`` (plus the generation cue), so the
segment path (``{"segments": [...]}``) and the chat path see the same tokens.

* `rag_workload`: k Zipf-popular Wikipedia passages in random order + a question
  answerable from one of them.
* `chat_workload`: multi-user conversations about Wikipedia topics, history
  truncated to a token budget, several deployments (system prompts).
* `agent_workload`: BFCL tool schemas + few-shot calls in varying order +
  BFCL multi-hop questions whose search steps return Zipf-popular documents.

All randomness flows from one ``numpy.random.Generator`` seeded by ``seed``,
so the same arguments give identical requests.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparsex.bench.datasets import (
    WikiEntry,
    bfcl_api_names,
    load_bfcl_call_examples,
    load_bfcl_tool_docs,
    load_bfcl_web_search_tasks,
    load_wiki_entries,
)

Message = dict[str, str]


@dataclass(frozen=True)
class Request:
    """One LLM call of a workload."""

    request_id: str
    workload: str  # "rag" | "chat" | "agent"
    segments: list[str]  # the prompt as ordered reusable pieces
    messages: list[Message]  # the same prompt as an OpenAI-style message list
    reference_answer: str | None = None
    user: str | None = None
    session: str | None = None
    turn: int = 0  # index of this call within its session
    # the units whose recurrence the bench measures, in prompt order (rag: passages; agent: search
    # results), and the rag question alone: `sparsex.bench.prompt_forms` lays them out in one message
    passages: tuple[str, ...] = ()
    question: str | None = None
    form: str = "explicit"  # sparsex.bench.prompt_forms.PROMPT_FORMS

    def prompt_text(self) -> str:
        return "".join(self.segments)

    def engine_prompt(self) -> dict[str, list[str]]:
        return {"segments": list(self.segments)}


# --------------------------------------------------------------------------- chat format

_SENTINEL = "\ue000SPARSEX\ue000"  # private-use chars: never in real text


@dataclass(frozen=True)
class ChatFormat:
    """A chat template's wrapping of one message, as literal prefix/suffix text.

    Derived once from the tokenizer so each message can be rendered on its own
    and the pieces still concatenate to the template's full rendering.
    """

    wrappers: dict[str, tuple[str, str]]  # role -> (prefix, suffix)
    generation_cue: str  # what add_generation_prompt appends

    def render(self, role: str, content: str) -> str:
        prefix, suffix = self.wrappers[role]
        return prefix + content + suffix

    @staticmethod
    def plain() -> ChatFormat:
        # For tokenizers without a chat template: "Role: content" blocks.
        roles = ("system", "user", "assistant", "tool")
        return ChatFormat({r: (f"{r.capitalize()}: ", "\n\n") for r in roles}, "Assistant: ")

    @staticmethod
    def from_tokenizer(tokenizer: Any) -> ChatFormat:
        if not getattr(tokenizer, "chat_template", None):
            return ChatFormat.plain()
        try:
            return ChatFormat._derive(tokenizer)
        except Exception:  # template rejects a role or renders non-locally
            return ChatFormat.plain()

    @staticmethod
    def _derive(tokenizer: Any) -> ChatFormat:
        def render(msgs: list[Message], cue: bool = False) -> str:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=cue)

        # Always render behind a system message: some templates inject a
        # default system prompt when the first message is not one.
        system = [{"role": "system", "content": _SENTINEL}]
        base = render(system)
        pre, post = base.split(_SENTINEL)
        wrappers = {"system": (pre, post)}
        for role in ("user", "assistant", "tool"):
            full = render(system + [{"role": role, "content": _SENTINEL + "x"}])
            if not full.startswith(base):
                raise ValueError(f"template is not message-local: {full!r}")
            pre, post = full[len(base):].split(_SENTINEL + "x")
            wrappers[role] = (pre, post)
        probe = system + [{"role": "user", "content": "x"}]
        with_cue, without = render(probe, cue=True), render(probe)
        if not with_cue.startswith(without):
            raise ValueError(f"generation cue is not a suffix: {with_cue!r}")
        return ChatFormat(wrappers, with_cue[len(without):])


# --------------------------------------------------------------------------- helpers


def _check(cond: bool, name: str, value: Any, why: str) -> None:
    if not cond:
        raise ValueError(f"{name}={value!r}: {why}")


def _zipf_weights(n: int, a: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** a
    return w / w.sum()


def _token_counter(tokenizer: Any) -> Any:
    cache: dict[str, int] = {}

    def count(text: str) -> int:
        if text not in cache:
            cache[text] = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        return cache[text]

    return count


def _interleave(sessions: list[list[Request]], rng: np.random.Generator) -> list[Request]:
    """Merge sessions into one arrival order, keeping each session's own order.

    Picking the next session with probability proportional to its remaining
    calls gives a uniformly random interleaving.
    """
    queues = [list(s) for s in sessions if s]
    cursor = [0] * len(queues)
    remaining = np.array([len(q) for q in queues], dtype=np.float64)
    out = []
    while remaining.sum() > 0:
        i = int(rng.choice(len(queues), p=remaining / remaining.sum()))
        out.append(queues[i][cursor[i]])
        cursor[i] += 1
        remaining[i] -= 1
    return out


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"“(])")


def split_sentences(text: str) -> list[str]:
    """Naive sentence split; good enough to cut extracts into turns."""
    return [s for s in _SENTENCE_END.split(text.strip()) if s]


def is_answerable(entry: WikiEntry) -> bool:
    """Whether an entry's description makes a non-trivial short answer.

    Excludes empty/one-word descriptions and ones that just repeat the title.
    """
    d = entry.description
    return 2 <= len(d.split()) <= 12 and entry.title.lower() not in d.lower()


# --------------------------------------------------------------------------- rag


@dataclass(frozen=True)
class Passage:
    """Consecutive same-topic wiki entries, each under a title line."""

    passage_id: int
    topic: str
    entries: tuple[WikiEntry, ...]
    text: str
    num_tokens: int


def _entry_block(e: WikiEntry) -> str:
    return f"Title: {e.title}\n{e.extract}"


_PASSAGE_SEP = "\n\n"


def _topic_passages(
    entries: list[WikiEntry], count: Any, min_tokens: int, max_tokens: int
) -> Iterator[tuple[WikiEntry, ...]]:
    """Greedily pack a topic's entries into passages of [min, max] tokens."""
    sep = count(_PASSAGE_SEP)
    cur: list[WikiEntry] = []
    cur_tokens = 0
    for e in entries:
        n = count(_entry_block(e))
        if n > max_tokens:
            continue  # a single over-long summary can never fit
        extra = n if not cur else sep + n
        if cur_tokens + extra <= max_tokens:
            cur.append(e)
            cur_tokens += extra
            continue
        if cur_tokens >= min_tokens:
            yield tuple(cur)
            cur, cur_tokens = [e], n
        # else: skip e and keep filling `cur` with the next (smaller) entries
    if cur and cur_tokens >= min_tokens:
        yield tuple(cur)


# Cached: tokenizing the corpus dominates a workload's cost and is seed-independent.
@functools.lru_cache(maxsize=8)
def build_passages(
    tokenizer: Any, num_passages: int, min_tokens: int = 300, max_tokens: int = 500
) -> tuple[Passage, ...]:
    """The first ``num_passages`` passages, taken round-robin over topics.

    Round-robin keeps a small corpus topic-diverse while tokenizing only the
    text it needs. Only passages with an answerable entry are kept, so any
    passage can be the one a question is asked about. Seed-independent.
    """
    _check(num_passages >= 1, "num_passages", num_passages, "must be >= 1")
    _check(min_tokens >= 1, "min_tokens", min_tokens, "must be >= 1")
    _check(max_tokens >= min_tokens, "max_tokens", max_tokens, f"must be >= min_tokens={min_tokens}")
    entries = load_wiki_entries()
    # Cheap bound first (a passage holds at least one entry): an absurd
    # request fails without tokenizing the whole corpus.
    _check(num_passages <= len(entries), "num_passages", num_passages, f"only {len(entries)} entries")
    count = _token_counter(tokenizer)
    by_topic: dict[str, list[WikiEntry]] = {}
    for e in entries:
        by_topic.setdefault(e.topic, []).append(e)
    streams = [_topic_passages(es, count, min_tokens, max_tokens) for es in by_topic.values()]
    out: list[Passage] = []
    while streams and len(out) < num_passages:
        alive = []
        for stream in streams:
            group = next(stream, None)
            if group is None:
                continue
            alive.append(stream)
            if not any(is_answerable(e) for e in group):
                continue
            text = _PASSAGE_SEP.join(_entry_block(e) for e in group)
            n = count(text)
            # Summed block counts can differ from the joined text's by a token
            # at a seam; the bound is on the real count.
            if min_tokens <= n <= max_tokens and len(out) < num_passages:
                out.append(Passage(len(out), group[0].topic, group, text, n))
        streams = alive
    _check(
        len(out) == num_passages, "num_passages", num_passages,
        f"the wiki data yields only {len(out)} passages of {min_tokens}-{max_tokens} tokens",
    )
    return tuple(out)


RAG_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the user's question using only the "
    "passages they provide. Reply in a few words."
)


def rag_query(entry: WikiEntry) -> str:
    who = "who" if entry.topic == "People" else "what"
    return f"In a few words, {who} is {entry.title}?"


def rag_question(entry: WikiEntry) -> str:
    return f"Question: {rag_query(entry)}\nAnswer:"


def rag_workload(
    tokenizer: Any,
    num_queries: int = 100,
    k: int = 8,
    num_passages: int = 500,
    zipf_a: float = 1.1,
    seed: int = 0,
    min_passage_tokens: int = 300,
    max_passage_tokens: int = 500,
) -> list[Request]:
    """RAG queries: system prompt, k distinct passages, then a question.

    Passage popularity is Zipf(zipf_a) over a seeded permutation of the
    corpus; the k passages are drawn without replacement and shuffled. The
    question asks for the short description of an entry in one of them.
    """
    _check(num_queries >= 1, "num_queries", num_queries, "must be >= 1")
    _check(k >= 1, "k", k, "must be >= 1")
    _check(num_passages >= k, "num_passages", num_passages, f"must be >= k={k}")
    _check(zipf_a >= 0, "zipf_a", zipf_a, "must be >= 0")
    passages = build_passages(tokenizer, num_passages, min_passage_tokens, max_passage_tokens)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    rng = np.random.default_rng(seed)
    by_rank = rng.permutation(num_passages)  # rank r -> passage id
    popularity = _zipf_weights(num_passages, zipf_a)
    user_pre, user_post = fmt.wrappers["user"]
    head = fmt.render("system", RAG_SYSTEM_PROMPT) + user_pre

    requests = []
    for q in range(num_queries):
        ranks = rng.choice(num_passages, size=k, replace=False, p=popularity)
        chosen = [passages[int(by_rank[r])] for r in ranks]
        rng.shuffle(chosen)  # draw order would leak popularity into position
        target = chosen[int(rng.integers(k))]
        candidates = [e for e in target.entries if is_answerable(e)]
        entry = candidates[int(rng.integers(len(candidates)))]
        question = rag_question(entry)
        bodies = [p.text + _PASSAGE_SEP for p in chosen]
        requests.append(
            Request(
                request_id=f"rag-{q}",
                workload="rag",
                segments=[head, *bodies, question + user_post + fmt.generation_cue],
                messages=[
                    {"role": "system", "content": RAG_SYSTEM_PROMPT},
                    {"role": "user", "content": "".join(bodies) + question},
                ],
                reference_answer=entry.description,
                user=f"user-{q}",
                session=f"rag-{q}",
                passages=tuple(p.text for p in chosen),
                question=rag_query(entry),
            )
        )
    return requests


# --------------------------------------------------------------------------- chat

# One per deployment: the same conversation served by different products.
CHAT_SYSTEM_PROMPTS = (
    "You are a friendly encyclopedia assistant. Answer conversationally and stay factual.",
    "You are a study helper for high-school students. Explain topics clearly and accurately.",
    "You are a concise research assistant. Give precise, well-sourced facts.",
    "You are a museum guide chatbot. Share interesting facts with visitors in plain language.",
    "You are a trivia companion. Keep answers short, correct and engaging.",
)

FOLLOW_UPS = (
    "Tell me more.",
    "What else should I know about it?",
    "Interesting. Go on, please.",
    "Anything else worth knowing?",
)


@dataclass(frozen=True)
class _Topic:
    entry: WikiEntry
    sentences: tuple[str, ...]

    def num_parts(self, per_reply: int) -> int:
        return (len(self.sentences) - 1 + per_reply - 1) // per_reply

    def turn(self, part: int, per_reply: int) -> tuple[str, str]:
        """(user, assistant) text of one part; identical for every user."""
        if part == 0:
            user = f'I read this about {self.entry.title}: "{self.sentences[0]}" Can you tell me more?'
        else:
            user = FOLLOW_UPS[(part - 1) % len(FOLLOW_UPS)]
        lo = 1 + part * per_reply
        return user, " ".join(self.sentences[lo : lo + per_reply])


@dataclass
class _Conversation:
    """Mutable per-user state while a chat workload is generated."""

    deployment: int
    history: list[tuple[str, str]] = field(default_factory=list)
    topic: _Topic | None = None
    part: int = 0


def chat_workload(
    tokenizer: Any,
    num_users: int = 8,
    turns_per_user: int = 8,
    num_deployments: int = 3,
    context_budget: int = 1024,
    num_topics: int = 200,
    zipf_a: float = 1.1,
    follow_up_prob: float = 0.5,
    sentences_per_reply: int = 2,
    seed: int = 0,
) -> list[Request]:
    """Multi-turn conversations, one request per user turn.

    Each user talks to one deployment (system prompt). A turn either follows
    up on the current topic or opens a Zipf-popular new one; user and
    assistant text come from the topic's extract, so popular turns recur
    verbatim across users. The prompt (system + kept history + new user
    message + cue) stays within ``context_budget`` tokens by dropping the
    oldest exchanges, which shifts the remaining messages' positions.
    ``reference_answer`` is the recorded reply, which is what the next turn's
    history contains (replayed, not generated, to stay deterministic).
    """
    _check(num_users >= 1, "num_users", num_users, "must be >= 1")
    _check(turns_per_user >= 1, "turns_per_user", turns_per_user, "must be >= 1")
    _check(
        1 <= num_deployments <= len(CHAT_SYSTEM_PROMPTS), "num_deployments", num_deployments,
        f"must be in [1, {len(CHAT_SYSTEM_PROMPTS)}]",
    )
    _check(context_budget >= 1, "context_budget", context_budget, "must be >= 1")
    _check(num_topics >= 2, "num_topics", num_topics, "must be >= 2")
    _check(zipf_a >= 0, "zipf_a", zipf_a, "must be >= 0")
    _check(0 <= follow_up_prob <= 1, "follow_up_prob", follow_up_prob, "must be in [0, 1]")
    _check(sentences_per_reply >= 1, "sentences_per_reply", sentences_per_reply, "must be >= 1")

    rng = np.random.default_rng(seed)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    count = _token_counter(tokenizer)
    pool = [
        _Topic(e, tuple(s))
        for e in load_wiki_entries()
        if len(s := split_sentences(e.extract)) >= 1 + sentences_per_reply
    ]
    _check(num_topics <= len(pool), "num_topics", num_topics, f"only {len(pool)} topics available")
    topics = [pool[int(i)] for i in rng.permutation(len(pool))[:num_topics]]
    popularity = _zipf_weights(num_topics, zipf_a)

    sessions: list[list[Request]] = []
    for u in range(num_users):
        conv = _Conversation(deployment=int(rng.integers(num_deployments)))
        system = CHAT_SYSTEM_PROMPTS[conv.deployment]
        system_seg = fmt.render("system", system)
        calls = []
        for t in range(turns_per_user):
            follow = (
                conv.topic is not None
                and conv.part + 1 < conv.topic.num_parts(sentences_per_reply)
                and rng.random() < follow_up_prob
            )
            if follow:
                conv.part += 1
            else:
                topic = conv.topic
                while topic is conv.topic:  # a new topic, not the current one
                    topic = topics[int(rng.choice(num_topics, p=popularity))]
                conv.topic, conv.part = topic, 0
            user_text, reply = conv.topic.turn(conv.part, sentences_per_reply)
            user_seg = fmt.render("user", user_text)
            fixed = count(system_seg) + count(user_seg) + count(fmt.generation_cue)
            _check(
                fixed <= context_budget, "context_budget", context_budget,
                f"system prompt + new message alone take {fixed} tokens",
            )
            kept = list(conv.history)
            pair_segs = [(fmt.render("user", a), fmt.render("assistant", b)) for a, b in kept]
            used = fixed + sum(count(a) + count(b) for a, b in pair_segs)
            while used > context_budget:  # drop the oldest exchange first
                a, b = pair_segs.pop(0)
                kept.pop(0)
                used -= count(a) + count(b)
            messages = [{"role": "system", "content": system}]
            for a, b in kept:
                messages += [{"role": "user", "content": a}, {"role": "assistant", "content": b}]
            messages.append({"role": "user", "content": user_text})
            calls.append(
                Request(
                    request_id=f"chat-u{u}-t{t}",
                    workload="chat",
                    segments=[
                        system_seg, *[s for pair in pair_segs for s in pair],
                        user_seg, fmt.generation_cue,
                    ],
                    messages=messages,
                    reference_answer=reply,
                    user=f"user-{u}",
                    session=f"chat-u{u}",
                    turn=t,
                )
            )
            conv.history.append((user_text, reply))
        sessions.append(calls)
    return _interleave(sessions, rng)


# --------------------------------------------------------------------------- agent

AGENT_SYSTEM_PROMPT = (
    "You are a research agent. Answer the user's question by calling the tools "
    "below, one call per turn, written as name(argument=value). When the tool "
    "results suffice, reply with the final answer instead of a call.\n\n# Tools\n"
)


def _search_result(e: WikiEntry) -> str:
    # The shape BFCL's search_engine_query returns: {"title", "href", "body"}.
    href = "https://en.wikipedia.org/wiki/" + e.title.replace(" ", "_")
    return json.dumps({"title": e.title, "href": href, "body": e.extract}, ensure_ascii=False)


def agent_workload(
    tokenizer: Any,
    num_sessions: int = 20,
    tool_apis: Sequence[str] = ("web_search", "math_api"),
    num_shots: int = 3,
    shot_pool_size: int = 12,
    results_per_call: int = 3,
    num_docs: int = 300,
    zipf_a: float = 1.1,
    seed: int = 0,
) -> list[Request]:
    """Agent sessions over BFCL tools, one request per LLM call.

    Each session is a BFCL multi-hop web-search question. The system message
    holds the fixed prompt, the real BFCL function docs of ``tool_apis`` (one
    segment per function, same order in every session) and ``num_shots``
    BFCL question/call examples from a shared pool in a per-session order.
    Call i searches for BFCL's i-th sub-question; BFCL records no search
    results, so each search returns ``results_per_call`` Wikipedia summaries
    drawn by Zipf popularity (as search results do, popular documents recur
    across sessions, at different positions). A session with h hops makes
    h + 1 calls: one per search, then the final answer. Results are not
    relevance-ranked, so there is no reference answer.
    """
    _check(num_sessions >= 1, "num_sessions", num_sessions, "must be >= 1")
    _check(len(tool_apis) >= 1, "tool_apis", tool_apis, "must name at least one BFCL api")
    for api in tool_apis:
        _check(api in bfcl_api_names(), "tool_apis", tool_apis, f"unknown api {api!r}")
    shots_all = load_bfcl_call_examples("simple_python")
    _check(
        1 <= shot_pool_size <= len(shots_all), "shot_pool_size", shot_pool_size,
        f"must be in [1, {len(shots_all)}]",
    )
    _check(0 <= num_shots <= shot_pool_size, "num_shots", num_shots, f"must be in [0, {shot_pool_size}]")
    _check(
        1 <= results_per_call <= num_docs, "results_per_call", results_per_call,
        f"must be in [1, num_docs={num_docs}]",
    )
    entries = load_wiki_entries()
    _check(num_docs <= len(entries), "num_docs", num_docs, f"only {len(entries)} documents")
    _check(zipf_a >= 0, "zipf_a", zipf_a, "must be >= 0")

    rng = np.random.default_rng(seed)
    fmt = ChatFormat.from_tokenizer(tokenizer)
    tasks = load_bfcl_web_search_tasks()
    task_order = rng.permutation(len(tasks))
    pool = [shots_all[int(i)] for i in rng.permutation(len(shots_all))[:shot_pool_size]]
    docs = [entries[int(i)] for i in rng.permutation(len(entries))[:num_docs]]
    popularity = _zipf_weights(num_docs, zipf_a)

    sys_pre, sys_post = fmt.wrappers["system"]
    tool_segs = [
        json.dumps(doc, ensure_ascii=False) + "\n"
        for api in tool_apis
        for doc in load_bfcl_tool_docs(api)
    ]
    # The header rides on the last tool doc so it costs no segment of its own.
    tool_segs[-1] += "\n# Examples\n" if num_shots else ""
    head = [sys_pre + AGENT_SYSTEM_PROMPT, *tool_segs]
    head_text = AGENT_SYSTEM_PROMPT + "".join(tool_segs)

    sessions: list[list[Request]] = []
    for s in range(num_sessions):
        task = tasks[int(task_order[s % len(tasks)])]
        shot_segs = [
            f"User: {pool[int(i)].question}\nCall: {pool[int(i)].call}\n\n"
            for i in rng.choice(shot_pool_size, size=num_shots, replace=False)
        ]
        system_content = head_text + "".join(shot_segs)
        # The system suffix rides on the session's question: both recur together.
        first = sys_post + fmt.render("user", task.question)
        segments = [*head, *shot_segs, first]
        messages = [
            {"role": "system", "content": system_content},
            {"role": "user", "content": task.question},
        ]
        calls = []
        for step in range(len(task.subquestions) + 1):
            calls.append(
                Request(
                    request_id=f"agent-s{s}-c{step}",
                    workload="agent",
                    segments=[*segments, fmt.generation_cue],
                    messages=list(messages),
                    user=f"user-{s}",
                    session=f"agent-s{s}",
                    turn=step,
                    passages=tuple(m["content"] for m in messages if m["role"] == "tool"),
                )
            )
            if step == len(task.subquestions):
                break
            call = f"search_engine_query(keywords={task.subquestions[step]!r})"
            results = [
                _search_result(docs[int(i)])
                for i in rng.choice(num_docs, size=results_per_call, replace=False, p=popularity)
            ]
            rng.shuffle(results)
            segments += [fmt.render("assistant", call), *(fmt.render("tool", r) for r in results)]
            messages += [{"role": "assistant", "content": call}]
            messages += [{"role": "tool", "content": r} for r in results]
        sessions.append(calls)
    return _interleave(sessions, rng)
