"""How an application lays out a workload's prompt, and which of its tokens recur.

The workloads (`sparsex.bench.workloads`) build each request as reusable pieces: the `explicit`
form sends them as segments, one per passage or tool result, as a client that marks its segments
does. Real applications do not: they join the retrieved documents into one message. The other
forms send the same content that way, through the engine's chat path (`sparsex.inputs.chat_prompt`,
what the server and `LLM.chat` run), so only transparent segment reuse can find the passages:

* ``stuffed``: LangChain's stuff-documents chain: the documents joined by a blank line into the
  system message, the question in the user message (agent: all results of one call in one tool
  message, joined by a blank line);
* ``question-first``: the question, then the context, in one user message (agent: the call's
  keywords head its one tool message);
* ``llamaindex``: LlamaIndex's default QA template (`compact` synthesizer): the context between
  dashed lines in one user message, then the query (agent: the results between dashed lines).

A request's recurring tokens are the tokens of its units (`Request.passages`: rag passages, agent
search results) that an earlier request, or the corpus ingestion, already held; the bench reports
the share of them the engine served from cache (exact prefix + every reused span).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from sparsex.bench.workloads import Message, Request
    from sparsex.inputs import TokenizedPrompt

PROMPT_FORMS = ("explicit", "stuffed", "question-first", "llamaindex")
FORM_WORKLOADS = ("rag", "agent")          # workloads with a one-message layout of their units
_DASHES = "---------------------"


def verify_prompt_form(form: str, workload: str) -> None:
    if form not in PROMPT_FORMS:
        raise ValueError(f"unknown prompt form {form!r}; choose one of {PROMPT_FORMS}")
    if form != "explicit" and workload not in FORM_WORKLOADS:
        raise ValueError(f"prompt form {form!r} applies to {FORM_WORKLOADS}; workload {workload!r} has only "
                         f"'explicit' (its messages are its units)")


def rag_messages(form: str, system: str, passages: list[str], question: str) -> list[Message]:
    """The messages a RAG application sends for `question` over `passages` in `form` (not explicit)."""
    context = "\n\n".join(passages)
    if form == "stuffed":
        return [{"role": "system", "content": f"{system}\n\n{context}"}, {"role": "user", "content": question}]
    if form == "question-first":
        return [{"role": "system", "content": system},
                {"role": "user", "content": f"{question}\n\nContext:\n{context}"}]
    if form == "llamaindex":
        return [{"role": "system", "content": system},
                {"role": "user", "content": (f"Context information is below.\n{_DASHES}\n{context}\n{_DASHES}\n"
                                             "Given the context information and not prior knowledge, answer the "
                                             f"query.\nQuery: {question}\nAnswer: ")}]
    raise ValueError(f"no one-message layout for prompt form {form!r}")


def agent_messages(form: str, messages: list[Message]) -> list[Message]:
    """The agent conversation with each call's results (consecutive tool messages) in one tool message."""
    out: list[Message] = []
    i = 0
    while i < len(messages):
        if messages[i]["role"] != "tool":
            out.append(dict(messages[i]))
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        docs = "\n\n".join(m["content"] for m in messages[i:j])
        call = out[-1]["content"] if out and out[-1]["role"] == "assistant" else ""
        if form == "stuffed":
            content = docs
        elif form == "question-first":
            content = f"Results for {call}:\n\n{docs}"
        elif form == "llamaindex":
            content = f"{_DASHES}\n{docs}\n{_DASHES}"
        else:
            raise ValueError(f"no one-message layout for prompt form {form!r}")
        out.append({"role": "tool", "content": content})
        i = j
    return out


def apply_form(requests: list[Request], form: str) -> list[Request]:
    """The requests in `form`: same content, one-message layout (`Request.messages`, sent through the
    chat path). `explicit` returns them unchanged (sent as `segments`)."""
    if form == "explicit":
        return requests
    out = []
    for r in requests:
        if r.workload == "rag":
            if r.question is None:
                raise ValueError(f"{r.request_id}: a rag request needs its question for form {form!r}")
            messages = rag_messages(form, r.messages[0]["content"], list(r.passages), r.question)
        elif r.workload == "agent":
            messages = agent_messages(form, r.messages)
        else:
            raise ValueError(f"prompt form {form!r} applies to {FORM_WORKLOADS}, not {r.workload!r}")
        out.append(dataclasses.replace(r, messages=messages, form=form))
    return out


def token_offsets(tokenizer: Any, pieces: list[str]) -> tuple[list[int], np.ndarray]:
    """Token ids of `pieces` tokenized one by one (as `tokenize_pieces` does) and each token's
    [start, end) in the joined text.  # offsets: [num_tokens, 2]"""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    base = 0
    for piece in pieces:
        enc = tokenizer(piece, add_special_tokens=False, return_offsets_mapping=True)
        ids += enc["input_ids"]
        spans += [(base + a, base + b) for a, b in enc["offset_mapping"]]
        base += len(piece)
    return ids, np.asarray(spans, dtype=np.int64).reshape(-1, 2)


def unit_mask(text: str, offsets: np.ndarray, units: list[str]) -> np.ndarray:
    """Tokens that lie wholly inside one of `units` (found in order in `text`).  # [num_tokens] bool"""
    mask = np.zeros(len(offsets), dtype=bool)
    cursor = 0
    for unit in units:
        at = text.find(unit, cursor)
        if at < 0:
            raise ValueError(f"unit not found in the prompt text: {unit[:60]!r}...")
        mask |= (offsets[:, 0] >= at) & (offsets[:, 1] <= at + len(unit))
        cursor = at + len(unit)
    return mask


def form_prompt(tokenizer: Any, vocab_size: int, request: Request) -> tuple[TokenizedPrompt, np.ndarray, str]:
    """The request as the engine receives it in its form, its tokens' char offsets and the text."""
    from sparsex.inputs import chat_pieces, tokenize_pieces
    if request.form == "explicit":
        pieces, reusable = list(request.segments), [True] * len(request.segments)
    else:
        pieces, reusable = chat_pieces(tokenizer, request.messages)
    prompt = tokenize_pieces(tokenizer, pieces, vocab_size, reusable)
    ids, offsets = token_offsets(tokenizer, pieces)
    if ids != prompt.token_ids:
        raise RuntimeError(f"{request.request_id}: offset tokenization differs from the prompt's")
    return prompt, offsets, "".join(pieces)


def recurring_masks(requests: list[Request], texts: list[str], offsets: list[np.ndarray],
                    seen: set[str]) -> list[np.ndarray]:
    """Per request, its tokens inside a unit an earlier request (or `seen`: ingested) already held.
    `seen` grows as the requests go by, in arrival order.  # each: [num_tokens] bool"""
    seen = set(seen)
    masks = []
    for r, text, off in zip(requests, texts, offsets):
        masks.append(unit_mask(text, off, [u for u in r.passages if u in seen]))
        seen.update(r.passages)
    return masks


def served_mask(num_tokens: int, num_cached: int, spans: list[Any]) -> np.ndarray:
    """Prompt tokens served from cache: the exact prefix and every reused span (`ReusedSpan`s:
    .start, .end).  # [num_tokens] bool"""
    mask = np.zeros(num_tokens, dtype=bool)
    mask[:num_cached] = True
    for span in spans:
        mask[span.start:span.end] = True
    return mask
