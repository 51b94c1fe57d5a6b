"""Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call, text
before them is content (NousResearch Hermes 2/3, Qwen2.5, Qwen2.5-Coder, Qwen3)."""
from __future__ import annotations

from sparsex.entrypoints.tool_parsers.base import ToolParser


class HermesToolParser(ToolParser):
    name = "hermes"
    aliases = ("qwen2_5",)
    template_markers = ("<tool_call>",)
    start_markers = ("<tool_call>",)
    glue = ("</tool_call>", "<tool_call>")
    grammar_call_prefix = "<tool_call>\n"
    grammar_call_suffix = "\n</tool_call>"
    grammar_separator = "\n"
