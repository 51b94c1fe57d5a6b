"""What every tool-call convention shares: a scanner over the model's text that finds the call markup
and the JSON call objects in it, `extract` for a finished output, `ToolCallStream` for streaming,
and `call_grammar` for constrained decoding.

A convention is described by a few strings (`ToolParser` subclasses, one file each): where the calls
start (`start_markers`), what may sit between and around the call objects (`glue`), how one call
object is spelled (`name_key` / `args_key`), and how the calls are wrapped (`grammar_prefix`,
`grammar_call_prefix` / `_suffix`, `grammar_separator`, `grammar_suffix`).

The scanner works on the whole text each time (`snapshot`): a streamed output is re-scanned as it
grows and only what is new since the last scan goes out, so streaming gives the same calls as
`extract`, whatever the chunk boundaries. A call's `arguments` string is the JSON text of the
arguments exactly as the model wrote it (checked with json.loads), so it can stream character by
character and still equal the finished output's.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar

from sparsex.outputs import ToolCall

_WS = " \t\r\n"


class _Invalid(Exception):
    """The text in the call region is not a well-formed call."""


@dataclass
class CallSnap:
    """One call object as far as the text goes."""
    name: str | None = None            # set once the name's string is complete
    args: str = ""                     # the arguments' JSON text so far (raw), or the decoded string
    args_done: bool = False
    args_seen: bool = False
    args_streamable: bool = True       # False: arguments given as a JSON string, sent once complete
    done: bool = False                 # the object's closing brace was seen


@dataclass
class Snapshot:
    content: str                       # content that is settled (will not become markup)
    calls: list[CallSnap] = field(default_factory=list)
    in_region: bool = False            # a call region started


def _string_end(s: str, i: int) -> int | None:
    """s[i] == '"': index after the closing quote, None if the text ends first."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        if c in "\n\r":
            raise _Invalid("newline in a JSON string")
        j += 1
    return None


