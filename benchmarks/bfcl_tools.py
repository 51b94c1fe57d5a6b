"""BFCL tool-call parity: the AST accuracy of one model on BFCL's `simple`, `multiple` and `parallel`
categories through `sparsex serve` (tool_choice "auto", and "required", i.e. decoding constrained to
a call) against the same model through Hugging Face transformers, with the same prompts.

    .venv/bin/python benchmarks/bfcl_tools.py [--model qwen2.5-coder-0.5b-instruct] [--per-category 50]
        [--categories simple,multiple,parallel] [--sample random|first] [--seed 0] [--dtype float32]
        [--threads 1] [--cache none] [--max-tokens 384] [--base-url http://127.0.0.1:PORT] [--out DIR]

Data: BFCL v4 as the installed `bfcl-eval` package ships it (`simple` is `simple_python`), with the
Python hint BFCL adds to every function description. `--per-category N` takes N examples per category:
a seeded random sample (`--sample random --seed 0`, kept in the dataset's order) or the first N.

Tools: each example's function docs become OpenAI `tools` by bfcl_eval's own `convert_to_tool`, as
BFCL sends them to an OpenAI-compatible function-calling model (types "dict" / "float" / "tuple"
become "object" / "number" / "array", "." in a name becomes "_"); the messages are the example's
first turn, unchanged, no system prompt.

Three answers per example, all greedy:
  * SparseX auto: a real `sparsex serve` (started here on a free loopback port with the parser its
    chat template implies, hermes for Qwen2.5-Coder, and stopped by pid at the end; or `--base-url`
    of a running one), the official `openai` client, temperature 0, tool_choice "auto";
  * SparseX required: the same request with tool_choice "required";
  * transformers: the messages and tools rendered by the tokenizer's chat template
    (`apply_chat_template(messages, tools=..., add_generation_prompt=True)`), greedy `generate`
    (stopping at the model's EOS, as the engine does), the text parsed by SparseX's own hermes parser:
    only the model path differs from "SparseX auto".
The prompt token ids the server builds (`POST /tokenize` with the same messages and tools, checked
against the chat response's usage) are compared with transformers'; the table counts the matches.

Scoring: the calls become BFCL's decoded format (`[{name: {arg: value}}]`) and go through bfcl_eval's
AST checker (language Python; names compared with "." as "_", as BFCL scores OpenAI-style models).
An answer without a parseable call is wrong. The table gives each path's accuracy, the paired
difference to transformers with a bootstrap 95% interval over examples, and how many examples got
the same calls from SparseX auto and transformers. Both sides record each output token's top-1 minus
top-2 logprob (the server through `logprobs`): where the two answers part, the per-example JSON
(`--out`) has the first differing token, each side's margin and runner-up there (a near-tie is float
noise, not a different computation), and where they agree, how far apart their margins are.

Qwen2.5-Coder-0.5B often writes its call as JSON in a markdown code fence instead of the template's
`<tool_call>` markup; no parser reads that, so it scores as no call. A second table counts those
answers and scores them as if they were calls (a diagnostic of the format, not of the server).

Order: the "auto" requests (one at a time: a batch of one, as transformers runs) and transformers go
at once, one torch thread each (the server in its process, transformers in this one; `--threads` sets
both, `--sequential` runs them one after the other); then the "required" requests,
`--required-concurrency` (2) in flight, which the server batches. `--cache none` (default) keeps the
server from reusing KV across requests, so each prompt is prefilled from scratch as transformers does.

bfcl-eval is installed without its dependencies (it is here for its data and checker): the modules
that import API clients and tree-sitter only for other models and languages get stand-ins
(`load_bfcl`), only when they do not import.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import importlib.util
import itertools
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
import types
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)        # this checkout's sparsex, in this process as in the server it starts

# the issue's category names -> BFCL v4's
CATEGORIES = {"simple": "simple_python", "multiple": "multiple", "parallel": "parallel"}
# the name under which the AST checker is told the tool names lost their "." (underscore_to_dot)
SCORING_MODEL = "sparsex-openai-compatible-FC"


# ---- bfcl_eval --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bfcl:
    """The pieces of bfcl_eval this benchmark uses."""
    load_dataset_entry: Callable[..., list[dict]]
    load_ground_truth_entry: Callable[[str], list[dict]]
    convert_to_tool: Callable[..., list[dict]]
    ast_checker: Callable[..., dict]
    is_function_calling_format_output: Callable[[Any], bool]
    type_mapping: dict[str, str]            # GORILLA_TO_OPENAPI
    openai_style: Any                       # ModelStyle.OPENAI_COMPLETIONS
    python: Any                             # Language.PYTHON


def _raise_unavailable(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("a stand-in: this part of bfcl_eval needs a dependency that is not installed")


def _stand_in(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def load_bfcl() -> Bfcl:
    """bfcl_eval's loaders, tool conversion and AST checker. Where a module of it does not import for
    a dependency this benchmark never exercises, a stand-in takes its place: tenacity (API retries),
    the Java / JavaScript call parsers (tree-sitter), and the model registry `model_config` (it imports
    every vendor's client; the AST checker reads only `underscore_to_dot` from it)."""
    if importlib.util.find_spec("tenacity") is None:
        _stand_in("tenacity", retry=_raise_unavailable, retry_if_exception_message=_raise_unavailable,
                  retry_if_exception_type=_raise_unavailable, wait_random_exponential=_raise_unavailable)
    for module, fn in (("java_parser", "parse_java_function_call"), ("js_parser", "parse_javascript_function_call")):
        name = "bfcl_eval.model_handler.parser." + module
        try:
            importlib.import_module(name)
        except ImportError:
            _stand_in(name, **{fn: _raise_unavailable})
    try:
        from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING
    except ImportError:
        _stand_in("bfcl_eval.constants.model_config", MODEL_CONFIG_MAPPING={})
        from bfcl_eval.constants.model_config import MODEL_CONFIG_MAPPING
    MODEL_CONFIG_MAPPING.setdefault(SCORING_MODEL, types.SimpleNamespace(underscore_to_dot=True))

    from bfcl_eval.constants.enums import Language, ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    from bfcl_eval.model_handler.utils import convert_to_tool
    from bfcl_eval.utils import is_function_calling_format_output, load_dataset_entry, load_ground_truth_entry
    return Bfcl(load_dataset_entry, load_ground_truth_entry, convert_to_tool, ast_checker,
                is_function_calling_format_output, GORILLA_TO_OPENAPI, ModelStyle.OPENAI_COMPLETIONS, Language.PYTHON)


# ---- examples ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Example:
    id: str
    category: str                           # simple | multiple | parallel
    bfcl_category: str                      # simple_python | multiple | parallel
    messages: list[dict[str, Any]]          # the first turn, as BFCL sends it
    tools: list[dict[str, Any]]             # OpenAI tools, by bfcl_eval's convert_to_tool
    functions: list[dict[str, Any]]         # the BFCL docs the AST checker reads (no language hint)
    ground_truth: list[dict[str, Any]]


def to_tools(bfcl: Bfcl, functions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """BFCL function docs -> OpenAI chat `tools`, as BFCL builds them for an OpenAI-compatible model."""
    return bfcl.convert_to_tool(functions, bfcl.type_mapping, bfcl.openai_style)


def load_examples(bfcl: Bfcl, category: str, n: int | None, sample: str = "random", seed: int = 0) -> list[Example]:
    """`n` examples of one category (None: all): a seeded sample kept in dataset order, or the first n."""
    bfcl_category = CATEGORIES[category]
    prompts = bfcl.load_dataset_entry(bfcl_category, include_prereq=False)
    plain = {e["id"]: e for e in bfcl.load_dataset_entry(bfcl_category, include_prereq=False,
                                                         include_language_specific_hint=False)}
    answers = {e["id"]: e["ground_truth"] for e in bfcl.load_ground_truth_entry(bfcl_category)}
    chosen = range(len(prompts))
    if n is not None and n < len(prompts):
        chosen = sorted(random.Random(seed).sample(range(len(prompts)), n)) if sample == "random" else range(n)
    return [Example(e["id"], category, bfcl_category, e["question"][0], to_tools(bfcl, e["function"]),
                    plain[e["id"]]["function"], answers[e["id"]]) for e in (prompts[i] for i in chosen)]


# ---- answers ----------------------------------------------------------------------------------
@dataclass
class Call:
    name: str
    arguments: str                          # the JSON text of the arguments, as the model wrote it


@dataclass
class Answer:
    """One path's answer to one example."""
    calls: list[Call]
    content: str | None
    finish_reason: str | None
    tokens: list[str]                       # each output token's text (for where two answers part)
    margins: list[float | None]             # top-1 minus top-2 logprob at each output token
    runner_up: list[str | None]             # the second choice at each output token
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    error: str | None = None                # the request failed
    decoded: list[dict[str, Any]] | None = None
    correct: bool = False
    verdict: str = ""                       # "ok" or why not


def decode_calls(calls: list[Call]) -> list[dict[str, Any]] | None:
    """Parsed calls -> BFCL's decoded format `[{name: {arg: value}}]` (BFCL's OpenAI decode_ast);
    None when there is no call or an arguments text is not JSON."""
    if not calls:
        return None
    try:
        return [{c.name: json.loads(c.arguments)} for c in calls]
    except json.JSONDecodeError:
        return None


def score(bfcl: Bfcl, ex: Example, decoded: list[dict[str, Any]] | None) -> tuple[bool, str]:
    """(correct, "ok" or why not) by bfcl_eval's AST checker."""
    if decoded is None:
        return False, "no parseable call"
    if not bfcl.is_function_calling_format_output(decoded):
        return False, "not [{name: {arg: value}}]"
    try:
        result = bfcl.ast_checker(ex.functions, decoded, ex.ground_truth, bfcl.python, ex.bfcl_category,
                                  SCORING_MODEL)
    except Exception as e:                  # the checker can trip on odd values; that answer is wrong
        return False, f"checker raised {type(e).__name__}: {e}"
    if result["valid"]:
        return True, "ok"
    return False, f"{result.get('error_type')}: {'; '.join(map(str, result.get('error', [])))}"


_FENCE = re.compile(r"```[A-Za-z]*\n(.*?)```", re.S)


def fenced_calls(content: str | None) -> list[Call]:
    """A diagnostic, not a SparseX parser: calls written as JSON in a markdown code fence
    (`{"name": ..., "arguments": {...}}` objects, one or several) instead of the chat template's call
    markup. No tool-call parser reads these; the summary counts them and scores them apart."""
    calls = []
    decoder = json.JSONDecoder()
    for block in _FENCE.findall(content or ""):
        i, block = 0, block.strip()
        while i < len(block):
            try:
                obj, end = decoder.raw_decode(block, i)
            except json.JSONDecodeError:
                break
            for o in obj if isinstance(obj, list) else [obj]:
                if isinstance(o, dict) and isinstance(o.get("name"), str) and isinstance(o.get("arguments"), dict):
                    calls.append(Call(o["name"], json.dumps(o["arguments"])))
            i = end
            while i < len(block) and block[i] in " \t\r\n,":
                i += 1
    return calls


def lenient_correct(bfcl: Bfcl, ex: Example, a: Answer) -> tuple[bool, bool]:
    """(the answer holds no parsed call but a fenced JSON call, that answer right when read as calls)."""
    if a.calls:
        return False, a.correct
    fenced = fenced_calls(a.content)
    return bool(fenced), bool(fenced) and score(bfcl, ex, decode_calls(fenced))[0]


def same_calls(a: Answer, b: Answer) -> bool:
    """The same calls (names and argument values), in the same order; two answers without any call
    count as the same when their text is."""
    if not a.calls and not b.calls:
        return (a.content or "").strip() == (b.content or "").strip()
    norm = lambda ans: [(c.name, json.dumps(json.loads(c.arguments), sort_keys=True))    # noqa: E731
                        if _is_json(c.arguments) else (c.name, c.arguments) for c in ans.calls]
    return norm(a) == norm(b)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


def margin_gap(a: Answer, b: Answer) -> float | None:
    """The largest |margin difference| over the tokens both answers share from the start: how far
    apart the two paths' logprobs are where they agree."""
    gaps = []
    for ta, tb, ma, mb in zip(a.tokens, b.tokens, a.margins, b.margins):
        if ta != tb:
            break
        if ma is not None and mb is not None:
            gaps.append(abs(ma - mb))
    return max(gaps) if gaps else None


def first_divergence(a: Answer, b: Answer) -> dict[str, Any] | None:
    """Where two answers' output tokens first differ, with each side's top-1 minus top-2 logprob there."""
    for i, (ta, tb) in enumerate(zip(a.tokens, b.tokens)):
        if ta != tb:
            return {"index": i, "sparsex_token": ta, "transformers_token": tb,
                    "sparsex_margin": a.margins[i] if i < len(a.margins) else None,
                    "transformers_margin": b.margins[i] if i < len(b.margins) else None,
                    "sparsex_runner_up": a.runner_up[i] if i < len(a.runner_up) else None,
                    "transformers_runner_up": b.runner_up[i] if i < len(b.runner_up) else None,
                    "common_prefix": "".join(a.tokens[:i])[-80:]}
    if len(a.tokens) != len(b.tokens):
        i = min(len(a.tokens), len(b.tokens))
        return {"index": i, "sparsex_token": a.tokens[i] if i < len(a.tokens) else "<end>",
                "transformers_token": b.tokens[i] if i < len(b.tokens) else "<end>",
                "sparsex_margin": None, "transformers_margin": None, "common_prefix": "".join(a.tokens[:i])[-80:]}
    return None


# ---- SparseX: `sparsex serve` through the openai client -----------------------------------------
class ServeProcess:
    """`sparsex serve MODEL` on a free loopback port, its log in a file; stopped by pid."""

    def __init__(self, model: str, dtype: str, threads: int, cache: str, max_model_len: int, log_path: str):
        from sparsex.bench.redis_server import free_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "sparsex.cli", "serve", model, "--host", "127.0.0.1",
                     "--port", str(self.port), "--dtype", dtype, "--cache", cache, "--torch-threads", str(threads),
                     "--max-model-len", str(max_model_len), "--max-num-seqs", "2", "--log-level", "warning"]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900.0) -> None:
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.args, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sparsex serve exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"sparsex serve did not come up in {timeout_s:.0f} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()                                  # SIGTERM to its pid: drains, then exits
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class SparseXClient:
    def __init__(self, base_url: str, max_tokens: int):
        import openai
        self.base_url = base_url.rstrip("/")
        self.client = openai.OpenAI(base_url=self.base_url + "/v1", api_key=os.environ.get("SPARSEX_API_KEY", "none"),
                                    max_retries=0, timeout=1800)
        self.model = self.client.models.list().data[0].id
        self.max_tokens = max_tokens

    def prompt_ids(self, ex: Example) -> list[int]:
        r = httpx.post(self.base_url + "/tokenize", timeout=300,
                       headers={"Authorization": f"Bearer {self.client.api_key}"},
                       json={"model": self.model, "messages": ex.messages, "tools": ex.tools})
        r.raise_for_status()
        return r.json()["tokens"]

    def answer(self, ex: Example, tool_choice: str) -> Answer:
        t0 = time.perf_counter()
        try:
            r = self.client.chat.completions.create(model=self.model, messages=ex.messages, tools=ex.tools,
                                                    tool_choice=tool_choice, temperature=0,
                                                    max_tokens=self.max_tokens, logprobs=True, top_logprobs=2)
        except Exception as e:                  # an error answer is a wrong answer, recorded
            return Answer([], None, None, [], [], [], 0, 0, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
        seconds = time.perf_counter() - t0
        choice = r.choices[0]
        calls = [Call(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        lps = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
        margins = [t.top_logprobs[0].logprob - t.top_logprobs[1].logprob if len(t.top_logprobs) > 1 else None
                   for t in lps]
        runner_up = [t.top_logprobs[1].token if len(t.top_logprobs) > 1 else None for t in lps]
        return Answer(calls, choice.message.content, choice.finish_reason, [t.token for t in lps], margins,
                      runner_up, r.usage.prompt_tokens, r.usage.completion_tokens, seconds)


# ---- transformers -----------------------------------------------------------------------------
class HFRunner:
    """The same model through transformers: the tokenizer's chat template, greedy generate, and
    SparseX's tool parser on the text."""

    def __init__(self, model: str, dtype: str, max_tokens: int, parser_name: str | None):
        from transformers import AutoTokenizer

        from sparsex.bench.hf_reference import load_hf_reference
        from sparsex.entrypoints.tool_parsers import resolve_parser
        from sparsex.models.loader import prepare_model_dir
        model_dir = prepare_model_dir(model)                # the HF-style directory the engine loads too
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.ref = load_hf_reference(model_dir, dtype)
        self.parser = resolve_parser(parser_name, self.tokenizer.chat_template)
        if self.parser is None:
            raise ValueError(f"{model}'s chat template has no tool-call convention SparseX knows: "
                             "pass --tool-call-parser")
        self.eos = self.ref.model.generation_config.eos_token_id or self.ref.model.config.eos_token_id
        self.max_tokens = max_tokens

    def prompt_ids(self, ex: Example) -> list[int]:
        ids = self.tokenizer.apply_chat_template(ex.messages, tools=ex.tools, add_generation_prompt=True,
                                                 tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def answer(self, ex: Example, ids: list[int]) -> Answer:
        import torch
        t0 = time.perf_counter()
        with torch.inference_mode():
            inp = torch.tensor([ids])
            out = self.ref.model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=self.max_tokens,
                                          do_sample=False, eos_token_id=self.eos, pad_token_id=self.ref.pad_token_id,
                                          output_logits=True, return_dict_in_generate=True)
        seconds = time.perf_counter() - t0
        gen = out.sequences[0, len(ids):].tolist()
        lps = torch.log_softmax(torch.cat(out.logits).float(), -1)            # [steps, vocab]
        top2 = lps.topk(2, dim=-1)
        margins = (top2.values[:, 0] - top2.values[:, 1]).tolist()
        runner_up = [self.tokenizer.decode([t]) for t in top2.indices[:, 1].tolist()]
        eos = {self.eos} if isinstance(self.eos, int) else set(self.eos)
        finished = bool(gen) and gen[-1] in eos
        text = self.tokenizer.decode(gen[:-1] if finished else gen, skip_special_tokens=True)
        content, calls = self.parser.extract(text)
        tokens = [self.tokenizer.decode([t]) for t in gen]           # the EOS too, as the server's logprobs
        reason = ("tool_calls" if calls else "stop") if finished else "length"
        return Answer([Call(c.name, c.arguments) for c in calls], content, reason, tokens, margins, runner_up,
                      len(ids), len(gen), seconds)


# ---- the run ----------------------------------------------------------------------------------
@dataclass
class Record:
    example: Example
    transformers: Answer
    auto: Answer
    required: Answer
    prompt_ids_match: bool
    same_calls: bool
    same_tokens: bool
    divergence: dict[str, Any] | None = None
    margin_gap: float | None = None         # margin_gap(auto, transformers)
    fenced: dict[str, tuple[bool, bool]] = field(default_factory=dict)   # path -> lenient_correct


@dataclass
class Row:
    category: str
    n: int
    acc_transformers: float
    acc_auto: float
    acc_required: float
    auto_minus_transformers: tuple[float, float, float]       # mean, low, high
    required_minus_transformers: tuple[float, float, float]
    same_calls: int
    same_tokens: int
    prompt_ids_match: int
    fenced_auto: int = 0                    # answers with no call, a fenced JSON call instead
    fenced_transformers: int = 0
    lenient_auto: float = 0.0               # accuracy when those are read as calls
    lenient_transformers: float = 0.0


def summarize(category: str, records: list[Record]) -> Row:
    from sparsex.bench.stats import paired_difference
    hf = [float(r.transformers.correct) for r in records]
    auto = [float(r.auto.correct) for r in records]
    req = [float(r.required.correct) for r in records]
    d_auto, d_req = paired_difference(auto, hf), paired_difference(req, hf)
    n = len(records)
    fenced = lambda path, k: sum(r.fenced[path][k] for r in records)          # noqa: E731
    return Row(category, n, sum(hf) / n, sum(auto) / n, sum(req) / n, (d_auto.mean, d_auto.low, d_auto.high),
               (d_req.mean, d_req.low, d_req.high), sum(r.same_calls for r in records),
               sum(r.same_tokens for r in records), sum(r.prompt_ids_match for r in records),
               fenced("auto", 0), fenced("transformers", 0), fenced("auto", 1) / n, fenced("transformers", 1) / n)


def _pp(d: tuple[float, float, float]) -> str:
    mean, low, high = (100 * x for x in d)
    return f"{mean:+.1f} pp [{low:+.1f}, {high:+.1f}]"


def table(rows: list[Row]) -> str:
    lines = ["| category | n | transformers | SparseX auto | SparseX required | auto − transformers (95% CI) "
             "| required − transformers (95% CI) | same calls (auto, transformers) | same prompt ids |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.category} | {r.n} | {100 * r.acc_transformers:.1f}% | {100 * r.acc_auto:.1f}% "
                     f"| {100 * r.acc_required:.1f}% | {_pp(r.auto_minus_transformers)} "
                     f"| {_pp(r.required_minus_transformers)} | {r.same_calls}/{r.n} | {r.prompt_ids_match}/{r.n} |")
    return "\n".join(lines)


def fenced_table(rows: list[Row]) -> str:
    lines = ["| category | n | no call, a fenced JSON call instead (auto / transformers) "
             "| accuracy reading those as calls (auto / transformers) |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.category} | {r.n} | {r.fenced_auto} / {r.fenced_transformers} "
                     f"| {100 * r.lenient_auto:.1f}% / {100 * r.lenient_transformers:.1f}% |")
    return "\n".join(lines)


def _scored(bfcl: Bfcl, ex: Example, a: Answer, prompt_len: int | None = None) -> Answer:
    a.decoded = decode_calls(a.calls)
    a.correct, a.verdict = score(bfcl, ex, a.decoded)
    if a.error:
        a.verdict = "request failed: " + a.error
    elif prompt_len is not None and a.prompt_tokens != prompt_len:
        raise RuntimeError(f"{ex.id}: /tokenize gave {prompt_len} prompt tokens, the chat response {a.prompt_tokens}")
    return a


def run_sparsex_auto(client: SparseXClient, bfcl: Bfcl, examples: list[Example],
                     log: Callable[[str], None]) -> dict[str, tuple[list[int], Answer]]:
    """tool_choice "auto", one request at a time (a batch of one, as transformers runs)."""
    out = {}
    for i, ex in enumerate(examples):
        ids = client.prompt_ids(ex)
        a = _scored(bfcl, ex, client.answer(ex, "auto"), len(ids))
        out[ex.id] = (ids, a)
        log(f"[sparsex auto {i + 1}/{len(examples)}] {ex.id}: {a.verdict[:70]} ({a.seconds:.1f} s)")
    return out


def run_sparsex_required(client: SparseXClient, bfcl: Bfcl, examples: list[Example], concurrency: int,
                         log: Callable[[str], None]) -> dict[str, Answer]:
    """tool_choice "required", `concurrency` requests in flight (the server batches them)."""
    done = itertools.count(1)

    def one(ex: Example) -> Answer:
        a = _scored(bfcl, ex, client.answer(ex, "required"))
        log(f"[sparsex required {next(done)}/{len(examples)}] {ex.id}: {a.verdict[:70]} ({a.seconds:.1f} s)")
        return a

    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        return dict(zip((ex.id for ex in examples), pool.map(one, examples)))


def run_transformers(hf: HFRunner, bfcl: Bfcl, examples: list[Example],
                     log: Callable[[str], None]) -> dict[str, tuple[list[int], Answer]]:
    out = {}
    for i, ex in enumerate(examples):
        ids = hf.prompt_ids(ex)
        a = _scored(bfcl, ex, hf.answer(ex, ids))
        out[ex.id] = (ids, a)
        log(f"[transformers {i + 1}/{len(examples)}] {ex.id}: {a.verdict[:60]} ({a.seconds:.1f} s)")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--categories", default="simple,multiple,parallel",
                    type=lambda s: [c.strip() for c in s.split(",") if c.strip()])
    ap.add_argument("--per-category", type=int, default=50, help="examples per category (0: all)")
    ap.add_argument("--sample", choices=("random", "first"), default="random")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the server and of transformers, each")
    ap.add_argument("--cache", choices=("none", "prefix", "sparsex"), default="none")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--tool-call-parser", default=None,
                    help="the transformers side's parser (default: from the template)")
    ap.add_argument("--base-url", default=None,
                    help="a running `sparsex serve` (http://host:port) instead of starting one")
    ap.add_argument("--sequential", action="store_true", help="transformers after the server, not at the same time")
    ap.add_argument("--required-concurrency", type=int, default=2,
                    help="tool_choice=required requests in flight at once (auto requests go one at a time)")
    ap.add_argument("--out", default=None, help="directory for examples.json, summary.json and the server's log")
    args = ap.parse_args(argv)
    unknown = [c for c in args.categories if c not in CATEGORIES]
    if unknown:
        ap.error(f"unknown categories {unknown}; known: {sorted(CATEGORIES)}")

    import torch
    torch.set_num_threads(args.threads)
    bfcl = load_bfcl()
    examples = [ex for c in args.categories
                for ex in load_examples(bfcl, c, args.per_category or None, args.sample, args.seed)]
    out_dir = args.out
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    log = lambda msg: print(f"{time.perf_counter() - t_start:7.0f}s {msg}", flush=True)    # noqa: E731

    server = None
    if args.base_url is None:
        log_path = os.path.join(out_dir, "server.log") if out_dir else os.devnull
        server = ServeProcess(args.model, args.dtype, args.threads, args.cache, max_model_len=2048, log_path=log_path)
        server.start()
        log(f"sparsex serve up at {server.url} (pid {server.proc.pid})")
    try:
        client = SparseXClient(args.base_url or server.url, args.max_tokens)
        hf = HFRunner(args.model, args.dtype, args.max_tokens, args.tool_call_parser)
        log(f"transformers side loaded; parser {hf.parser.name}; {len(examples)} examples")
        if args.sequential:
            auto = run_sparsex_auto(client, bfcl, examples, log)
            ref = run_transformers(hf, bfcl, examples, log)
        else:                               # the same prompts on both paths at once, a core each
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                fut = pool.submit(run_sparsex_auto, client, bfcl, examples, log)
                ref = run_transformers(hf, bfcl, examples, log)
                auto = fut.result()
        required = run_sparsex_required(client, bfcl, examples, args.required_concurrency, log)
    finally:
        if server is not None:
            server.stop()
    wall = time.perf_counter() - t_start

    records = []
    for ex in examples:
        sx_ids, a = auto[ex.id]
        hf_ids, ans = ref[ex.id]
        div = first_divergence(a, ans)
        records.append(Record(ex, ans, a, required[ex.id], sx_ids == hf_ids, same_calls(a, ans), div is None, div,
                              margin_gap(a, ans), {"auto": lenient_correct(bfcl, ex, a),
                                                   "transformers": lenient_correct(bfcl, ex, ans)}))
    rows = [summarize(c, [r for r in records if r.example.category == c]) for c in args.categories]
    if len(rows) > 1:
        rows.append(summarize("all", records))

    from importlib.metadata import version

    from sparsex.bench.report import environment
    env = environment(args.model, args.dtype)
    env.update(torch_threads=args.threads, cache=args.cache, bfcl_eval=version("bfcl-eval"),
               transformers=version("transformers"), sample=args.sample, seed=args.seed,
               per_category=args.per_category, wall_seconds=round(wall, 1))
    command = shlex.join([os.path.basename(sys.executable), *sys.argv])
    print()
    print(f"model {args.model}, dtype {env['dtype']}, {env['cpu']} ({env['cores']} cores), {args.threads} torch "
          f"thread(s) per side, cache {args.cache}; bfcl-eval {env['bfcl_eval']}, transformers {env['transformers']}, "
          f"torch {env['torch']}; commit {env['commit']}; {wall / 60:.1f} min")
    print(f"command: {command}")
    print()
    print(table(rows))
    print()
    print(fenced_table(rows))
    diverged = [r for r in records if r.divergence]
    print()
    print(f"output tokens identical (auto vs transformers): {sum(r.same_tokens for r in records)}/{len(records)}")
    gaps = [r.margin_gap for r in records if r.margin_gap is not None]
    smallest = min((m for r in records for m in r.auto.margins if m is not None), default=None)
    if gaps:
        print(f"top-1 minus top-2 logprob, SparseX vs transformers on the shared tokens: largest difference "
              f"{max(gaps):.2e}; the smallest margin any auto answer met: {smallest:.4f}")
    for r in diverged:
        d = r.divergence
        fmt = lambda m: "n/a" if m is None else f"{m:.4f}"               # noqa: E731
        print(f"  {r.example.id}: token {d['index']}: sparsex {d['sparsex_token']!r} "
              f"(margin {fmt(d['sparsex_margin'])})"
              f" vs transformers {d['transformers_token']!r} (margin {fmt(d['transformers_margin'])}); "
              f"calls {'same' if r.same_calls else 'differ'}, correct sparsex {r.auto.correct} / "
              f"transformers {r.transformers.correct}")
    if out_dir:
        with open(os.path.join(out_dir, "examples.json"), "w") as f:
            json.dump([asdict(r) for r in records], f, indent=1, ensure_ascii=False)
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump({"environment": env, "command": command, "rows": [asdict(r) for r in rows],
                       "table": table(rows),
                       "fenced_table": fenced_table(rows)}, f, indent=1)
        print(f"\nper-example results: {os.path.join(out_dir, 'examples.json')}")


if __name__ == "__main__":
    main()
