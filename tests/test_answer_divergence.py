"""benchmarks/answer_divergence.py: pairing a policy's rag answers with full prefill's, on synthetic runs."""
from __future__ import annotations

import pytest

from benchmarks.answer_divergence import borrowed_names, divergences, first_differing_word, report, target_passage
from sparsex.bench.workloads import Request

pytestmark = pytest.mark.unit

PASSAGES = (
    "Aceh is a province of Indonesia on Sumatra. Banda Aceh is its capital.",
    "Aconcagua is a mountain in the Andes of Argentina, in Mendoza Province.",
    "Alvar Aalto was a Finnish architect and designer, born in 1898; he never saw Indonesia.",
)


def _req(question: str) -> Request:
    return Request("rag-0", "rag", segments=[], messages=[], passages=PASSAGES, question=question,
                   reference_answer="province of Indonesia")


def _record(policy: str, index: int, answer: str, f1: float, match_len: int | None = None) -> dict:
    return dict(policy=policy, index=index, answer=answer, f1=f1, match_len=match_len)


def test_first_differing_word_and_target_passage():
    assert first_differing_word("Aceh is a province", "Aceh is a mountain") == 3
    assert first_differing_word("Aceh is", "Aceh is a province") == 2          # one is a prefix of the other
    assert first_differing_word("Banda", "Aceh") == 0
    assert target_passage(_req("In a few words, what is Aconcagua?")) == 1
    assert target_passage(_req("In a few words, who was Alvar Aalto?")) == 2    # no "what is": most shared names


def test_a_name_only_another_passage_holds_is_borrowed():
    req = _req("In a few words, what is Aceh?")
    t = target_passage(req)
    assert t == 0
    assert borrowed_names("Aceh is a mountain in Argentina near Mendoza.", req, t) == {"Argentina", "Mendoza"}
    assert borrowed_names("Aceh is a province of Indonesia.", req, t) == set()     # the target passage also holds it
    assert borrowed_names("Aceh is in Peru.", req, t) == set()                      # in no passage: not borrowed
    assert borrowed_names("Built in 1898.", req, t) == {"1898"}                     # numbers count


def test_divergences_pair_by_request_and_report_counts_them():
    reqs = [_req("In a few words, what is Aceh?")] * 3
    records = [
        _record("none", 0, "Aceh is a province of Indonesia.", 0.6),
        _record("p", 0, "Aceh is a province of Indonesia.", 0.6, 32),              # same answer: not counted
        _record("none", 1, "Aceh is a province of Indonesia.", 0.6),
        _record("p", 1, "Aceh is a mountain in Argentina.", 0.0, 3),
        _record("none", 2, "Aceh is a region.", 0.1),
        _record("p", 2, "Banda Aceh is its capital.", 0.2, 0),
    ]
    total, divs = divergences(records, reqs, "p")
    assert total == 3 and [d.index for d in divs] == [1, 2]
    worse, better = divs
    assert (worse.first_word, worse.match_len, worse.borrowed_policy, worse.borrowed_none) == (3, 3, {"Argentina"}, set())
    assert (better.first_word, better.f1_policy > better.f1_none) == (0, True)
    text = report("p", total, divs)
    assert "| answers that differ from full prefill's | 2 of 3 |" in text
    assert "| ... F1 worse / better / equal | 1 / 1 / 0 |" in text
    assert "| ... differ at the first token (teacher-forced) | 1 |" in text
    assert "| ... teacher-forced agreement before the first miss, median [min, max] tokens | 2 [0, 3] |" in text
    assert "| ... of the policy's worse answers, with a name from another passage | 1 of 1 |" in text
    untimed = [dict(r, match_len=None) for r in records]                 # a run without fidelity
    assert "| ... differ at the first token (teacher-forced) | – |" in report("p", *divergences(untimed, reqs, "p"))
    with pytest.raises(ValueError, match="'none'"):
        divergences([r for r in records if r["policy"] == "p"], reqs, "p")
