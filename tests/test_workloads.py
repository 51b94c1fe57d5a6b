"""Benchmark workloads: deterministic, real text, and segments that recur."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from sparsex.bench import datasets
from sparsex.bench.workloads import (
    CHAT_SYSTEM_PROMPTS,
    agent_workload,
    build_passages,
    chat_workload,
    rag_workload,
)

pytestmark = pytest.mark.unit


def n_tokens(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False)["input_ids"])


def assert_template_consistent(tok, requests):
    # The segment path and the chat path must see the very same prompt.
    for r in requests:
        expected = tok.apply_chat_template(r.messages, tokenize=False, add_generation_prompt=True)
        assert r.prompt_text() == expected, r.request_id


# --------------------------------------------------------------------------- datasets


def test_datasets_load_real_text():
    entries = datasets.load_wiki_entries()
    assert len(entries) > 9000
    assert all(e.title and e.extract for e in entries)
    assert any(e.description == "Art movement" for e in entries)
    docs = datasets.load_bfcl_tool_docs("web_search")
    assert [d["name"] for d in docs] == ["search_engine_query", "fetch_url_content"]
    tasks = datasets.load_bfcl_web_search_tasks()
    assert len(tasks) == 100 and all(len(t.subquestions) >= 2 for t in tasks)
    shots = datasets.load_bfcl_call_examples()
    assert shots[1].call == "math.factorial(number=5)"
    payloads = datasets.load_chat_payloads("gsm8k")
    assert len(payloads) == 1319 and payloads[0]["messages"][0]["role"] == "user"
    with pytest.raises(ValueError, match="nope"):
        datasets.load_chat_payloads("nope")
    with pytest.raises(ValueError, match="nope"):
        datasets.load_bfcl_tool_docs("nope")


# --------------------------------------------------------------------------- rag


def test_rag_deterministic(tok):
    a = rag_workload(tok, num_queries=20, seed=1)
    assert a == rag_workload(tok, num_queries=20, seed=1)
    assert a != rag_workload(tok, num_queries=20, seed=2)


def test_passages_within_token_bounds(tok):
    passages = build_passages(tok, 200, 300, 500)
    assert len(passages) == 200
    for p in passages:
        assert 300 <= n_tokens(tok, p.text) <= 500
        assert p.num_tokens == n_tokens(tok, p.text)
        assert all(e.topic == p.topic and f"Title: {e.title}\n" in p.text for e in p.entries)
    assert len({p.topic for p in passages}) >= 10  # round-robin keeps it diverse


def test_rag_queries_hold_their_answer(tok):
    reqs = rag_workload(tok, num_queries=60, k=8, num_passages=300, seed=0)
    passages = {p.text: p for p in build_passages(tok, 300, 300, 500)}
    assert_template_consistent(tok, reqs)
    for r in reqs:
        body = r.segments[1:-1]
        assert len(body) == 8 and len(set(body)) == 8  # k distinct passages
        chosen = [passages[s.removesuffix("\n\n")] for s in body]
        question = r.segments[-1]
        answering = [
            e for p in chosen for e in p.entries
            if f" is {e.title}?" in question and e.description == r.reference_answer
        ]
        assert answering, r.request_id
        assert len(r.reference_answer.split()) >= 2


def test_rag_zipf_skew_and_random_order(tok):
    reqs = rag_workload(tok, num_queries=100, k=8, num_passages=300, zipf_a=1.1, seed=3)
    counts = Counter(s for r in reqs for s in r.segments[1:-1])
    freq = sorted(counts.values(), reverse=True) + [0] * (300 - len(counts))
    median = sorted(freq)[len(freq) // 2]
    assert freq[0] >= 50 and freq[0] >= 10 * max(median, 1)
    top = counts.most_common(1)[0][0]
    positions = {r.segments.index(top) for r in reqs if top in r.segments}
    assert len(positions) >= 4  # the popular passage moves around


def test_rag_bad_parameters(tok):
    for kwargs in (
        {"k": 0}, {"num_queries": 0}, {"num_passages": 4, "k": 8},
        {"zipf_a": -1.0}, {"num_passages": 10**6},
    ):
        with pytest.raises(ValueError):
            rag_workload(tok, **kwargs)
    with pytest.raises(ValueError):
        build_passages(tok, 10, 500, 300)


# --------------------------------------------------------------------------- chat


def test_chat_deterministic(tok):
    a = chat_workload(tok, num_users=4, turns_per_user=5, seed=1)
    assert a == chat_workload(tok, num_users=4, turns_per_user=5, seed=1)
    assert a != chat_workload(tok, num_users=4, turns_per_user=5, seed=2)


def test_chat_budget_and_recurrence(tok):
    budget = 400
    reqs = chat_workload(
        tok, num_users=8, turns_per_user=8, num_deployments=3,
        context_budget=budget, num_topics=30, seed=0,
    )
    assert len(reqs) == 64
    assert_template_consistent(tok, reqs)
    sessions = defaultdict(list)
    for r in reqs:
        assert n_tokens(tok, r.prompt_text()) <= budget
        assert r.messages[0]["content"] in CHAT_SYSTEM_PROMPTS
        sessions[r.session].append(r)
    # Arrival order interleaves users but keeps each conversation in order.
    assert all([r.turn for r in s] == list(range(8)) for s in sessions.values())
    assert len({r.messages[0]["content"] for r in reqs}) >= 2
    # Truncation happened: some turn lost the oldest exchange of the one before.
    dropped = any(
        len(b.messages) <= len(a.messages)
        for s in sessions.values() for a, b in zip(s, s[1:])
    )
    assert dropped
    # A message segment recurs at different positions (across turns or users).
    where = defaultdict(set)
    for r in reqs:
        for i, seg in enumerate(r.segments[1:-1], start=1):
            where[seg].add((r.session, i))
    moved = [s for s, pos in where.items() if len({i for _, i in pos}) > 1]
    shared = [s for s, pos in where.items() if len({u for u, _ in pos}) > 1]
    assert moved and shared


def test_chat_bad_parameters(tok):
    for kwargs in (
        {"num_users": 0}, {"num_deployments": 0}, {"num_deployments": 99},
        {"follow_up_prob": 1.5}, {"context_budget": 10}, {"num_topics": 1},
    ):
        with pytest.raises(ValueError):
            chat_workload(tok, **kwargs)


# --------------------------------------------------------------------------- agent


def test_agent_deterministic(tok):
    a = agent_workload(tok, num_sessions=6, seed=1)
    assert a == agent_workload(tok, num_sessions=6, seed=1)
    assert a != agent_workload(tok, num_sessions=6, seed=2)


def test_agent_shared_tools_and_recurring_results(tok):
    reqs = agent_workload(tok, num_sessions=30, num_docs=100, seed=0)
    assert_template_consistent(tok, reqs)
    n_tools = len(datasets.load_bfcl_tool_docs("web_search")) + len(
        datasets.load_bfcl_tool_docs("math_api")
    )
    head = reqs[0].segments[: 1 + n_tools]
    assert all(r.segments[: 1 + n_tools] == head for r in reqs)  # schemas shared
    assert '"name": "search_engine_query"' in head[1]
    # Few-shot examples come from one pool in per-session order.
    shot_orders = {tuple(r.segments[1 + n_tools : 4 + n_tools]) for r in reqs}
    assert len(shot_orders) > 1
    assert all(s.startswith("User: ") for order in shot_orders for s in order)
    # Search results recur across sessions, at different positions and orders.
    where = defaultdict(set)
    for r in reqs:
        for i, seg in enumerate(r.segments):
            if seg.startswith("<|im_start|>tool\n"):
                where[seg].add((r.session, i))
    recurring = [s for s, pos in where.items() if len({sess for sess, _ in pos}) > 1]
    assert recurring
    assert any(len({i for _, i in where[s]}) > 1 for s in recurring)
    # Each session: one call per hop plus the final answer, each extending the last.
    sessions = defaultdict(list)
    for r in reqs:
        sessions[r.session].append(r)
    for calls in sessions.values():
        for a, b in zip(calls, calls[1:]):
            assert b.segments[: len(a.segments) - 1] == a.segments[:-1]


def test_agent_bad_parameters(tok):
    for kwargs in (
        {"num_sessions": 0}, {"tool_apis": ()}, {"tool_apis": ("nope",)},
        {"num_shots": 20, "shot_pool_size": 12}, {"results_per_call": 0},
        {"num_docs": 10**6},
    ):
        with pytest.raises(ValueError):
            agent_workload(tok, **kwargs)
