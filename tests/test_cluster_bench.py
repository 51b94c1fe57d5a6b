"""benchmarks/cluster_spans.py and cluster_nginx.py: which passage tokens count as served from cache, and
the Prometheus counters read from a replica. Loads a tokenizer only."""
from __future__ import annotations

import pytest

from benchmarks.cluster_nginx import metric_sum
from benchmarks.cluster_spans import recurring_served
from sparsex.bench.prompt_forms import token_offsets
from sparsex.inputs import chat_pieces

pytestmark = pytest.mark.unit

P1 = "Paris is the capital and largest city of France, on the Seine, with two million residents."
P2 = "Berlin is the capital of Germany and its largest city, on the Spree, with 3.8 million residents."
MESSAGE = f"Use the following context to answer the question.\n\n{P1}\n\n{P2}\n\nQuestion 0: what is in common?"


def _layout(tok) -> tuple[int, int, int]:
    """(the prompt's length, where P1's tokens start, where P2's start)."""
    pieces, _ = chat_pieces(tok, [{"role": "user", "content": MESSAGE}])
    ids, offsets = token_offsets(tok, pieces)
    text = "".join(pieces)
    first = lambda p: int((offsets[:, 0] >= text.index(p)).argmax())     # noqa: E731
    return len(ids), first(P1), first(P2)


def test_an_exact_prefix_hit_serves_the_passages_it_covers(tok):
    n, p1, p2 = _layout(tok)
    came_back, served = recurring_served(tok, MESSAGE, [P1, P2], 0, [])
    assert came_back > 0 and served == 0
    # the prefix hit ends where P2 starts: P1 is served, P2 is not; the template's head is no passage
    only_p1, _ = recurring_served(tok, MESSAGE, [P1], 0, [])
    assert recurring_served(tok, MESSAGE, [P1, P2], p2, []) == (came_back, only_p1)
    # a reused span serves P2; spans and the prefix together serve both
    assert recurring_served(tok, MESSAGE, [P1, P2], 0, [(p2, n - 1)]) == (came_back, came_back - only_p1)
    assert recurring_served(tok, MESSAGE, [P1, P2], p2, [(p2, n - 1)]) == (came_back, came_back)
    assert p1 < p2


def test_passage_tokens_are_counted_in_the_prompt_and_checked_against_the_server(tok):
    n, _, _ = _layout(tok)
    came_back, _ = recurring_served(tok, MESSAGE, [P2], 0, [], num_prompt_tokens=n)
    assert came_back > 0
    with pytest.raises(RuntimeError, match="prompt tokens"):
        recurring_served(tok, MESSAGE, [P2], 0, [], num_prompt_tokens=n + 1)


def test_metric_sum_adds_the_samples_whose_labels_match():
    text = ('# HELP sparsex:segment_store_span_records_total Records\n'
            'sparsex:segment_store_span_records_total{model_name="m",outcome="installed"} 3.0\n'
            'sparsex:segment_store_span_records_total{model_name="m",outcome="published"} 5.0\n'
            'sparsex:request_success_total{finished_reason="length",model_name="m"} 7.0\n'
            'sparsex:request_success_total{finished_reason="stop",model_name="m"} 2.0\n'
            'sparsex:request_success_created{finished_reason="stop",model_name="m"} 1.7e9\n')
    assert metric_sum(text, "sparsex:segment_store_span_records_total", outcome="installed") == 3.0
    assert metric_sum(text, "sparsex:segment_store_span_records_total", outcome="rejected") == 0.0
    assert metric_sum(text, "sparsex:request_success_total") == 9.0
