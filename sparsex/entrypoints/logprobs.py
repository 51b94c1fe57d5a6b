"""The engine's per-token logprob dicts ({token_id: logprob}: the top-k plus the sampled token)
in OpenAI's two shapes: chat's `content` list and the legacy completions' parallel arrays."""
from __future__ import annotations

import math
from typing import Any

from sparsex.entrypoints.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob


class TokenText:
    """Token id -> text, memoised. Uses its own tokenizer copy (the engine's belongs to the engine thread)."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        self._memo: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._memo.get(token_id)
        if s is None:
            s = self._tok.decode([token_id]) if self._tok is not None else f"<{token_id}>"
            self._memo[token_id] = s
        return s


# OpenAI's stand-in for "impossible": JSON has no -Infinity.
_FLOOR = -9999.0


def _finite(lp: float | None) -> float:
    return lp if lp is not None and math.isfinite(lp) else _FLOOR


def _top(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    return [(t, _finite(lp)) for t, lp in sorted(d.items(), key=lambda kv: kv[1], reverse=True)[:k]]


def chat_logprobs(token_ids: list[int], dicts: list[dict[int, float]], k: int, text: TokenText) -> ChatLogprobs:
    content = []
    for tid, d in zip(token_ids, dicts):
        s = text(tid)
        top = [TopLogprob(token=text(t), logprob=lp, bytes=list(text(t).encode("utf-8"))) for t, lp in _top(d, k)]
        content.append(TokenLogprob(token=s, logprob=_finite(d.get(tid)), bytes=list(s.encode("utf-8")),
                                    top_logprobs=top))
    return ChatLogprobs(content=content)


def completion_logprobs(token_ids: list[int], dicts: list[dict[int, float]], text: TokenText,
                        offset: int) -> CompletionLogprobs:
    """`offset`: characters of output text before these tokens (for text_offset)."""
    out = CompletionLogprobs()
    for tid, d in zip(token_ids, dicts):
        s = text(tid)
        out.tokens.append(s)
        out.token_logprobs.append(_finite(d.get(tid)))
        out.top_logprobs.append({text(t): lp for t, lp in _top(d, len(d))})
        out.text_offset.append(offset)
        offset += len(s)
    return out
