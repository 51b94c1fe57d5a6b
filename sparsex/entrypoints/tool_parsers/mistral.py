"""Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Mistral-Nemo,
Small and Large with the pre-v11 tokenizers). Tool call ids are 9 alphanumerics, the only ids
Mistral's templates accept when the conversation comes back."""
from __future__ import annotations

import random
import string

from sparsex.entrypoints.tool_parsers.base import ToolParser

_ALNUM = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    template_markers = ("[TOOL_CALLS]",)
    start_markers = ("[TOOL_CALLS]",)
    glue = ("[", ",", "]")
    grammar_prefix = "[TOOL_CALLS]["
    grammar_separator = ", "
    grammar_suffix = "]"

    @classmethod
    def new_call_id(cls) -> str:
        return "".join(random.choices(_ALNUM, k=9))
