"""Prompt forms of the workload bench: one-message layouts of the same units, and which tokens recur."""
from __future__ import annotations

import numpy as np
import pytest

from sparsex.bench.prompt_forms import (PROMPT_FORMS, agent_messages, apply_form, rag_messages, recurring_masks,
                                        served_mask, unit_mask, verify_prompt_form)
from sparsex.bench.workloads import Request
from sparsex.outputs import ReusedSpan

pytestmark = pytest.mark.unit

PASSAGES = ["Paris is the capital of France.", "Berlin is the capital of Germany.", "Rome is in Italy."]


@pytest.mark.parametrize("form", [f for f in PROMPT_FORMS if f != "explicit"])
def test_rag_forms_hold_every_passage_and_the_question_in_order(form) -> None:
    msgs = rag_messages(form, "Answer briefly.", PASSAGES, "What is Berlin?")
    text = "\n".join(m["content"] for m in msgs)
    at = [text.index(p) for p in PASSAGES]
    assert at == sorted(at)
    assert "\n\n".join(PASSAGES) in text               # joined by a blank line, as LangChain and LlamaIndex do
    assert "What is Berlin?" in text
    assert len([m for m in msgs if PASSAGES[0] in m["content"]]) == 1      # all in ONE message
    if form == "stuffed":
        assert msgs[0]["role"] == "system" and msgs[1]["content"] == "What is Berlin?"
    elif form == "question-first":
        assert msgs[1]["content"].index("What is Berlin?") < msgs[1]["content"].index(PASSAGES[0])
    else:
        assert msgs[1]["content"].index(PASSAGES[-1]) < msgs[1]["content"].index("Query: What is Berlin?")


@pytest.mark.parametrize("form", ["stuffed", "question-first", "llamaindex"])
def test_agent_forms_put_each_calls_results_in_one_tool_message(form) -> None:
    msgs = [{"role": "system", "content": "tools"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "search(a)"}, {"role": "tool", "content": "r1"},
            {"role": "tool", "content": "r2"}, {"role": "assistant", "content": "search(b)"},
            {"role": "tool", "content": "r3"}]
    out = agent_messages(form, msgs)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool", "assistant", "tool"]
    assert "r1\n\nr2" in out[3]["content"] and "r3" in out[5]["content"]
    if form == "question-first":
        assert out[3]["content"].startswith("Results for search(a)")


def test_apply_form_keeps_the_content_and_marks_the_form() -> None:
    r = Request("rag-0", "rag", ["h", *PASSAGES, "q"], [{"role": "system", "content": "sys"},
                {"role": "user", "content": "".join(PASSAGES) + "q"}], passages=tuple(PASSAGES), question="q?")
    assert apply_form([r], "explicit") == [r]
    (s,) = apply_form([r], "stuffed")
    assert s.form == "stuffed" and s.segments == r.segments and s.passages == r.passages
    assert s.messages[0]["content"].startswith("sys\n\n")
    with pytest.raises(ValueError, match="needs its question"):
        apply_form([Request("rag-1", "rag", ["x"], r.messages, passages=tuple(PASSAGES))], "stuffed")


def test_verify_prompt_form_names_the_bad_value() -> None:
    for form in PROMPT_FORMS:
        verify_prompt_form(form, "rag")
    with pytest.raises(ValueError, match="unknown prompt form 'json'"):
        verify_prompt_form("json", "rag")
    with pytest.raises(ValueError, match="workload 'chat'"):
        verify_prompt_form("stuffed", "chat")
    verify_prompt_form("explicit", "chat")


def test_unit_and_recurring_masks_follow_character_offsets() -> None:
    text = "AAAA BB CCCC"
    offsets = np.array([[0, 2], [2, 4], [4, 5], [5, 7], [7, 8], [8, 12]])
    assert unit_mask(text, offsets, ["AAAA", "CCCC"]).tolist() == [True, True, False, False, False, True]
    # a token straddling the unit's edge is not inside it
    assert unit_mask(text, np.array([[3, 6]]), ["AAAA"]).tolist() == [False]
    with pytest.raises(ValueError, match="not found"):
        unit_mask(text, offsets, ["DDDD"])
    r1 = Request("a", "rag", [], [], passages=("AAAA",))
    r2 = Request("b", "rag", [], [], passages=("AAAA", "CCCC"))
    m1, m2 = recurring_masks([r1, r2], ["AAAA", text], [offsets[:2], offsets], set())
    assert not m1.any()                                 # first sight: nothing recurs yet
    assert m2.tolist() == [True, True, False, False, False, False]   # AAAA recurs, CCCC is new
    _, m2 = recurring_masks([r1, r2], ["AAAA", text], [offsets[:2], offsets], {"CCCC"})
    assert m2.tolist() == [True, True, False, False, False, True]    # ingested units recur from the start


def test_served_mask_is_the_prefix_and_every_span() -> None:
    assert served_mask(8, 2, [ReusedSpan(4, 6, "request")]).tolist() == [True, True, False, False, True, True, False, False]
    assert not served_mask(3, 0, []).any()
