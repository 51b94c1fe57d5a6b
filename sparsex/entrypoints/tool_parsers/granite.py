"""IBM Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` (3.0; 3.1 writes the
marker as the plain text `<tool_call>`)."""
from __future__ import annotations

from sparsex.entrypoints.tool_parsers.base import ToolParser


class GraniteToolParser(ToolParser):
    name = "granite"
    template_markers = ("<|tool_call|>", "<|start_of_role|>available_tools")
    start_markers = ("<|tool_call|>", "<tool_call>")
    glue = ("[", ",", "]")
    grammar_prefix = "<|tool_call|>["
    grammar_separator = ", "
    grammar_suffix = "]"
