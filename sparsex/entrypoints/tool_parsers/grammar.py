"""xgrammar EBNF for "one or more calls of these tools in this convention's markup".

Each tool's parameters schema becomes EBNF through `xgrammar.Grammar.from_json_schema` (compact
separators, no free whitespace: a small model cannot wander off into blank space); its rules are
renamed with a per-tool prefix so that several schemas live in one grammar, and the convention's
markup and the call object's literal text are put around them. The text is what
`StructuredOutputsParams(grammar=...)` takes (root rule `root`).
"""
from __future__ import annotations

import json
import re
from typing import Any

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def rename_rules(ebnf: str, prefix: str) -> str:
    """Prefix every rule name (definitions and references) of an EBNF text; string literals and
    character classes are left alone."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        c = ebnf[i]
        if c in '"[':
            close = '"' if c == '"' else "]"
            j = i + 1
            while j < n and ebnf[j] != close:
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif c == "#":                                  # a comment, to the end of the line
            j = ebnf.find("\n", i)
            j = n if j < 0 else j
            out.append(ebnf[i:j])
            i = j
        else:
            m = _IDENT.match(ebnf, i)
            if m and (i == 0 or not (ebnf[i - 1].isalnum() or ebnf[i - 1] == "_")):
                out.append(prefix + m.group())
                i = m.end()
            else:
                out.append(c)
                i += 1
    return "".join(out)


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def schema_ebnf(schema: dict[str, Any], prefix: str) -> str:
    """The schema's grammar with its rules renamed `<prefix>...` (its root is `<prefix>root`)."""
    import xgrammar as xg

    g = xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    return rename_rules(str(g), prefix)


def allowed_tools(tools: list[dict[str, Any]], tool_choice: Any) -> list[dict[str, Any]]:
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return [t for t in tools if t["function"]["name"] == name]
    return list(tools)


def calls_grammar(parser, tools: list[dict[str, Any]], tool_choice: Any, parallel_tool_calls: bool = True) -> str:
    chosen = allowed_tools(tools, tool_choice)
    if not chosen:
        raise ValueError("no tool to call")
    lines = []
    alternatives = []
    for i, tool in enumerate(chosen):
        name = tool["function"]["name"]
        head = (parser.grammar_call_prefix + '{"' + parser.name_key + '": ' + json.dumps(name, ensure_ascii=False)
                + ', "' + parser.grammar_args_key + '": ')
        tail = "}" + parser.grammar_call_suffix
        lines.append(f"call_{i} ::= {ebnf_literal(head)} t{i}_root {ebnf_literal(tail)}")
        lines.append(schema_ebnf(parameters_schema(tool), f"t{i}_"))
        alternatives.append(f"call_{i}")
    lines.insert(0, "call ::= " + " | ".join(alternatives))
    body = "call"
    if parallel_tool_calls:
        body = f"call ({ebnf_literal(parser.grammar_separator)} call)*" if parser.grammar_separator else "call+"
    parts = [p for p in (ebnf_literal(parser.grammar_prefix) if parser.grammar_prefix else "", body,
                         ebnf_literal(parser.grammar_suffix) if parser.grammar_suffix else "") if p]
    lines.insert(0, "root ::= " + " ".join(parts))
    return "\n".join(lines) + "\n"
