"""Phi-4-mini: `functools[{"name": ..., "arguments": {...}}, ...]`; the template lists the tools
between `<|tool|>` and `<|/tool|>`."""
from __future__ import annotations

from sparsex.entrypoints.tool_parsers.base import ToolParser


class Phi4MiniToolParser(ToolParser):
    name = "phi4_mini"
    aliases = ("phi4_mini_json",)
    template_markers = ("<|/tool|>", "functools[")
    start_markers = ("functools[",)
    glue = (",", "]")
    grammar_prefix = "functools["
    grammar_separator = ", "
    grammar_suffix = "]"
