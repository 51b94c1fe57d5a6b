"""Tool calls: each convention's parser on fixed model outputs (extract, and streaming split at every
chunk boundary reassembling to the same calls), the call grammars through xgrammar on the real
tokenizers, and the server end to end through the official `openai` client against the real SmolLM2
(`--tool-call-parser hermes`).

SmolLM2 never calls a tool on its own, so the server test makes its greedy answer a call by
in-context copying: a system prompt saying "repeat the user's text", one worked example, then a
Hermes call to repeat. The answer is the model's real greedy output; the test checks that what the
server parses out of it (non-streaming, and streaming reassembled) equals the parser's reference
`extract` of the raw text the same request gives with tool_choice "none".
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from sparsex.entrypoints.tool_parsers import (
    PARSERS,
    ToolCallStream,
    ToolSpecError,
    check_tools,
    detect_parser,
    get_parser,
)
from sparsex.entrypoints.tool_parsers.grammar import rename_rules

ARGS1 = {"city": 'Par"is', "opts": {"days": [1, 2], "note": "a {b} [c]"}}
ARGS2 = {"q": "x\\y", "n": -3.5e2, "ok": True, "nil": None}
A1, A2 = json.dumps(ARGS1), json.dumps(ARGS2)

# (convention, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {A1}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "search", "arguments": {A2}}}\n</tool_call>', "Let me look.",
     [("get_weather", A1), ("search", A2)]),
    ("hermes", f'<tool_call>\n{{"arguments": {A2}, "name": "search"}}\n</tool_call>', None, [("search", A2)]),
    ("hermes", "No tools needed: 2 + 2 = 4 {not a call}", "No tools needed: 2 + 2 = 4 {not a call}", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {A1}}}; {{"name": "search", "parameters": {A2}}}',
     None, [("get_weather", A1), ("search", A2)]),
    ("llama3_json", f'<|python_tag|>{{"name": "search", "parameters": {A2}}}', None, [("search", A2)]),
    ("llama3_json", "The answer is {x}.", "The answer is {x}.", []),
    ("mistral", f'Sure. [TOOL_CALLS][{{"name": "get_weather", "arguments": {A1}}}, {{"name": "search", '
                f'"arguments": {A2}}}]', "Sure.", [("get_weather", A1), ("search", A2)]),
    ("granite", f'<|tool_call|>[{{"name": "get_weather", "arguments": {A1}}}, {{"name": "noargs"}}]', None,
     [("get_weather", A1), ("noargs", "{}")]),
    ("granite", f'<tool_call>[{{"name": "search", "arguments": {A2}}}]', None, [("search", A2)]),
    ("phi4_mini", f'Calling. functools[{{"name": "get_weather", "arguments": {A1}}}, {{"name": "search", '
                  f'"arguments": {A2}}}]', "Calling.", [("get_weather", A1), ("search", A2)]),
]


def reassemble(parser, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]], list[dict]]:
    """Feed cumulative text chunk by chunk, as the server does; (content, calls, all deltas)."""
    stream, text, content, calls, deltas = ToolCallStream(parser), "", "", {}, []
    for i, piece in enumerate(pieces):
        text += piece
        c, ds = stream.feed(text, i == len(pieces) - 1)
        content += c
        deltas += ds
        for d in ds:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            if "name" in d["function"]:
                assert call["name"] is None and "id" in d and d["type"] == "function"   # name once, with the id
                call["name"] = d["function"]["name"]
            call["arguments"] += d["function"].get("arguments", "")
    return (content or None), [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], deltas


@pytest.mark.unit
@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_extract_and_streaming_at_every_split(name, text, content, calls):
    parser = PARSERS[name]
    got_content, got = parser.extract(text)
    assert got_content == (content if calls else text)
    assert [(c.name, c.arguments) for c in got] == calls
    for c in got:
        assert json.loads(c.arguments) is not None and c.id
    reference = (got_content, [(c.name, c.arguments) for c in got])
    for cut in range(len(text) + 1):                          # every two-chunk split
        assert reassemble(parser, [text[:cut], text[cut:]])[:2] == reference, cut
    content_s, calls_s, deltas = reassemble(parser, list(text))  # one character at a time
    assert (content_s, calls_s) == reference
    for marker in (*parser.start_markers, *parser.leading_starts):
        if calls:                                              # markup never leaks into content
            assert marker not in (content_s or "")


@pytest.mark.unit
def test_registry_and_detection():
    assert get_parser("hermes") is PARSERS["hermes"] and get_parser("phi4_mini_json") is PARSERS["phi4_mini"]
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'"):
        get_parser("nope")
    assert detect_parser("... <tool_call>\n{\"name\": <function-name>} ...") is PARSERS["hermes"]
    assert detect_parser("{{ '[TOOL_CALLS]' }}") is PARSERS["mistral"]
    assert detect_parser("<|start_of_role|>available_tools<|end_of_role|> <tool_call>") is PARSERS["granite"]
    assert detect_parser("<|tool|>{{ tools }}<|/tool|>") is PARSERS["phi4_mini"]
    assert detect_parser("{{ '<|python_tag|>' }}") is PARSERS["llama3_json"]
    assert detect_parser("{{ message['content'] }}") is None and detect_parser(None) is None


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
NOARGS = {"type": "function", "function": {"name": "noargs"}}


@pytest.mark.unit
@pytest.mark.parametrize("tools,choice,match", [
    ([{"type": "function", "function": {"parameters": {}}}], None, r"tools\[0\].function has no name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "type 'object'"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "must be a JSON Schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}], None,
     "not a valid JSON Schema"),
    ([TOOL, TOOL], None, "two tools are named"),
    ([TOOL], {"type": "function", "function": {"name": "nope"}}, "names function 'nope', which is not among"),
    (None, "required", "only allowed when tools are given"),
    ([TOOL], "sometimes", "tool_choice must be"),
])
def test_bad_tools(tools, choice, match):
    with pytest.raises(ToolSpecError, match=match):
        check_tools(tools, choice)


@pytest.mark.unit
def test_rename_rules_leaves_literals_alone():
    assert rename_rules('root ::= "root x" [a-z] root_1\nroot_1 ::= "\\"root"', "t0_") == \
        't0_root ::= "root x" [a-z] t0_root_1\nt0_root_1 ::= "\\"root"'


# ---- grammars through xgrammar on the real tokenizers ------------------------------------------
def _tokenizer(model: str):
    from sparsex.models.hf_dir import load_tokenizer
    from sparsex.models.loader import prepare_model_dir
    try:
        path = prepare_model_dir(model)
    except ValueError as e:                                   # optional model not installed
        pytest.skip(str(e))
    return load_tokenizer(path)


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
def compiler(request):
    xg = pytest.importorskip("xgrammar")
    return xg, xg.GrammarCompiler(xg.TokenizerInfo.from_huggingface(_tokenizer(request.param)))


def _one(parser, name: str, args: str) -> str:
    return parser.grammar_call_prefix + f'{{"name": "{name}", "{parser.grammar_args_key}": {args}}}' + \
        parser.grammar_call_suffix


@pytest.mark.model
@pytest.mark.parametrize("name", sorted(PARSERS))
def test_call_grammar_accepts_valid_calls_only(compiler, name):
    xg, comp = compiler
    parser = PARSERS[name]

    def accepts(g, s: str) -> bool:
        m = xg.GrammarMatcher(g)
        return m.accept_string(s) and m.is_completed()

    g = comp.compile_grammar(parser.call_grammar([TOOL, NOARGS], "required"))
    good = _one(parser, "get_weather", '{"city": "Paris", "days": 3}')
    two = good + parser.grammar_separator + _one(parser, "noargs", "{}")
    assert accepts(g, parser.grammar_prefix + good + parser.grammar_suffix)
    assert accepts(g, parser.grammar_prefix + two + parser.grammar_suffix)
    assert parser.extract(parser.grammar_prefix + two + parser.grammar_suffix)[1][1].name == "noargs"
    for bad in (good.replace("get_weather", "get_time"),              # not a tool
                good.replace('"city": "Paris", ', ""),                 # required argument missing
                good.replace("3", '"3"'),                              # wrong type
                good.replace("3}", '3, "extra": 1}')):                 # undeclared argument
        assert not accepts(g, parser.grammar_prefix + bad + parser.grammar_suffix), bad
    named = comp.compile_grammar(parser.call_grammar([TOOL, NOARGS], {"type": "function", "function": {"name": "noargs"}},
                                                     parallel_tool_calls=False))
    assert accepts(named, parser.grammar_prefix + _one(parser, "noargs", "{}") + parser.grammar_suffix)
    assert not accepts(named, parser.grammar_prefix + good + parser.grammar_suffix)
    assert not accepts(named, parser.grammar_prefix + _one(parser, "noargs", "{}") + parser.grammar_separator
                       + _one(parser, "noargs", "{}") + parser.grammar_suffix)


@pytest.mark.model
def test_templates_detect_and_render_history():
    assert detect_parser(_tokenizer("smollm2-135m-instruct").chat_template) is None
    tok = _tokenizer("qwen2.5-coder-0.5b-instruct")
    assert detect_parser(tok.chat_template) is PARSERS["hermes"]
    from sparsex.inputs import chat_pieces
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    text = "".join(chat_pieces(tok, msgs, tools=[TOOL])[0])
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n18 C\n</tool_response>" in text


# ---- the server -------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"type": "string", "enum": ["c", "f"]}},
                          "required": ["city"]}}}
EXAMPLE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "f"}}\n</tool_call>'
TARGET = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
COPY = [{"role": "system", "content": "You repeat the user's text exactly."},
        {"role": "user", "content": "Repeat: hello world"}, {"role": "assistant", "content": "hello world"},
        {"role": "user", "content": "Repeat: " + EXAMPLE}, {"role": "assistant", "content": EXAMPLE},
        {"role": "user", "content": "Repeat: " + TARGET}]


@pytest.fixture(scope="module")
def servers():
    from sparsex.config import EngineConfig
    from sparsex.entrypoints.async_engine import AsyncLLM
    from sparsex.entrypoints.background_server import BackgroundServer
    from sparsex.entrypoints.openai_server import build_app
    from sparsex.entrypoints.settings import ServerSettings

    llm = AsyncLLM.from_config(EngineConfig(model="smollm2-135m-instruct", dtype="float32", cache="prefix", seed=0,
                                            max_model_len=1024, num_blocks=128))
    with_parser = BackgroundServer(build_app(llm, ServerSettings(tool_call_parser="hermes")))
    plain = BackgroundServer(build_app(llm, ServerSettings(shutdown_engine=False)))
    yield with_parser, plain
    plain.stop()
    with_parser.stop()
    assert llm.error is None


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.mark.model
def test_server_tool_calls_equal_the_reference(servers):
    srv, _ = servers
    client = _client(srv)
    kw = dict(model="smollm2-135m-instruct", messages=COPY, tools=[WEATHER], temperature=0, max_tokens=48)
    raw = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert raw.message.tool_calls is None and raw.finish_reason == "stop"
    content, calls = PARSERS["hermes"].extract(raw.message.content)
    assert [c.name for c in calls] == ["get_weather"]          # the model copied a call
    ref = [(c.name, c.arguments) for c in calls]

    r = client.chat.completions.create(**kw).choices[0]        # tool_choice auto
    assert r.finish_reason == "tool_calls" and r.message.content == content
    assert [(t.function.name, t.function.arguments) for t in r.message.tool_calls] == ref
    assert all(t.id.startswith("call_") and t.type == "function" for t in r.message.tool_calls)
    json.loads(r.message.tool_calls[0].function.arguments)

    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (text or None) == content and "<tool_call>" not in text
    streamed: dict[int, list] = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            if d.id is not None:
                assert d.index not in streamed and d.function.name and d.type == "function"
                streamed[d.index] = [d.id, d.function.name, ""]
            streamed[d.index][2] += d.function.arguments or ""
    assert [(name, args) for _, name, args in streamed.values()] == ref


@pytest.mark.model
def test_server_required_gives_a_valid_call(servers):
    """tool_choice "required" or a named function: decoding is constrained, so even SmolLM2 (whose
    template knows no tools) answers with calls that parse and validate against the tool's schema."""
    import jsonschema
    srv, _ = servers
    client = _client(srv)
    messages = [{"role": "user", "content": "What's the weather in Oslo?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        # one call: with parallel calls allowed, greedy SmolLM2 repeats calls until max_tokens
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, tools=[WEATHER, NOARGS],
                                           tool_choice=choice, parallel_tool_calls=False, temperature=0, max_tokens=96)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1
        for call in calls:
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
            tool = WEATHER if call.function.name == "get_weather" else NOARGS
            jsonschema.validate(json.loads(call.function.arguments), tool["function"].get("parameters", {}))
    # the constraint and a response_format cannot both hold
    with pytest.raises(openai.BadRequestError, match="cannot be combined") as e:
        client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, tools=[WEATHER],
                                       tool_choice="required", response_format={"type": "json_object"}, max_tokens=8)
    assert e.value.body["param"] == "tool_choice"


