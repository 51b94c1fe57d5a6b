"""Prompts as the engine sees them: token ids plus the spans of reusable pieces (segments).

Pieces are tokenized one by one and concatenated, so a passage or message gets the same token
ids wherever it appears (the precondition for reusing its KV). For chat, each message's content
is a segment; the chat template's glue tokens around it (`<|im_start|>user\\n`, `<|im_end|>\\n`)
are ordinary new tokens — they are exactly where the new context touches the reused one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json
from typing import Any


@dataclass(frozen=True)
class SegmentSpan:
    """A piece of the prompt that may be reused from, or registered in, the segment index."""
    start: int        # token offset in the prompt
    end: int          # exclusive


@dataclass
class TokenizedPrompt:
    """A prompt as the engine takes it (`LLMEngine.add_request` accepts one as it is)."""
    token_ids: list[int]
    text: str | None = None
    segments: list[SegmentSpan] = field(default_factory=list)
    cache_salt: str | None = None
    # teacher-forced scoring: token_ids[query_horizon:] is a continuation being scored, not part of the
    # prompt for reuse: segments reaching it are not reused, and sparse_q's query rows stop before it,
    # so the run plans and selects exactly what the prompt token_ids[:query_horizon] alone would
    # (sparsex/bench/fidelity.py). None: the whole of token_ids is the prompt.
    query_horizon: int | None = None


def _check_token_ids(ids: Any, vocab_size: int, what: str) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{what} must be a list of integers, got {type(ids).__name__}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} contains token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    return list(ids)


def tokenize_pieces(tokenizer, pieces: list[str | list[int]], vocab_size: int,
                    reusable: list[bool] | None = None) -> TokenizedPrompt:
    ids: list[int] = []
    spans: list[SegmentSpan] = []
    texts: list[str] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            toks = tokenizer.encode(piece, add_special_tokens=False)
            texts.append(piece)
        else:
            toks = _check_token_ids(piece, vocab_size, f"segment {i}")
            texts.append(tokenizer.decode(toks))
        if toks and (reusable is None or reusable[i]):
            spans.append(SegmentSpan(len(ids), len(ids) + len(toks)))
        ids.extend(toks)
    return TokenizedPrompt(ids, "".join(texts), spans)


def parse_prompt(tokenizer, prompt: Any, vocab_size: int) -> TokenizedPrompt:
    """str | {"prompt": str} | {"prompt_token_ids": [...]} | {"segments": [str | list[int], ...]};
    a dict may also carry "cache_salt"."""
    salt = None
    if isinstance(prompt, dict):
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"cache_salt must be a string, got {salt!r}")
        keys = [k for k in ("prompt", "prompt_token_ids", "segments") if k in prompt]
        if len(keys) != 1:
            raise ValueError(f"a prompt dict needs exactly one of 'prompt', 'prompt_token_ids', 'segments'; got keys {sorted(prompt)}")
        key = keys[0]
        if key == "prompt":
            prompt = prompt["prompt"]
        elif key == "prompt_token_ids":
            out = TokenizedPrompt(_check_token_ids(prompt["prompt_token_ids"], vocab_size, "prompt_token_ids"))
            out.cache_salt = salt
            return out
        else:
            pieces = prompt["segments"]
            if not isinstance(pieces, list) or not all(isinstance(p, (str, list)) for p in pieces):
                raise ValueError("segments must be a list of strings or token-id lists")
            out = tokenize_pieces(tokenizer, pieces, vocab_size)
            out.cache_salt = salt
            return out
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a str or a dict, got {type(prompt).__name__}")
    out = TokenizedPrompt(tokenizer.encode(prompt), prompt)
    out.cache_salt = salt
    return out


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):      # OpenAI content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict) and part.get("type", "text") == "text")
    if content is None:
        return ""
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def _content_parts(content: Any) -> list[str]:
    if isinstance(content, list):
        return [t for t in (p.get("text", "") for p in content
                            if isinstance(p, dict) and p.get("type", "text") == "text") if t]
    text = _content_text(content)
    return [text] if text else []


def parse_history_arguments(messages: list[dict]) -> list[dict]:
    """Assistant messages' tool_calls with their JSON-string arguments as objects, as chat
    templates expect them (they render `arguments | tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn = {**fn, "arguments": json.loads(fn["arguments"])}
                    except json.JSONDecodeError:
                        pass
                    c = {**c, "function": fn}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def chat_pieces(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> tuple[list[str], list[bool]]:
    """Render the chat template and cut it into glue and message-content pieces (content = reusable)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"each message needs a 'role', got {m!r}")
    # tool_calls' arguments arrive as JSON text (OpenAI); templates expect objects
    norm = [{**m, "content": _content_text(m.get("content"))} for m in parse_history_arguments(messages)]
    # the reusable units: each text part of a message (a RAG message may carry several passages)
    parts = [_content_parts(m.get("content")) for m in messages]
    if tokenizer.chat_template is None:
        raise ValueError("this model has no chat template; use generate() with a plain prompt")
    text = tokenizer.apply_chat_template(norm, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **({"tools": tools} if tools else {}))
    pieces, reusable, cursor = [], [], 0
    for m, m_parts in zip(norm, parts):
        if not m["content"] or text.find(m["content"], cursor) < 0:
            continue                    # empty, or the template rewrote the content: no segment for it
        for content in m_parts:
            at = text.find(content, cursor)
            if at > cursor:
                pieces.append(text[cursor:at]); reusable.append(False)
            pieces.append(content); reusable.append(True)
            cursor = at + len(content)
    if cursor < len(text):
        pieces.append(text[cursor:]); reusable.append(False)
    return pieces, reusable


def chat_prompt(tokenizer, messages: list[dict], vocab_size: int, add_generation_prompt: bool = True,
                cache_salt: str | None = None, tools: list[dict] | None = None) -> TokenizedPrompt:
    pieces, reusable = chat_pieces(tokenizer, messages, add_generation_prompt, tools)
    out = tokenize_pieces(tokenizer, pieces, vocab_size, reusable)
    out.cache_salt = cache_salt
    return out
