"""benchmarks/bfcl_tools.py's pure pieces, on bfcl-eval's own data: a BFCL function doc becomes the
OpenAI tool BFCL sends an OpenAI-compatible model, a parsed call becomes BFCL's decoded format, and
the AST checker takes a right call and refuses wrong ones. No model."""
from __future__ import annotations

import pytest

pytest.importorskip("bfcl_eval")

from benchmarks.bfcl_tools import (  # noqa: E402
    CATEGORIES,
    Answer,
    Call,
    decode_calls,
    fenced_calls,
    lenient_correct,
    load_bfcl,
    load_examples,
    same_calls,
    score,
    to_tools,
)
from sparsex.entrypoints.tool_parsers import PARSERS, check_tools  # noqa: E402

pytestmark = pytest.mark.unit

JSON_SCHEMA_TYPES = {"object", "array", "string", "integer", "number", "boolean", "null"}


@pytest.fixture(scope="module")
def bfcl():
    return load_bfcl()


@pytest.fixture(scope="module")
def velocity(bfcl):
    """simple_python_30: a dotted name and a "float" parameter."""
    return next(ex for ex in load_examples(bfcl, "simple", None) if ex.id == "simple_python_30")


def test_function_doc_becomes_the_openai_tool(bfcl, velocity):
    assert velocity.functions[0]["parameters"]["type"] == "dict"           # the checker's copy stays BFCL's own
    assert velocity.messages == [{"role": "user", "content": "What is the final velocity of a vehicle that started "
                                  "from rest and accelerated at 4 m/s^2 for a distance of 300 meters?"}]
    assert velocity.tools == [{"type": "function", "function": {
        "name": "kinematics_final_velocity_from_distance",
        "description": "Calculate the final velocity of an object given the acceleration and distance travelled, "
                       "assuming initial velocity is 0. Note that the provided function is in Python 3 syntax.",
        "parameters": {"type": "object", "properties": {
            "acceleration": {"type": "integer", "description": "Acceleration of the object, m/s^2."},
            "distance": {"type": "integer", "description": "Distance traveled by the object, m."},
            "initial_velocity": {"type": "number", "format": "float",
                                 "description": "Initial velocity of the object. Default is 0, m/s This is a float "
                                              "type value."}},
            "required": ["acceleration", "distance"]}}}]
    params = velocity.tools[0]["function"]["parameters"]
    assert to_tools(bfcl, velocity.functions)[0]["function"]["parameters"] == params


def _types(schema):
    if isinstance(schema, dict):
        if "type" in schema and not isinstance(schema["type"], dict):
            yield schema["type"]
        for v in schema.values():
            yield from _types(v)
    elif isinstance(schema, list):
        for v in schema:
            yield from _types(v)


@pytest.mark.parametrize("category", sorted(CATEGORIES))
def test_every_tool_is_valid_json_schema(bfcl, category):
    """BFCL's type names ("dict", "float", "tuple", "any") never reach the server, and every tool list
    passes the server's own check (names unique, parameters a valid JSON Schema object)."""
    for ex in load_examples(bfcl, category, None):
        found = set(_types([t["function"]["parameters"] for t in ex.tools]))
        assert found <= JSON_SCHEMA_TYPES, (ex.id, found - JSON_SCHEMA_TYPES)
        assert all("." not in t["function"]["name"] for t in ex.tools)
        check_tools(ex.tools, "required")


def test_subsamples_are_deterministic(bfcl):
    first = load_examples(bfcl, "parallel", 3, "first")
    assert [ex.id for ex in first] == ["parallel_0", "parallel_1", "parallel_2"]
    drawn = [ex.id for ex in load_examples(bfcl, "multiple", 5, "random", seed=0)]
    assert drawn == [ex.id for ex in load_examples(bfcl, "multiple", 5, "random", seed=0)]
    assert len(set(drawn)) == 5 and drawn != [f"multiple_{i}" for i in range(5)]
    assert sorted(drawn, key=lambda i: int(i.split("_")[-1])) == drawn             # dataset order


def test_parsed_call_becomes_bfcl_decoded_format():
    text = ('<tool_call>\n{"name": "kinematics_final_velocity_from_distance", '
            '"arguments": {"acceleration": 4, "distance": 300}}\n</tool_call>')
    _, calls = PARSERS["hermes"].extract(text)
    decoded = decode_calls([Call(c.name, c.arguments) for c in calls])
    assert decoded == [{"kinematics_final_velocity_from_distance": {"acceleration": 4, "distance": 300}}]
    assert decode_calls([]) is None
    assert decode_calls([Call("f", "{not json")]) is None


def test_ast_checker_takes_the_right_call_only(bfcl, velocity):
    right = [{"kinematics_final_velocity_from_distance": {"acceleration": 4, "distance": 300}}]
    assert score(bfcl, velocity, right) == (True, "ok")
    assert score(bfcl, velocity, [{"kinematics_final_velocity_from_distance": {"acceleration": 4, "distance": 300,
                                                                                "initial_velocity": 0.0}}])[0]
    wrong_value = [{"kinematics_final_velocity_from_distance": {"acceleration": 4, "distance": 30}}]
    missing = [{"kinematics_final_velocity_from_distance": {"acceleration": 4}}]
    dotted = [{"kinematics.final_velocity_from_distance": {"acceleration": 4, "distance": 300}}]   # not the tool's name
    for wrong in (wrong_value, missing, dotted, right * 2):
        ok, why = score(bfcl, velocity, wrong)
        assert not ok and why != "ok", wrong
    assert score(bfcl, velocity, None) == (False, "no parseable call")


def test_parallel_calls_in_any_order(bfcl):
    ex = next(e for e in load_examples(bfcl, "parallel", 1, "first"))
    assert ex.id == "parallel_0"
    name = ex.tools[0]["function"]["name"]
    calls = [{name: {"artist": "Taylor Swift", "duration": 20}}, {name: {"artist": "Maroon 5", "duration": 15}}]
    assert score(bfcl, ex, calls)[0] and score(bfcl, ex, calls[::-1])[0]
    assert not score(bfcl, ex, calls[:1])[0]


def test_fenced_json_is_a_diagnostic_only(bfcl, velocity):
    content = ('```json\n{\n  "name": "kinematics_final_velocity_from_distance",\n  "arguments": '
               '{\n    "acceleration": 4,\n    "distance": 300\n  }\n}\n```')
    assert PARSERS["hermes"].extract(content)[1] == []                          # no parser reads it
    assert [c.name for c in fenced_calls(content)] == ["kinematics_final_velocity_from_distance"]
    answer = Answer([], content, "stop", [], [], [], 0, 0, 0.0)
    assert lenient_correct(bfcl, velocity, answer) == (True, True)
    other = Answer([], content.replace("300", "30"), "stop", [], [], [], 0, 0, 0.0)
    assert lenient_correct(bfcl, velocity, other) == (True, False)
    assert same_calls(answer, answer) and not same_calls(answer, other)
