"""Conversation history with tool calls, as chat templates want it."""
from __future__ import annotations

import json


def parse_history_arguments(messages: list[dict]) -> list[dict]:
    """Assistant messages' tool_calls with their JSON-string arguments as objects, as chat
    templates expect them (they render `arguments | tojson`)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            fixed = []
            for c in calls:
                fn = c.get("function") if isinstance(c, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        fn = {**fn, "arguments": json.loads(fn["arguments"])}
                    except json.JSONDecodeError:
                        pass
                    c = {**c, "function": fn}
                fixed.append(c)
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
