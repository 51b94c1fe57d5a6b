"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the answer *is* the call, `{"name": ..., "parameters": {...}}`
(optionally after `<|python_tag|>`), several separated by `;`. An answer that does not start with a
call is content."""
from __future__ import annotations

from sparsex.entrypoints.tool_parsers.base import ToolParser


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    aliases = ("llama",)
    template_markers = ("<|python_tag|>", '"parameters": dictionary of argument name')
    leading_starts = ("<|python_tag|>", "{")
    glue = ("<|python_tag|>", ";")
    grammar_separator = "; "
    grammar_args_key = "parameters"
