"""Transparent segment reuse on the real model: spans found by content inside unmarked prompts
(one message holding every passage), with the exactness oracles of every cache path."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from sparsex import LLM, SamplingParams
from sparsex.bench.fidelity import pieces_prompt, run_to_completion
from sparsex.inputs import TokenizedPrompt
from sparsex.segment import span_index

pytestmark = pytest.mark.model

ONE = SamplingParams(temperature=0.0, max_tokens=1)
SOURCES = {"indexed", "request"}


@pytest.fixture(scope="module")
def llm_tx(smollm2):
    # short passages (~150 tokens): blend every hit, as test_segment_reuse.py does
    return LLM(cache="sparsex", dtype="float32", seed=0, min_blend_tokens=0)


@pytest.fixture(autouse=True)
def _integrity(request):
    yield
    if "llm_tx" in request.fixturenames:
        request.getfixturevalue("llm_tx").llm_engine.check_integrity()


@pytest.fixture(scope="module")
def passages(wiki_texts):
    return [t[:700] for t in wiki_texts[26:32]]          # ~150 tokens each


def stuffed(engine, head: str, docs: list[str], question: str) -> TokenizedPrompt:
    """What LangChain sends: every passage in ONE piece, tokenized as a whole (no segment inside)."""
    return pieces_prompt(engine, [head + "\n\n".join(docs) + question], [False])


def served(out, docs_text: str, prompt_text: str, engine) -> float:
    """Share of the tokens of `docs_text` (inside the prompt) that were served from cache."""
    enc = engine.tokenizer(prompt_text, return_offsets_mapping=True, add_special_tokens=False)
    lo = prompt_text.index(docs_text)
    hi = lo + len(docs_text)
    inside = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if lo <= a and b <= hi]
    cached = np.zeros(len(enc["input_ids"]), dtype=bool)
    cached[:out.num_cached_tokens] = True
    for s in out.reused_spans:
        cached[s.start:s.end] = True
    return float(cached[inside].mean())


# the first passage starts past min_context_tokens (128): KV computed right after a short head is
# not reused later in a prompt (test_segment_reuse.py covers that rule)
HEAD = ("System: you answer questions about documents. Read every document below with care, quote the "
        "sentence that supports your answer, say which document it comes from, and say so when the documents "
        "do not contain the answer instead of guessing. Keep answers short: one or two sentences, no lists, "
        "no greetings. Dates and numbers must be copied exactly as the documents give them, with their units. "
        "If two documents disagree, report both and name them. Never use knowledge from outside the documents, "
        "even when you are sure of it; a reader must be able to check every claim against the text. When a "
        "question is ambiguous, answer the most likely reading and say which reading you chose. Write in the "
        "language of the question, and keep names in the spelling the documents use.\n\n")
Q = "\n\nQuestion: which document mentions the earliest year? Answer:"


def test_one_message_prompt_reuses_passages_seen_in_another_order(llm_tx, passages):
    eng = llm_tx.llm_engine
    eng.reset_cache()
    first = stuffed(eng, HEAD, passages[:4], Q)
    out1, _ = run_to_completion(eng, first, ONE)
    assert out1.num_reused_tokens == 0
    docs = [passages[2], passages[4], passages[0], passages[3]]          # three seen, one new, new order
    second = stuffed(eng, "Another product's system prompt.\n\n", docs, Q)
    out2, _ = run_to_completion(eng, second, ONE)
    assert {s.source for s in out2.reused_spans} <= SOURCES and out2.reused_spans
    ids = second.token_ids
    for s in out2.reused_spans:          # each span is a run of the earlier prompt's tokens
        run = ids[s.start:s.end]
        assert s.num_tokens >= 16 and any(first.token_ids[i:i + len(run)] == run for i in range(len(first.token_ids)))
    text = eng.tokenizer.decode(ids)
    seen = "\n\n".join(docs[:1]), docs[2], docs[3]
    shares = [served(out2, d, text, eng) for d in seen]
    assert min(shares) > 0.9, shares
    assert served(out2, docs[1], text, eng) == 0.0               # never seen: nothing to reuse
    assert out2.num_reused_tokens == sum(s.num_tokens for s in out2.reused_spans)


def test_interior_is_found_when_the_first_token_merges_differently(llm_tx, passages):
    eng = llm_tx.llm_engine
    eng.reset_cache()
    tok = eng.tokenizer
    doc = passages[5]
    a = pieces_prompt(eng, ["Notes follow. " * 12 + "\n" + doc + "\nEnd of notes."], [False])
    b_text = "Other notes: " * 12 + doc + "\nQuestion: what is it about?"
    b = pieces_prompt(eng, [b_text], [False])
    # the passage's first token depends on what precedes it
    first_a = tok.encode("\n" + doc, add_special_tokens=False)[:2]
    first_b = tok.encode(": " + doc, add_special_tokens=False)[:2]
    assert first_a != first_b
    run_to_completion(eng, a, ONE)
    out, _ = run_to_completion(eng, b, ONE)
    assert out.reused_spans and served(out, doc, tok.decode(b.token_ids), eng) > 0.9


def test_recompute_everything_with_transparent_spans_equals_plain_prefill(llm_tx, llm_none, passages):
    eng, ref = llm_tx.llm_engine, llm_none.llm_engine
    eng.reset_cache()
    run_to_completion(eng, stuffed(eng, HEAD, passages[:4], Q), ONE)
    p = stuffed(eng, "A different head, so no prefix hit.\n\n", passages[:4][::-1], Q)
    n = len(p.token_ids)
    out, got = run_to_completion(eng, p, ONE, reuse={"selector": "all"}, distributions_from=n - 8)
    assert out.num_reused_tokens > 400 and out.num_recomputed_tokens == out.num_reused_tokens
    assert {s.source for s in out.reused_spans} <= SOURCES
    _, want = run_to_completion(ref, p, ONE, distributions_from=n - 8)
    for pos in range(n - 8, n):
        torch.testing.assert_close(got[pos], want[pos], atol=2e-4, rtol=0)


def test_exact_prefix_hits_stay_exact_with_transparent_reuse(llm_tx, llm_none, passages):
    """Approximate rows are never a source and never an exact prefix: a prompt served by an exact
    prefix hit after blended traffic gives plain prefill's greedy text."""
    eng = llm_tx.llm_engine
    eng.reset_cache()
    params = SamplingParams(temperature=0, max_tokens=12)
    base = stuffed(eng, HEAD, passages[:3], Q)
    run_to_completion(eng, base, params)
    blended = stuffed(eng, "X.\n\n", passages[:3][::-1], Q)
    out_b, _ = run_to_completion(eng, blended, params)
    assert out_b.num_reused_tokens > 0
    again, _ = run_to_completion(eng, blended, params)
    # the blended request's KV from its first reused position on is approximate: the same prompt again
    # may hit exactly only the blocks before it (an exact hit is served as plain prefill's KV)
    bs = eng.kv.block_size
    first_reused = min(s.start for s in out_b.reused_spans)
    assert first_reused < len(blended.token_ids) - 4 * bs                # most of the prompt was blended
    assert again.num_cached_tokens <= first_reused // bs * bs, (again.num_cached_tokens, first_reused)
    plain, _ = run_to_completion(llm_none.llm_engine, base, params)
    repeat, _ = run_to_completion(eng, base, params)              # exact prefix hit of the first prompt
    assert repeat.num_cached_tokens > 0 and repeat.num_reused_tokens == 0
    assert repeat.outputs[0].token_ids == plain.outputs[0].token_ids