def _value_end(s: str, i: int, finished: bool) -> int | None:
    """End (exclusive) of the JSON value starting at s[i]; None if the text ends first."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                e = _string_end(s, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    if j == len(s) and not finished:
        return None
    if j == i:
        raise _Invalid(f"unexpected {s[i]!r}")
    return j


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


class ToolParser:
    """One tool-call convention. Subclasses set the class attributes; most need no code."""
    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    # substrings of a chat template that identify the convention (any of them)
    template_markers: ClassVar[tuple[str, ...]] = ()
    # text that opens the call region anywhere in the output (content may come before it)
    start_markers: ClassVar[tuple[str, ...]] = ()
    # the call region may also open at the very start of the output (after whitespace) with these
    leading_starts: ClassVar[tuple[str, ...]] = ()
    # tokens allowed between and around call objects inside the region (besides whitespace)
    glue: ClassVar[tuple[str, ...]] = ()
    name_key: ClassVar[str] = "name"
    args_keys: ClassVar[tuple[str, ...]] = ("arguments", "parameters")
    # grammar (constrained decoding): prefix calls* suffix, calls joined by the separator, each call
    # call_prefix + {"name": ..., "<grammar_args_key>": ...} + call_suffix
    grammar_prefix: ClassVar[str] = ""
    grammar_call_prefix: ClassVar[str] = ""
    grammar_call_suffix: ClassVar[str] = ""
    grammar_separator: ClassVar[str] = ""
    grammar_suffix: ClassVar[str] = ""
    grammar_args_key: ClassVar[str] = "arguments"

    # ---- identifiers --------------------------------------------------------------------------
    @classmethod
    def new_call_id(cls) -> str:
        return "call_" + uuid.uuid4().hex[:24]

    # ---- scanning -----------------------------------------------------------------------------
    @classmethod
    def _region_start(cls, text: str, finished: bool) -> tuple[int, int] | int:
        """(content end, region start) if a call region starts; else how much of the text is
        settled content (the rest may still turn into a marker)."""
        lead = _skip_ws(text, 0)
        for m in cls.leading_starts:
            if text.startswith(m, lead):
                return lead, lead
        if not finished and lead == len(text) and cls.leading_starts:
            return 0                                    # only whitespace yet: could still lead a call
        if not finished and any(m.startswith(text[lead:]) for m in cls.leading_starts) and lead < len(text):
            return 0
        best = None
        for m in cls.start_markers:
            at = text.find(m)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, at + len(m))
        if best is not None:
            return best
        if finished:
            return len(text)
        # hold back a tail that may be the start of a marker
        hold = 0
        for m in cls.start_markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    hold = max(hold, k)
                    break
        return len(text) - hold

    @classmethod
    def _scan_call(cls, s: str, i: int, finished: bool) -> tuple[CallSnap, int | None]:
        """s[i] == '{': the call object; (snap, index after it or None if incomplete)."""
        snap = CallSnap()
        j = i + 1
        while True:
            j = _skip_ws(s, j)
            if j >= len(s):
                return snap, None
            if s[j] == "}":
                snap.done = True
                if not snap.args_seen:
                    snap.args, snap.args_done = "{}", True
                if snap.name is None:
                    raise _Invalid("a call object without a name")
                return snap, j + 1
            if s[j] == ",":
                j += 1
                continue
            if s[j] != '"':
                raise _Invalid(f"expected a key, got {s[j]!r}")
            e = _string_end(s, j)
            if e is None:
                return snap, None
            key = json.loads(s[j:e])
            j = _skip_ws(s, e)
            if j >= len(s):
                return snap, None
            if s[j] != ":":
                raise _Invalid(f"expected ':', got {s[j]!r}")
            j = _skip_ws(s, j + 1)
            if j >= len(s):
                return snap, None
            end = _value_end(s, j, finished)
            if key == cls.name_key:
                if s[j] != '"':
                    raise _Invalid("the call's name is not a string")
                if end is None:
                    return snap, None
                snap.name = json.loads(s[j:end])
            elif key in cls.args_keys and not snap.args_seen:
                snap.args_seen = True
                if s[j] == '"':                        # arguments given as a JSON-encoded string
                    snap.args_streamable = False
                    if end is None:
                        return snap, None
                    snap.args, snap.args_done = json.loads(s[j:end]), True
                elif s[j] in "{[":
                    snap.args = s[j:end] if end is not None else s[j:]
                    if end is None:
                        return snap, None
                    try:
                        json.loads(snap.args)
                    except json.JSONDecodeError as e:
                        raise _Invalid(f"arguments are not JSON: {e}") from e
                    snap.args_done = True
                else:
                    raise _Invalid("the call's arguments are not a JSON object")
            elif end is None:
                return snap, None
            if end is None:
                return snap, None
            j = end

    @classmethod
    def snapshot(cls, text: str, finished: bool) -> Snapshot:
        """What the text says so far. Raises _Invalid when the call region is malformed."""
        start = cls._region_start(text, finished)
        if isinstance(start, int):
            return Snapshot(content=text[:start])
        content_end, i = start
        snap = Snapshot(content=text[:content_end], in_region=True)
        while True:
            i = _skip_ws(text, i)
            if i >= len(text):
                return snap
            if text[i] == "{":
                call, end = cls._scan_call(text, i, finished)
                if call.name is not None or call.args_seen:
                    snap.calls.append(call)
                if end is None:
                    if finished:
                        raise _Invalid("the output ends inside a call")
                    return snap
                i = end
                continue
            for g in cls.glue:
                if text.startswith(g, i):
                    i += len(g)
                    break
            else:
                if not finished and any(g.startswith(text[i:]) for g in cls.glue):
                    return snap                          # a glue token still arriving
                return snap                              # trailing text after the calls: dropped

    # ---- finished output ----------------------------------------------------------------------
    @classmethod
    def extract(cls, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output. Content is what precedes the calls (trailing
        whitespace dropped; None when empty); a malformed call region leaves the whole text as content."""
        try:
            snap = cls.snapshot(text, finished=True)
        except _Invalid:
            return text, []
        calls = [ToolCall(id=cls.new_call_id(), name=c.name, arguments=c.args)
                 for c in snap.calls if c.name is not None and c.done]
        if not calls:
            return text, []
        content = snap.content.rstrip()
        return (content or None), calls

    # ---- constrained decoding -----------------------------------------------------------------
    @classmethod
    def call_grammar(cls, tools: list[dict[str, Any]], tool_choice: Any = "required",
                     parallel_tool_calls: bool = True) -> str:
        """An xgrammar EBNF grammar (root rule `root`): exactly this convention's markup around one
        call (or several, with `parallel_tool_calls`) of the allowed tools, arguments following each
        tool's parameters schema. `tool_choice`: "required" (any of `tools`) or a named function."""
        from sparsex.entrypoints.tool_parsers.grammar import calls_grammar
        return calls_grammar(cls, tools, tool_choice, parallel_tool_calls)


class ToolCallStream:
    """Streaming: feed the cumulative text (settled by TextDeltas), get the content delta and the
    OpenAI `delta.tool_calls` entries that are new. Call markup never goes out as content."""

    def __init__(self, parser: type[ToolParser]):
        self.parser = parser
        self.content_sent = 0
        self.sent: list[dict[str, Any]] = []    # per call: id, name_sent, args_sent
        self.failed = False
        self.region = False

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.failed:
            delta = text[self.content_sent:]
            self.content_sent = len(text)
            return delta, []
        try:
            snap = self.parser.snapshot(text, finished)
        except _Invalid:
            if self.sent:           # calls already went out: the rest is dropped
                self.failed = True
                self.content_sent = len(text)
                return "", []
            self.failed = True
            return self.feed(text, finished)
        content = snap.content
        if snap.in_region or not finished:
            content = content.rstrip()            # trailing whitespace waits for more content
        if finished and snap.in_region and not any(c.done for c in snap.calls):
            content = text                        # a region with no call: all of it is content
        content_delta = content[self.content_sent:] if len(content) > self.content_sent else ""
        self.content_sent = max(self.content_sent, len(content))
        deltas: list[dict[str, Any]] = []
        for idx, call in enumerate(snap.calls):
            if call.name is None:
                break
            if idx == len(self.sent):
                cid = self.parser.new_call_id()
                self.sent.append({"id": cid, "args_sent": 0})
                deltas.append({"index": idx, "id": cid, "type": "function",
                               "function": {"name": call.name, "arguments": ""}})
            st = self.sent[idx]
            if call.args_streamable or call.args_done:
                new = call.args[st["args_sent"]:]
                if new:
                    st["args_sent"] = len(call.args)
                    deltas.append({"index": idx, "function": {"arguments": new}})
        return content_delta, deltas
