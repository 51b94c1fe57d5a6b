"""The README's offline quickstart runs as written and prints what its comment says."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_quickstart_reuses_passages_of_a_one_message_prompt_as_its_comment_says():
    code = _python_blocks(README.read_text())[0]
    # the comment under the last print states the counters the example prints
    promised = re.search(r"^# (\d+) (\d+) (\d+) (None|\S.*?):", code, flags=re.M)
    assert promised is not None, "the quickstart no longer states the numbers it prints"
    out = io.StringIO()
    scope: dict = {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), scope)
    printed = out.getvalue().strip().splitlines()[-1].split()
    assert printed == list(promised.groups()), (printed, promised.groups())
    o = scope["out"]
    assert o.num_reused_tokens > 0 and o.reuse_skipped is None
    assert o.num_recomputed_tokens < o.num_reused_tokens
    # found by content, inside the passages: nothing in the prompt was marked
    assert sum(s.num_tokens for s in o.reused_spans) == o.num_reused_tokens
    assert {s.source for s in o.reused_spans} <= {"indexed", "request"}
    # each reused span is a run of the first prompt's tokens (the same passages, in another order)
    engine, passages = scope["llm"].llm_engine, scope["passages"]
    first = engine.chat_to_prompt([
        {"role": "system", "content": "Answer the question from the passages.\n\n" + "".join(passages)},
        {"role": "user", "content": "Which river carries the most water?"}]).token_ids
    ids = o.prompt_token_ids
    for s in o.reused_spans:
        run = ids[s.start:s.end]
        assert any(first[i:i + len(run)] == run for i in range(len(first))), s
    assert o.outputs[0].text.strip()
