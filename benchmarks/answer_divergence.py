"""Where and how a reuse policy's rag answers leave full prefill's.

Reads the `requests.json` of a `sparsex bench workload --workload rag` run, rebuilds its prompts from
the recorded config (the tokenizer only: no model runs), and pairs each policy's free-running answer
with full prefill's (`none`) on the same request. For the answers that differ it reports:

  - where: the teacher-forced agreement before the first top-1 miss (`match_len`, tokens) and the
    first differing word of the two answers;
  - how: shorter or longer, and whether the policy's answer brings in a name or number that occurs
    in another passage of the prompt but neither in the passage the question is about nor in the
    question (a fact taken from the wrong passage); full prefill's answers are scored the same way,
    as the baseline rate of that error;
  - what it costs: answer token F1 against the gold answer, both sides, on the differing answers.

    .venv/bin/python benchmarks/answer_divergence.py RUN/requests.json [--policy NAME]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
from typing import Any

from sparsex.bench.workload_config import WorkloadBenchConfig, WorkloadParams
from sparsex.bench.workload_prompts import build_workload
from sparsex.bench.workloads import Request

# a name or number: a capitalised word or a token with a digit (the words an answer copies)
_NAME = re.compile(r"\b(?:[A-Z][\w'-]+|\w*\d[\w-]*)\b")


def names(text: str) -> set[str]:
    return set(_NAME.findall(text))


def first_differing_word(a: str, b: str) -> int:
    wa, wb = a.split(), b.split()
    for i, (x, y) in enumerate(zip(wa, wb)):
        if x != y:
            return i
    return min(len(wa), len(wb))


def target_passage(req: Request) -> int:
    """The passage the question is about: the one that names the question's subject (the words of
    `req.question` after "what is"), else the one sharing most names with the gold answer's entry."""
    subject = re.sub(r"^.*?\bwhat (?:is|was|are|were)\s+", "", req.question or "", flags=re.I).rstrip("?. ")
    hits = [i for i, p in enumerate(req.passages) if subject and subject in p]
    if hits:
        return hits[0]
    want = names(req.question or "")
    return max(range(len(req.passages)), key=lambda i: len(want & names(req.passages[i])))


def borrowed_names(answer: str, req: Request, target: int) -> set[str]:
    """Names in `answer` found in another passage, absent from the target passage and the question."""
    own = names(req.passages[target]) | names(req.question or "")
    others = set().union(*(names(p) for i, p in enumerate(req.passages) if i != target))
    return {n for n in names(answer) if n not in own and n in others}


@dataclasses.dataclass
class Divergence:
    index: int
    match_len: int | None
    first_word: int
    f1_none: float
    f1_policy: float
    words_none: int
    words_policy: int
    borrowed_none: set[str]
    borrowed_policy: set[str]


def load_run(path: str) -> tuple[WorkloadBenchConfig, list[dict[str, Any]]]:
    with open(path) as f:
        run = json.load(f)
    raw = dict(run["config"])
    params = dict(raw.pop("params"))
    params["passage_tokens"] = tuple(params["passage_tokens"])
    params["tool_apis"] = tuple(params["tool_apis"])
    cfg = WorkloadBenchConfig(**raw, params=WorkloadParams(**params))
    if cfg.workload != "rag":
        raise ValueError(f"{path}: a rag run is needed, got workload {cfg.workload!r}")
    return cfg, run["requests"]


def divergences(records: list[dict[str, Any]], requests: list[Request], policy: str) -> tuple[int, list[Divergence]]:
    by: dict[str, dict[int, dict[str, Any]]] = {}
    for r in records:
        by.setdefault(r["policy"], {})[r["index"]] = r
    if "none" not in by or policy not in by:
        raise ValueError(f"the run needs the policies 'none' and {policy!r}; it has {sorted(by)}")
    none, pol = by["none"], by[policy]
    out = []
    for i in sorted(set(none) & set(pol)):
        a, b = none[i]["answer"] or "", pol[i]["answer"] or ""
        if a == b:
            continue
        req = requests[i]
        t = target_passage(req)
        out.append(Divergence(i, pol[i]["match_len"], first_differing_word(a, b), none[i]["f1"], pol[i]["f1"],
                              len(a.split()), len(b.split()), borrowed_names(a, req, t), borrowed_names(b, req, t)))
    return len(set(none) & set(pol)), out


def report(policy: str, total: int, divs: list[Divergence]) -> str:
    n = len(divs)
    if n == 0:
        return f"{policy}: every answer equals full prefill's ({total} requests)"
    worse = sum(d.f1_policy < d.f1_none for d in divs)
    better = sum(d.f1_policy > d.f1_none for d in divs)
    med = statistics.median
    forced = [d.match_len for d in divs if d.match_len is not None]     # runs without fidelity have none
    rows = [
        ("answers that differ from full prefill's", f"{n} of {total}"),
        ("... F1 worse / better / equal", f"{worse} / {better} / {n - worse - better}"),
        ("... F1 on them: full prefill, policy", f"{statistics.mean(d.f1_none for d in divs):.3f}, "
                                                 f"{statistics.mean(d.f1_policy for d in divs):.3f}"),
        ("... differ at the first token (teacher-forced)", f"{forced.count(0)}" if forced else "–"),
        ("... teacher-forced agreement before the first miss, median [min, max] tokens",
         f"{med(forced):.0f} [{min(forced)}, {max(forced)}]" if forced else "–"),
        ("... first differing word, median", f"{med([d.first_word for d in divs]):.0f}"),
        ("... words: full prefill, policy (mean)", f"{statistics.mean(d.words_none for d in divs):.1f}, "
                                                   f"{statistics.mean(d.words_policy for d in divs):.1f}"),
        ("... a name from another passage: full prefill's answer, policy's",
         f"{sum(bool(d.borrowed_none) for d in divs)}, {sum(bool(d.borrowed_policy) for d in divs)}"),
        ("... of the policy's worse answers, with a name from another passage",
         f"{sum(bool(d.borrowed_policy) for d in divs if d.f1_policy < d.f1_none)} of {worse}"),
    ]
    lines = [f"policy `{policy}`", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("requests_json")
    ap.add_argument("--policy", action="append", help="a policy of the run (default: every one but none)")
    ap.add_argument("--examples", type=int, default=0, help="print this many worse answers side by side")
    args = ap.parse_args(argv)
    cfg, records = load_run(args.requests_json)
    from sparsex.models.loader import load_model
    tokenizer = load_model(cfg.model).tokenizer        # the prompts are rebuilt exactly as the run built them
    requests = build_workload(cfg, tokenizer)
    policies = args.policy or sorted({r["policy"] for r in records} - {"none"})
    for policy in policies:
        total, divs = divergences(records, requests, policy)
        print(report(policy, total, divs))
        print()
        for d in [d for d in divs if d.f1_policy < d.f1_none][:args.examples]:
            by = {(r["policy"], r["index"]): r for r in records}
            print(f"- request {d.index}: {requests[d.index].question}  (gold: {requests[d.index].reference_answer})")
            print(f"  full prefill ({d.f1_none:.2f}): {by['none', d.index]['answer']}")
            print(f"  {policy} ({d.f1_policy:.2f}): {by[policy, d.index]['answer']}  borrowed {sorted(d.borrowed_policy)}")


if __name__ == "__main__":
    main()
