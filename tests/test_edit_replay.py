"""The edit-replay benchmark (sparsex.bench.edit_replay): its cases change only what they say they
change, deterministically, and on the real model the sparsex cache serves >= 90% of the unchanged
tokens of a chat with an edited earlier message and of an agent tool result with a new timestamp and
request id, where exact prefix caching serves far less."""
from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import json
from types import SimpleNamespace

import numpy as np
import pytest

from sparsex import cli
from sparsex.bench import edit_replay as er
from sparsex.outputs import ReusedSpan


def prompts(tok, cases):
    return [er.tokenize_case(tok, c, len(tok)) for c in cases]


# ---------------------------------------------------------------------------- cases

@pytest.mark.unit
def test_chat_case_edits_one_earlier_message_in_a_few_tokens(tok):
    cases = er.chat_cases(tok, 4, seed=0)
    for case, cp in zip(cases, prompts(tok, cases)):
        n = len(case.first)
        assert case.kind == "chat" and case.num_new_messages == 2
        assert [m["role"] for m in case.second[n:]] == ["assistant", "user"]
        assert 1 <= case.edited_message <= n - 2              # never the system prompt nor the last message
        for i, (a, b) in enumerate(zip(case.first, case.second)):
            assert (a == b) == (i != case.edited_message), i
        # the text edit is one word: what differs between the two versions is a single short run
        old, new = case.first[case.edited_message]["content"], case.second[case.edited_message]["content"]
        ops = [op for op in difflib.SequenceMatcher(None, old.split(), new.split(), autojunk=False).get_opcodes()
               if op[0] != "equal"]
        assert len(ops) == 1 and ops[0][0] in ("replace", "insert") and ops[0][4] - ops[0][3] == 1, ops
        # and so is the token edit: request 1's prompt is request 2's shared part but for a few tokens
        assert 1_000 <= len(cp.first.token_ids) <= 2_500
        assert 1 <= cp.num_edit_tokens <= er.MAX_EDIT_TOKENS
        assert cp.unchanged.sum() >= len(cp.first.token_ids) - er.MAX_EDIT_TOKENS
        assert not cp.unchanged[cp.shared_end:].any() and cp.shared_end < len(cp.second.token_ids)
        start, end = cp.edit_span
        assert cp.second.token_ids[:start] == cp.first.token_ids[:start]
        tail = cp.shared_end - end
        assert cp.second.token_ids[end:cp.shared_end] == cp.first.token_ids[-tail:]
        assert 0 < start and end - start <= er.MAX_EDIT_TOKENS


@pytest.mark.unit
def test_agent_case_differs_only_in_timestamp_and_request_id(tok):
    cases = er.agent_cases(tok, 3, seed=0)
    for case, cp in zip(cases, prompts(tok, cases)):
        n, k = len(case.first), case.edited_message
        assert case.kind == "agent" and k == n - 1 and case.first[k]["role"] == "tool"
        assert case.first[:k] == case.second[:k]
        assert [m["role"] for m in case.second[n:]] == ["assistant", "tool"]
        before, after = json.loads(case.first[k]["content"]), json.loads(case.second[k]["content"])
        assert list(before) == ["request_id", "retrieved_at", "results"]
        assert before["results"] == after["results"] and len(before["results"]) == 3
        assert before["request_id"] != after["request_id"] and before["retrieved_at"] != after["retrieved_at"]
        t1, t2 = (dt.datetime.strptime(d["retrieved_at"], "%Y-%m-%dT%H:%M:%SZ") for d in (before, after))
        assert dt.timedelta(0) < t2 - t1 < dt.timedelta(hours=1)
        # the rest of the JSON is byte-identical
        same = {**after, "request_id": before["request_id"], "retrieved_at": before["retrieved_at"]}
        assert er.tool_result(same["request_id"], same["retrieved_at"], same["results"]) == case.first[k]["content"]
        # real text: every result is a Wikipedia summary
        assert all(r["href"].startswith("https://en.wikipedia.org/wiki/") and len(r["body"]) >= 400
                   for r in before["results"])
        # tokens: the edit covers the id and the time, and nothing before them
        start, end = cp.edit_span
        assert cp.second.token_ids[:start] == cp.first.token_ids[:start]
        changed = cp.second.token_ids[start:end]
        assert "retrieved_at" in tok.decode(changed) and after["request_id"][-4:] in tok.decode(changed)
        assert cp.num_edit_tokens <= 40


@pytest.mark.unit
def test_cases_are_deterministic_for_a_seed(tok):
    a = er.build_cases(tok, er.KINDS, 2, seed=3)
    b = er.build_cases(tok, er.KINDS, 2, seed=3)
    c = er.build_cases(tok, er.KINDS, 2, seed=4)
    assert a == b and [x.kind for x in a] == ["chat", "chat", "agent", "agent"]
    assert a != c


@pytest.mark.unit
def test_token_diff_and_served_mask_on_known_ids():
    first = list(range(10, 30))                                  # 20 tokens
    second = first[:7] + [99, 98] + first[8:] + [5, 6, 7]       # token 7 replaced by two, then 3 new tokens
    unchanged, (start, end) = er.token_diff(first, second, shared_end=len(second) - 3)
    assert (start, end) == (7, 9)
    assert unchanged.tolist() == [True] * 7 + [False] * 2 + [True] * 12 + [False] * 3
    served = er.served_mask(len(second), 4, [ReusedSpan(12, 20, "request")])
    assert np.flatnonzero(served).tolist() == [0, 1, 2, 3, *range(12, 20)]
    assert er._runs(unchanged & ~served) == [(4, 7), (9, 12), (20, 21)]


