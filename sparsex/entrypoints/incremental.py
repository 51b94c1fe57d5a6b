"""Append-only text deltas from the engine's cumulative output text.

Two things in a cumulative text can still change, so they are held back until they settle:
  * a trailing U+FFFD: a character whose UTF-8 bytes span several tokens decodes as U+FFFD until
    its last token arrives;
  * the last (longest stop string - 1) characters: they may be the start of a stop string, which
    the engine cuts from the final text.
Everything is flushed when the choice finishes.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"


class TextDeltas:
    def __init__(self, stop: list[str] | None = None, include_stop_str: bool = False):
        longest = max((len(s) for s in stop or []), default=0)
        self._holdback = 0 if include_stop_str else max(longest - 1, 0)
        self.sent = 0                       # characters already handed out

    def next(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            end -= self._holdback
            while end > self.sent and text[end - 1] == _REPLACEMENT:
                end -= 1
        if end <= self.sent:
            return ""
        delta = text[self.sent:end]
        self.sent = end
        return delta