def test_forced_anchor_collision_never_reuses_wrong_kv(llm_tx, llm_none, passages, monkeypatch):
    eng = llm_tx.llm_engine
    eng.reset_cache()
    monkeypatch.setattr(span_index, "kgram_hashes",
                        lambda t: np.zeros(max(0, len(t) - span_index.KGRAM + 1), dtype=np.uint64))
    run_to_completion(eng, stuffed(eng, HEAD, passages[:2], Q), ONE)
    other = stuffed(eng, "Unrelated head.\n\n", passages[2:4], Q)        # shares no passage
    params = SamplingParams(temperature=0, max_tokens=8)
    out, _ = run_to_completion(eng, other, params)
    assert not [s for s in out.reused_spans if s.source in SOURCES]
    plain, _ = run_to_completion(llm_none.llm_engine, other, params)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    eng.reset_cache()          # drop the anchors filed under the forced hash before it is restored


def test_tenant_salt_isolates_transparent_spans(llm_tx, passages):
    eng = llm_tx.llm_engine
    eng.reset_cache()

    def salted(docs, salt, head):
        p = stuffed(eng, head, docs, Q)
        p.cache_salt = salt
        return p

    run_to_completion(eng, salted(passages[:3], "tenant:a", HEAD), ONE)
    out_b, _ = run_to_completion(eng, salted(passages[:3][::-1], "tenant:b", "B.\n\n"), ONE)
    assert out_b.num_reused_tokens == 0 and out_b.num_cached_tokens == 0
    out_a, _ = run_to_completion(eng, salted(passages[:3][::-1], "tenant:a", "A.\n\n"), ONE)   # positive control
    assert sum(s.num_tokens for s in out_a.reused_spans if s.source in SOURCES) > 200