def _record(kind: str, cache: str, unchanged: int, served: int) -> er.CaseRecord:
    return er.CaseRecord(case_id=f"{kind}-0", kind=kind, cache=cache, change="", prompt_tokens=unchanged + 10,
                         unchanged_tokens=unchanged, edit_tokens=1, new_tokens=9, edit_start=5, prefix_tokens=0,
                         reused_tokens=served, recomputed_tokens=0, reused_by_source={}, served_unchanged=served,
                         unserved_before_edit=0, unserved_after_edit=unchanged - served, unserved_runs=[],
                         reuse_skipped=None, ttft_ms=1.0, full_prefill_ttft_ms=2.0, first_token_match=True,
                         match_len=16, fidelity_tokens=16)


@pytest.mark.unit
def test_summary_weights_tokens_and_flags_the_target():
    recs = [_record("chat", "sparsex", 1000, 950), _record("chat", "sparsex", 100, 50),
            _record("agent", "sparsex", 1000, 990)]
    s = er.summarize(recs, "chat", "sparsex")
    assert s.served_share == pytest.approx(1000 / 1100) and s.served_share_mean.mean == pytest.approx(0.725)
    assert s.meets_target and s.min_case_share == 0.5 and s.ttft_ratio == 0.5
    assert er.summarize(recs, "all", "sparsex").cases == 3
    table = er.summary_markdown([s])
    assert "| chat | sparsex | 2 |" in table and "**90.9%**" in table and "meets the 90% target" in table
    with pytest.raises(ValueError, match="prefix"):
        er.summarize(recs, "chat", "prefix")


@pytest.mark.unit
@pytest.mark.parametrize("make, match", [
    (lambda: er.parse_names("chat,foo", er.KINDS, "--kinds"), "'foo'"),
    (lambda: er.parse_names("prefix,prefix", er.CACHES, "--caches"), "repeated"),
    (lambda: er.parse_names(" , ", er.CACHES, "--caches"), "--caches"),
    (lambda: er.EditReplayConfig(cases=0).verify(), "cases"),
    (lambda: er.EditReplayConfig(caches=("prefix", "lru")).verify(), "'lru'"),
    (lambda: er.EditReplayConfig(num_blocks=0).verify(), "num_blocks"),
    (lambda: er.EditReplayConfig(dtype="int8").verify(), "int8"),
    (lambda: er.build_cases(None, ("rag",), 1), "'rag'"),
    (lambda: er.chat_cases(None, 0), "num_cases"),
    (lambda: er.agent_cases(None, 1, results_per_call=0), "results_per_call"),
])
def test_bad_arguments_raise_value_errors_naming_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.unit
@pytest.mark.parametrize("argv, match", [
    (["--kinds", "chat,nope"], "nope"),
    (["--caches", "exact"], "exact"),
    (["--cases", "-1"], "cases"),
    (["--chat-tokens", "0"], "chat_tokens"),
])
def test_cli_rejects_bad_arguments_with_status_2(argv, match, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert cli.main(["bench", "edit", *argv, "--out", out]) == 2
    assert match in capsys.readouterr().err
    assert er.main([*argv, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparsex bench edit: error:") and match in err
    assert not (tmp_path / "out").exists()


@pytest.mark.unit
def test_cli_rejects_a_bad_thread_count_before_anything_runs(tmp_path, capsys):
    for run in (cli.main, er.main):
        argv = ["bench", "edit"] if run is cli.main else []
        with pytest.raises(SystemExit) as exc:
            run([*argv, "--threads", "0", "--out", str(tmp_path)])
        assert exc.value.code == 2 and "--threads: must be an integer >= 1, got '0'" in capsys.readouterr().err


@pytest.mark.unit
def test_cli_wires_the_subcommand():
    args = cli.build_parser().parse_args(["bench", "edit", "--out", "x"])
    assert args.func is er.run_edit_replay_cli
    cfg = er.config_from_args(args)
    assert cfg.kinds == ("chat", "agent") and cfg.caches == ("prefix", "sparsex") and cfg.cases == 8


# ---------------------------------------------------------------------------- on the model

@pytest.mark.model
def test_sparsex_serves_unchanged_tokens_where_prefix_caching_cannot(smollm2, keep_threads, tmp_path, capsys):
    out = tmp_path / "edit"
    # 4 greedy tokens against full prefill's (16 by default): first_token_match needs one
    assert cli.main(["bench", "edit", "--cases", "1", "--fidelity-tokens", "4", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| chat | sparsex |" in printed and "| agent | prefix |" in printed
    assert (out / "summary.md").read_text() in printed
    doc = json.loads((out / "results.json").read_text())
    rows = {(s["kind"], s["cache"]): s for s in doc["summaries"]}
    assert set(rows) == {(k, c) for k in ("chat", "agent", "all") for c in ("prefix", "sparsex")}
    for kind in ("chat", "agent"):
        sparsex, prefix = rows[(kind, "sparsex")], rows[(kind, "prefix")]
        assert sparsex["served_share"] >= er.TARGET_SHARE and sparsex["meets_target"], sparsex
        assert prefix["served_share"] <= sparsex["served_share"] - 0.25, (prefix, sparsex)
        # the same exact prefix under both: what sparsex adds is the reuse after the edit
        assert sparsex["prefix_tokens"] == prefix["prefix_tokens"] > 0
    for r in doc["records"]:
        assert r["unchanged_tokens"] > 1_000 and r["edit_tokens"] >= 1
        if r["cache"] == "sparsex":
            assert set(r["reused_by_source"]) <= {"segment", "indexed", "request", "approx_prefix"}
            assert r["reused_tokens"] > 0 and r["unserved_after_edit"] < 0.1 * r["unchanged_tokens"]
        else:
            assert r["reused_tokens"] == 0 and r["first_token_match"]      # prefix caching is exact
