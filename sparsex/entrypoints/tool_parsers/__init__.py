"""Tool calls out of a chat answer, one parser per convention of the model families served.

    hermes       <tool_call>{"name", "arguments"}</tool_call>     Qwen2.5 / Qwen2.5-Coder / Qwen3, Hermes
    llama3_json  {"name", "parameters"}; ...                       Llama 3.1-3.3
    mistral      [TOOL_CALLS][{"name", "arguments"}, ...]          Mistral (pre-v11 tokenizers)
    granite      <|tool_call|>[{"name", "arguments"}, ...]         Granite 3.x
    phi4_mini    functools[{"name", "arguments"}, ...]             Phi-4-mini

The parser comes from `--tool-call-parser NAME` (`LLM.chat(..., tool_parser=NAME)`), else from the
model's chat template (`detect_parser`). Each parser gives `extract(text)` for a finished answer,
`ToolCallStream` for streaming, and `call_grammar(tools, tool_choice)` for `tool_choice` "required"
or a named function (decoding constrained to a valid call: `constrain_to_tool_calls`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

from sparsex.entrypoints.tool_parsers.base import ToolCallStream, ToolParser
from sparsex.sampling_params import SamplingParams, StructuredOutputsParams
from sparsex.entrypoints.tool_parsers.granite import GraniteToolParser
from sparsex.entrypoints.tool_parsers.hermes import HermesToolParser
from sparsex.entrypoints.tool_parsers.llama3_json import Llama3JsonToolParser
from sparsex.entrypoints.tool_parsers.mistral import MistralToolParser
from sparsex.entrypoints.tool_parsers.phi4_mini import Phi4MiniToolParser

__all__ = ["PARSERS", "PARSER_NAMES", "ToolCallStream", "ToolParser", "ToolSpecError",
           "get_parser", "detect_parser", "resolve_parser", "check_tools", "effective_tool_choice",
           "constrain_to_tool_calls", "is_forcing"]

# detection order: the more specific markers first (Granite 3.1 templates also say <tool_call>)
_ORDER = (GraniteToolParser, MistralToolParser, Phi4MiniToolParser, Llama3JsonToolParser, HermesToolParser)
PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in _ORDER}
_BY_NAME: dict[str, type[ToolParser]] = {**PARSERS, **{a: p for p in _ORDER for a in p.aliases}}
PARSER_NAMES: tuple[str, ...] = tuple(sorted(_BY_NAME))      # what --tool-call-parser accepts


class ToolSpecError(ValueError):
    """A request's `tools` / `tool_choice` are invalid; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def get_parser(name: str) -> type[ToolParser]:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(_BY_NAME)}") from None


def detect_parser(chat_template: str | None) -> type[ToolParser] | None:
    """The convention a chat template speaks, from its text; None when it has none we know."""
    if not chat_template:
        return None
    for p in _ORDER:
        if any(m in chat_template for m in p.template_markers):
            return p
    return None


def resolve_parser(name: str | None, chat_template: str | None) -> type[ToolParser] | None:
    return get_parser(name) if name else detect_parser(chat_template)


def effective_tool_choice(tools: list | None, tool_choice: Any) -> Any:
    """OpenAI's default: "auto" with tools, "none" without."""
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise ToolSpecError(f"{where}.parameters must be a JSON Schema object, got {type(schema).__name__}", where)
    if schema.get("type", "object") != "object":
        raise ToolSpecError(f"{where}.parameters must be a schema of type 'object', got type {schema.get('type')!r}",
                            where)
    import jsonschema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ToolSpecError(f"{where}.parameters is not a valid JSON Schema: {e.message}", where) from None


def check_tools(tools: Any, tool_choice: Any) -> None:
    """Raise ToolSpecError naming the problem: a tool without a name, a non-object or invalid
    parameters schema, duplicate names, a tool_choice naming no tool or given without tools."""
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise ToolSpecError("tools must be a list", "tools")
        for i, tool in enumerate(tools):
            where = f"tools[{i}]"
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise ToolSpecError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", where)
            fn = tool.get("function")
            if not isinstance(fn, dict):
                raise ToolSpecError(f"{where}.function must be an object with a name", where)
            name = fn.get("name")
            if not isinstance(name, str) or not name.strip():
                raise ToolSpecError(f"{where}.function has no name", where)
            if name in names:
                raise ToolSpecError(f"{where}: two tools are named {name!r}", where)
            names.append(name)
            if fn.get("parameters") is not None:
                _check_schema(fn["parameters"], where)
    if tool_choice is None or tool_choice == "none":
        return
    if not tools:
        raise ToolSpecError("tool_choice is only allowed when tools are given", "tool_choice")
    if isinstance(tool_choice, str):
        if tool_choice not in ("auto", "required"):
            raise ToolSpecError(f"tool_choice must be 'none', 'auto', 'required' or "
                                f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}",
                                "tool_choice")
        return
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
        raise ToolSpecError("tool_choice must name a function: {'type': 'function', 'function': {'name': ...}}",
                            "tool_choice")
    if name not in names:
        raise ToolSpecError(f"tool_choice names function {name!r}, which is not among the tools {names}",
                            "tool_choice")


def is_forcing(tool_choice: Any) -> bool:
    return tool_choice == "required" or isinstance(tool_choice, dict)


def constrain_to_tool_calls(params: SamplingParams, parser: type[ToolParser], tools: list[dict], tool_choice: Any,
                            parallel_tool_calls: bool = True) -> SamplingParams:
    """`params` with decoding constrained to a valid call (tool_choice "required" or a named
    function) through the engine's structured outputs (an xgrammar grammar). ToolSpecError when a
    tool's parameters schema cannot be enforced."""
    try:
        grammar = parser.call_grammar(tools, tool_choice, parallel_tool_calls)
    except RuntimeError as e:                       # xgrammar could not convert a schema
        raise ToolSpecError(f"a tool's parameters schema cannot be enforced: {e}", "tools") from e
    return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(grammar=grammar))