@pytest.mark.model
@pytest.mark.parametrize("patch,param,match", [
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0]", "has no name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools[0]",
     "type 'object'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
])
def test_server_bad_tools_are_400s(servers, patch, param, match):
    srv, _ = servers
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **patch}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and match in err["message"]
    with pytest.raises(openai.BadRequestError):
        _client(srv).chat.completions.create(model="smollm2-135m-instruct", **body)


@pytest.mark.model
def test_server_without_a_convention_asks_for_the_flag(servers):
    srv, plain = servers
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "max_tokens": 2}
    r = httpx.post(plain.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "tool_parser_required"
    ok = httpx.post(plain.url + "/v1/chat/completions", json={**body, "tool_choice": "none"}, timeout=300)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
    # the engine keeps serving after the 400s
    assert httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=300).status_code == 200


@pytest.mark.model
def test_tokenize_renders_tools_as_chat_does():
    """POST /tokenize with messages and tools: the very prompt the chat route builds for that body
    (the template's tool block included), so a client can count or compare a tool request's prompt."""
    from sparsex.config import EngineConfig
    from sparsex.entrypoints.async_engine import AsyncLLM
    from sparsex.entrypoints.background_server import BackgroundServer
    from sparsex.entrypoints.openai_server import build_app
    from sparsex.entrypoints.settings import ServerSettings

    _tokenizer("qwen2.5-coder-0.5b-instruct")                 # skips when the optional model is not installed
    llm = AsyncLLM.from_config(EngineConfig(model="qwen2.5-coder-0.5b-instruct", cache="none", max_model_len=1024,
                                            num_blocks=16))
    srv = BackgroundServer(build_app(llm, ServerSettings()))
    try:
        messages = [{"role": "user", "content": "What's the weather in Oslo?"}]
        got = httpx.post(srv.url + "/tokenize", json={"messages": messages, "tools": [WEATHER]}, timeout=300).json()
        plain = httpx.post(srv.url + "/tokenize", json={"messages": messages}, timeout=300).json()
        ref = llm.call_sync(lambda e: e.chat_to_prompt(messages, True, None, [WEATHER]))
        assert got["tokens"] == ref.token_ids and got["count"] > plain["count"]
        chat = httpx.post(srv.url + "/v1/chat/completions", timeout=300, json={
            "messages": messages, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == got["count"]
    finally:
        srv.stop()
    assert llm.error is None