def test_switch_turns_transparent_matching_off(llm_tx, passages):
    eng = llm_tx.llm_engine
    eng.reset_cache()
    run_to_completion(eng, stuffed(eng, HEAD, passages[:3], Q), ONE)
    p = stuffed(eng, "Another head.\n\n", passages[:3][::-1], Q)
    off, _ = run_to_completion(eng, p, ONE, reuse={"transparent_segments": False})
    assert off.num_reused_tokens == 0
    assert off.num_cached_tokens == 0
    # another head (the prompt above is now an exact prefix in the cache)
    on, _ = run_to_completion(eng, stuffed(eng, "Yet another head.\n\n", passages[:3][::-1], Q), ONE)
    assert on.num_reused_tokens > 200
    st = eng.stats()
    assert st.transparent_reused_tokens >= on.num_reused_tokens and st.span_search_seconds > 0


def test_blended_rows_are_not_a_source(llm_tx, passages):
    """A blended request indexes only what it computed in full: a later prompt finds its new passage
    but never its reused (approximate) rows through it."""
    eng = llm_tx.llm_engine
    eng.reset_cache()
    run_to_completion(eng, stuffed(eng, HEAD, passages[:2], Q), ONE)
    mixed = stuffed(eng, "Mixed.\n\n", [passages[1], passages[4], passages[0]], Q)
    out, _ = run_to_completion(eng, mixed, ONE)
    reused = [(s.start, s.end) for s in out.reused_spans]
    assert reused
    idx = eng.segment_index
    stretches = [e for e in idx.entries.values() if not e.explicit]
    assert stretches
    ids = mixed.token_ids
    for e in stretches:
        rows = np.frombuffer(e.tokens, dtype=np.int32).tolist()
        at = next(i for i in range(len(ids)) if ids[i:i + len(rows)] == rows)
        # the stretch lies in the fresh part: it overlaps no reused span
        assert all(at + len(rows) <= s or e2 <= at for s, e2 in reused)


def test_edited_conversation_reuses_later_messages_and_their_glue(llm_tx, passages):
    """A conversation re-sent with an earlier message edited: every message after the edit, and the
    chat template's glue between them, comes back as one run of the first request's KV (the whole
    messages are explicit hits too, but they would leave the glue to recompute)."""
    eng = llm_tx.llm_engine
    eng.reset_cache()
    msgs = [{"role": "system", "content": HEAD},
            {"role": "user", "content": "Tell me about this: " + passages[0]},
            {"role": "assistant", "content": passages[1]},
            {"role": "user", "content": passages[2]},
            {"role": "assistant", "content": passages[3]},
            {"role": "user", "content": "And what follows from that?"}]
    first = eng.chat_to_prompt(msgs)
    run_to_completion(eng, first, ONE)
    edited = [dict(m) for m in msgs]
    edited[1]["content"] = "Tell me all about this: " + passages[0]            # a word inserted early on
    second = eng.chat_to_prompt(edited)
    out, _ = run_to_completion(eng, second, ONE)
    text = eng.tokenizer.decode(second.token_ids)
    # from the start of the assistant message after the edit to the end of the last reply: one span
    lo = len(eng.tokenizer.encode(text[:text.index(passages[1])], add_special_tokens=False))
    hi = len(eng.tokenizer.encode(text[:text.index(passages[3]) + len(passages[3])], add_special_tokens=False))
    covering = [s for s in out.reused_spans if s.start <= lo and hi <= s.end]
    assert len(covering) == 1 and covering[0].source in SOURCES, out.reused_spans
    assert served(out, passages[0][40:], text, eng) > 0.9          # the edited message's tail too
