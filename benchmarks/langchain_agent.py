"""LangChain's tool-calling agent (`langchain.agents.create_agent`, `ChatOpenAI` streaming) against `sparsex serve`
on a BFCL multi-turn trace: the trace's tools are the real BFCL implementations (GorillaFileSystem, TwitterAPI,
MathAPI, ... loaded with the trace's `initial_config`), its user turns are sent in order with the conversation
carried over, and the TTFT of every model request is compared between segment reuse and `--cache none`.

The comparison is a paired replay. The agent runs live once, against a fresh server of the first mode (default
`sparsex`, reuse on); every model request it makes (the exact LangChain messages, tools bound the way
`create_agent` binds them) is recorded. Each other run replays those requests, in order, through the same
`ChatOpenAI` against a fresh server, so every mode answers byte-identical request bodies (checked) whatever it
would have answered itself. Runs alternate order (rep 1: modes in order, rep 2: reversed, ...). TTFT is the time
from LangChain's `on_chat_model_start` to the first streamed chunk carrying content or a tool-call fragment (the
server's first role-only chunk does not count); the server's own TTFT and its reuse counters come from /metrics
deltas around each request.

"Every call parses": each model answer that carries `tool_calls`, `invalid_tool_calls`, or content that looks like
an unparsed call (`<tool_call>`, a bare `{"name": ...}`) is checked: calls of known tools with arguments that fit
the tool's schema are parsed; invalid JSON, unknown tools, bad arguments and tools that raise are errors.

LangChain and the BFCL data are not SparseX dependencies. Run it with an environment that has langchain (1.x) and
langchain-openai; the servers are started with `--server-python`, whose environment has SparseX and bfcl-eval
(the BFCL data and tool sources are read from there):

    python3 -m venv /tmp/lc && /tmp/lc/bin/pip install langchain langchain-openai
    /tmp/lc/bin/python benchmarks/langchain_agent.py --server-python .venv/bin/python --out DIR

With `--base-url URL` (one running server) it only runs the agent live and checks the calls, no comparison.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
from langchain.agents import create_agent
from langchain.agents.middleware import wrap_model_call
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage, messages_to_dict
from langchain_core.tools import StructuredTool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError

REPO = Path(__file__).resolve().parent.parent
# BFCL's parameter types -> JSON Schema (bfcl_eval's GORILLA_TO_OPENAPI, the types the multi-turn docs use)
_TYPES = {"dict": "object", "float": "number", "tuple": "array", "list": "array", "any": "string", "bool": "boolean",
          "integer": "integer", "number": "number", "string": "string", "boolean": "boolean", "array": "array",
          "object": "object"}
_METRICS = ("prompt_tokens_total", "prefix_cache_hits_total", "approx_prefix_hits_total", "explicit_reused_tokens_total",
            "transparent_reused_tokens_total", "sparse_kv_recomputed_tokens_total",
            "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count")
_UNPARSED = re.compile(r"<tool_call>|\{\s*\"name\"\s*:")


# ---- BFCL trace and tools --------------------------------------------------------------------------------------
def bfcl_paths(server_python: str) -> tuple[Path, Path]:
    """bfcl_eval's package folder in the server's environment, and mpmath's (MathAPI imports it)."""
    code = "import bfcl_eval, mpmath, os; print(os.path.dirname(bfcl_eval.__file__)); print(os.path.dirname(mpmath.__file__))"
    out = subprocess.run([server_python, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    return Path(out[0]), Path(out[1])


def import_bfcl(server_python: str) -> Path:
    """Make bfcl_eval (and mpmath) importable here without the rest of the server's environment: a folder holding
    links to just those two packages goes at the end of sys.path."""
    bfcl, mpmath = bfcl_paths(server_python)
    shim = Path(tempfile.mkdtemp(prefix="bfcl-shim-"))
    (shim / "bfcl_eval").symlink_to(bfcl)
    (shim / "mpmath").symlink_to(mpmath)
    sys.path.append(str(shim))
    return bfcl


def json_schema(p: dict) -> dict:
    """A BFCL parameter schema as JSON Schema (types mapped, recursively)."""
    p = copy.deepcopy(p)
    p["type"] = _TYPES.get(p.get("type", "string"), "string")
    if "properties" in p:
        p["properties"] = {k: json_schema(v) for k, v in p["properties"].items()}
    if isinstance(p.get("items"), dict):
        p["items"] = json_schema(p["items"])
    return p


def load_trace(bfcl: Path, trace_id: str) -> dict:
    with open(bfcl / "data" / "BFCL_v4_multi_turn_base.json") as f:
        for line in f:
            row = json.loads(line)
            if row["id"] == trace_id:
                return row
    raise SystemExit(f"no trace {trace_id!r} in BFCL_v4_multi_turn_base.json")


class Toolbox:
    """The trace's classes, instantiated and loaded with its initial_config, each documented method a LangChain
    StructuredTool that runs the real method and returns its result as text. Keeps a log of every execution."""

    def __init__(self, bfcl: Path, trace: dict):
        from bfcl_eval.constants.executable_backend_config import (CLASS_FILE_PATH_MAPPING,
                                                                   MULTI_TURN_FUNC_DOC_FILE_MAPPING, STATELESS_CLASSES)
        self.docs: list[dict] = []
        self.instances: dict[str, Any] = {}
        excluded = set(trace.get("excluded_function") or [])
        for cls_name in trace["involved_classes"]:
            cls = getattr(importlib.import_module(CLASS_FILE_PATH_MAPPING[cls_name]), cls_name)
            inst = cls()
            if cls_name not in STATELESS_CLASSES:
                inst._load_scenario(copy.deepcopy(trace["initial_config"].get(cls_name, {})), long_context=False)
            self.instances[cls_name] = inst
            with open(bfcl / "data" / "multi_turn_func_doc" / MULTI_TURN_FUNC_DOC_FILE_MAPPING[cls_name]) as f:
                self.docs += [dict(json.loads(line), _cls=cls_name) for line in f if line.strip()
                              and json.loads(line)["name"] not in excluded]
        self.schemas = {d["name"]: json_schema(d["parameters"]) for d in self.docs}
        self.log: list[dict] = []
        self.tools = [self._tool(d) for d in self.docs]

    def _tool(self, doc: dict) -> StructuredTool:
        name, method = doc["name"], getattr(self.instances[doc["_cls"]], doc["name"])

        def run(**kwargs: Any) -> str:
            entry = {"name": name, "args": kwargs}
            try:
                result = method(**kwargs)
            except Exception as e:      # noqa: BLE001 - the model's bad call: report it back as the tool's answer
                entry["raised"] = f"{type(e).__name__}: {e}"
                self.log.append(entry)
                return f"Error: {entry['raised']}"
            entry["error"] = isinstance(result, dict) and "error" in result
            self.log.append(entry)
            return result if isinstance(result, str) else json.dumps(result, default=str)

        return StructuredTool.from_function(func=run, name=name, description=doc["description"],
                                            args_schema=self.schemas[name])

    def args_fit(self, name: str, args: Any) -> bool:
        s = self.schemas[name]
        return (isinstance(args, dict) and set(s.get("required", [])) <= set(args)
                and set(args) <= set(s.get("properties", {})))


# ---- servers ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, mode: str, log_dir: Path):
        self.mode, self.port = mode, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [args.server_python, "-m", "sparsex.cli", "serve", args.model, "--cache", mode, "--dtype", args.dtype,
               "--max-model-len", str(args.max_model_len), "--port", str(self.port)]
        if args.torch_threads:
            cmd += ["--torch-threads", str(args.torch_threads)]
        self.cmd = cmd
        env = dict(os.environ)
        env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/torchext-agent")
        self.log = open(log_dir / f"server-{mode}-{self.port}.log", "w")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server {mode} exited ({self.proc.returncode}); see {self.log.name}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        log(f"server --cache {mode} up on :{self.port} in {time.perf_counter() - t0:.0f} s (pid {self.proc.pid})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def scrape(url: str) -> dict[str, float]:
    """The sparsex: counters of /metrics, summed over labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("sparsex:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0][len("sparsex:"):]
        if name in _METRICS:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# ---- measuring each model request ------------------------------------------------------------------------------
class Recorder(BaseCallbackHandler):
    """One record per chat-model call: its messages (for replay), TTFT to the first chunk with content or a
    tool-call fragment, usage, the answer, and the server's /metrics deltas around it."""

    def __init__(self, server_url: str | None):
        self.server_url = server_url
        self.turn, self.step = 0, 0
        self.records: list[dict] = []
        self._open: dict[Any, dict] = {}

    def on_chat_model_start(self, serialized, messages, *, run_id, **kwargs) -> None:
        self.step += 1
        inv = kwargs.get("invocation_params") or {}
        rec = {"turn": self.turn, "step": self.step, "messages": [list(m) for m in messages][0],
               "tool_choice": inv.get("tool_choice"), "parallel_tool_calls": inv.get("parallel_tool_calls"),
               "metrics_before": scrape(self.server_url) if self.server_url else None, "t_first": None}
        rec["t0"] = time.perf_counter()
        self._open[run_id] = rec

    def on_llm_new_token(self, token, *, chunk=None, run_id, **kwargs) -> None:
        rec = self._open.get(run_id)
        if rec is None or rec["t_first"] is not None:
            return
        msg = getattr(chunk, "message", None)
        if token or (msg is not None and getattr(msg, "tool_call_chunks", None)):
            rec["t_first"] = time.perf_counter()

    def on_llm_end(self, response, *, run_id, **kwargs) -> None:
        rec = self._open.pop(run_id)
        rec["t_end"] = time.perf_counter()
        msg = response.generations[0][0].message
        rec["answer"] = msg
        rec["usage"] = dict(msg.usage_metadata or {})
        if self.server_url:
            time.sleep(0.05)        # the engine loop updates its counters right after the last step
            after = scrape(self.server_url)
            rec["metrics"] = {k: after.get(k, 0.0) - rec["metrics_before"].get(k, 0.0) for k in _METRICS}
        self.records.append(rec)

    def on_llm_error(self, error, *, run_id, **kwargs) -> None:
        rec = self._open.pop(run_id, None)
        if rec is not None:
            rec["error"] = repr(error)
            self.records.append(rec)


class BodyLog:
    """The JSON body of every chat-completions request sent (httpx request hook)."""

    def __init__(self):
        self.bodies: list[dict] = []

    def hook(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.content))


def chat_model(args, base_url: str, bodies: BodyLog) -> ChatOpenAI:
    return ChatOpenAI(base_url=base_url + "/v1", api_key="none", model=args.model, temperature=0, streaming=True,
                      stream_usage=True, max_tokens=args.max_tokens, timeout=args.request_timeout, max_retries=0,
                      http_client=httpx.Client(event_hooks={"request": [bodies.hook]}, timeout=args.request_timeout))


def warm_up(url: str, model: str) -> None:
    """One tiny request sharing no prefix with the trace: a fresh server's one-time costs stay out of the numbers."""
    body = json.dumps({"model": model, "max_tokens": 2, "messages": [
        {"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Say hi."}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


# ---- the agent, live -------------------------------------------------------------------------------------------
def run_agent(args, base_url: str, trace: dict, box: Toolbox, rec: Recorder, bodies: BodyLog) -> list[dict]:
    """The trace's user turns through create_agent, the conversation carried over; one summary per turn."""

    @wrap_model_call
    def first_call_required(request, handler):
        """--first-call required: the model call that answers a user message must call a tool (one call,
        decoding constrained by the server); the calls after a tool result are free (tool_choice auto)."""
        if isinstance(request.messages[-1], HumanMessage):
            request = request.override(tool_choice="required",
                                       model_settings={**request.model_settings, "parallel_tool_calls": False})
        return handler(request)

    middleware = [first_call_required] if args.first_call == "required" else []
    agent = create_agent(model=chat_model(args, base_url, bodies), tools=box.tools, middleware=middleware)
    messages: list = []
    turns = []
    for t, turn in enumerate(trace["question"], 1):
        rec.turn, rec.step = t, 0
        messages = messages + [HumanMessage(m["content"]) for m in turn]
        n_log, state, capped = len(box.log), {"messages": messages}, False
        try:
            for state in agent.stream({"messages": messages}, {"callbacks": [rec],
                                                               "recursion_limit": 2 * args.max_steps + 1},
                                      stream_mode="values"):
                pass
        except GraphRecursionError:
            capped = True
        messages = list(state["messages"])
        if capped and isinstance(messages[-1], AIMessage) and messages[-1].tool_calls:
            messages.pop()          # calls the cap left unanswered: the next turn starts before them
        final = messages[-1]
        turns.append({"turn": t, "user": " ".join(m["content"] for m in turn), "model_calls": rec.step,
                      "step_cap_hit": capped, "tool_runs": box.log[n_log:],
                      "final": final.content if isinstance(final, AIMessage) else None})
        log(f"turn {t}: {rec.step} model calls, tools run: "
            f"{[(e['name'], e['args']) for e in box.log[n_log:]]}{' (step cap hit)' if capped else ''}")
    return turns


def replay(args, base_url: str, requests: list[dict], tools: list, rec: Recorder, bodies: BodyLog) -> None:
    """The recorded requests again, in order, tools bound as create_agent bound them for each."""
    llm = chat_model(args, base_url, bodies)
    for r in requests:
        extra = {} if r["parallel_tool_calls"] is None else {"parallel_tool_calls": r["parallel_tool_calls"]}
        model = llm.bind_tools(tools, tool_choice=r["tool_choice"], **extra)
        rec.turn, rec.step = r["turn"], r["step"] - 1
        model.invoke(r["messages"], {"callbacks": [rec]})


# ---- checking the calls ----------------------------------------------------------------------------------------
def check_calls(records: list[dict], box: Toolbox) -> dict:
    """Every answer with tool intent: its calls parsed (known tool, arguments fitting the schema) or not."""
    known = set(box.schemas)
    out = {"answers": len(records), "answers_with_tool_intent": 0, "calls": 0, "parsed": 0, "invalid_json": 0,
           "unknown_tool": 0, "bad_args": 0, "unparsed_in_content": 0, "free_calls": 0, "free_parsed": 0,
           "problems": []}
    for r in records:
        msg: AIMessage = r["answer"]
        free = r["tool_choice"] in (None, "auto")
        content = msg.content if isinstance(msg.content, str) else json.dumps(msg.content)
        unparsed = bool(_UNPARSED.search(content))
        if not (msg.tool_calls or msg.invalid_tool_calls or unparsed):
            continue
        out["answers_with_tool_intent"] += 1
        out["unparsed_in_content"] += unparsed
        if unparsed:
            out["problems"].append({"turn": r["turn"], "step": r["step"], "content": content[:300]})
        out["calls"] += len(msg.tool_calls) + len(msg.invalid_tool_calls)
        out["invalid_json"] += len(msg.invalid_tool_calls)
        for c in msg.invalid_tool_calls:
            out["problems"].append({"turn": r["turn"], "step": r["step"], "invalid": dict(c)})
        for c in msg.tool_calls:
            if c["name"] not in known:
                out["unknown_tool"] += 1
                out["problems"].append({"turn": r["turn"], "step": r["step"], "unknown": c["name"]})
            elif not box.args_fit(c["name"], c["args"]):
                out["bad_args"] += 1
                out["problems"].append({"turn": r["turn"], "step": r["step"], "bad_args": [c["name"], c["args"]]})
            else:
                out["parsed"] += 1
                out["free_parsed"] += free
        out["free_calls"] += free * (len(msg.tool_calls) + len(msg.invalid_tool_calls))
    out["tool_runs"] = len(box.log)
    out["tool_raised"] = sum(1 for e in box.log if "raised" in e)
    out["tool_returned_error"] = sum(1 for e in box.log if e.get("error"))
    return out


# ---- summary ---------------------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def answer_key(msg: AIMessage) -> str:
    calls = [(c["name"], c["args"]) for c in msg.tool_calls]
    return json.dumps(calls, sort_keys=True) if calls else (msg.content if isinstance(msg.content, str) else "")


def short_answer(msg: AIMessage) -> str:
    """`name(args)` per parsed call, else the content's first 40 characters (escaped for a table)."""
    if msg.tool_calls:
        return "; ".join(f"{c['name']}({', '.join(f'{k}={v!r}' for k, v in c['args'].items())})" for c in msg.tool_calls)
    text = msg.content if isinstance(msg.content, str) else json.dumps(msg.content)
    return "text: " + text[:40].replace("\n", "\\n").replace("|", "\\|").replace("`", "'")


def bootstrap_median(xs: list[float], n: int = 10000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def summarize(runs: list[dict], modes: list[str], requests: list[dict]) -> tuple[list[dict], dict]:
    """Per request: its TTFT in each mode (median over reps), the ratio of the first mode to the last."""
    rows = []
    base, ref = modes[0], modes[-1]
    for i, r in enumerate(requests):
        row = {"turn": r["turn"], "step": r["step"], "prompt_tokens": r["usage"].get("input_tokens"),
               "tool_choice": r["tool_choice"] or "auto", "answer": short_answer(r["answer"])}
        for m in modes:
            recs = [run["records"][i] for run in runs if run["mode"] == m]
            row[f"ttft_{m}"] = statistics.median(x["t_first"] - x["t0"] for x in recs)
            row[f"ttft_{m}_all"] = [round(x["t_first"] - x["t0"], 3) for x in recs]
            mt = [x["metrics"] for x in recs if x.get("metrics")]
            if mt:
                row[f"server_ttft_{m}"] = statistics.median(x["time_to_first_token_seconds_sum"] for x in mt)
                row[f"prefix_hit_{m}"] = mt[0]["prefix_cache_hits_total"]
                row[f"reused_{m}"] = (mt[0]["approx_prefix_hits_total"] + mt[0]["explicit_reused_tokens_total"]
                                      + mt[0]["transparent_reused_tokens_total"])
                row[f"recomputed_{m}"] = mt[0]["sparse_kv_recomputed_tokens_total"]
            row[f"cached_{m}"] = (recs[0]["usage"].get("input_token_details") or {}).get("cache_read", 0)
            row[f"same_answer_{m}"] = all(answer_key(x["answer"]) == answer_key(r["answer"]) for x in recs)
        row["ratio"] = row[f"ttft_{base}"] / row[f"ttft_{ref}"]
        if f"server_ttft_{base}" in row and f"server_ttft_{ref}" in row:
            row["server_ratio"] = row[f"server_ttft_{base}"] / row[f"server_ttft_{ref}"]
        rows.append(row)
    later = [r for r in rows if r["turn"] >= 2]
    summ: dict[str, Any] = {"requests": len(rows), "later_turn_requests": len(later)}
    for key in ("ratio", "server_ratio"):
        xs = [r[key] for r in later if key in r]
        if xs:
            summ[f"later_median_{key}"] = statistics.median(xs)
            summ[f"later_median_{key}_ci95"] = bootstrap_median(xs)
    # per rep: the median ratio over later-turn requests, pairing each rep's base run with the same rep's ref run
    per_rep = []
    for rep in sorted({run["rep"] for run in runs}):
        b = next(x for x in runs if x["rep"] == rep and x["mode"] == base)["records"]
        f = next(x for x in runs if x["rep"] == rep and x["mode"] == ref)["records"]
        per_rep.append(statistics.median((b[i]["t_first"] - b[i]["t0"]) / (f[i]["t_first"] - f[i]["t0"])
                                         for i, r in enumerate(requests) if r["turn"] >= 2))
    summ["later_median_ratio_per_rep"] = per_rep
    tot = {m: sum(r[f"ttft_{m}"] for r in later) for m in modes}
    summ["later_ttft_sum_s"] = tot
    prompt = sum(r["prompt_tokens"] or 0 for r in rows)
    summ["prompt_tokens"] = prompt
    summ["cached_share"] = {m: sum(r[f"cached_{m}"] for r in rows) / prompt for m in modes if prompt}
    return rows, summ


def print_table(rows: list[dict], summ: dict, modes: list[str], calls: dict) -> None:
    base, ref = modes[0], modes[-1]
    head = ["turn", "step", "tool_choice", "answer", "prompt tok", f"cached ({base})", f"recomputed ({base})"] + \
           [f"TTFT {m} s" for m in modes] + [f"{base}/{ref}"] + [f"server TTFT {m} s" for m in modes] + \
           [f"server {base}/{ref}", "same answer"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" if h in ("tool_choice", "answer") else "---:" for h in head) + "|")
    for r in rows:
        cells = [r["turn"], r["step"], r["tool_choice"], r["answer"], r["prompt_tokens"], r[f"cached_{base}"], int(r.get(f"recomputed_{base}", 0))]
        cells += [f"{r[f'ttft_{m}']:.2f}" for m in modes]
        cells += [f"{r['ratio']:.3f}"] + [f"{r.get(f'server_ttft_{m}', float('nan')):.2f}" for m in modes]
        cells += [f"{r.get('server_ratio', float('nan')):.3f}",
                  "yes" if all(r[f"same_answer_{m}"] for m in modes[1:]) else "no"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print()
    if "later_median_ratio" in summ:
        lo, hi = summ["later_median_ratio_ci95"]
        print(f"later turns (turn >= 2, {summ['later_turn_requests']} requests): median TTFT {base}/{ref} "
              f"{summ['later_median_ratio']:.3f} [95% bootstrap {lo:.3f}, {hi:.3f}]; per rep "
              + ", ".join(f"{x:.3f}" for x in summ["later_median_ratio_per_rep"]))
    if "later_median_server_ratio" in summ:
        lo, hi = summ["later_median_server_ratio_ci95"]
        print(f"  server-side TTFT (/metrics): {summ['later_median_server_ratio']:.3f} [{lo:.3f}, {hi:.3f}]")
    print("prompt tokens served from cache: " + ", ".join(f"{m} {v:.1%}" for m, v in summ["cached_share"].items()))
    print(f"calls parsed: {calls['parsed']} / {calls['calls']} (of them under tool_choice auto: {calls['free_parsed']} / "
          f"{calls['free_calls']}; answers with tool intent {calls['answers_with_tool_intent']}"
          f" of {calls['answers']}; invalid JSON {calls['invalid_json']}, unknown tool {calls['unknown_tool']}, "
          f"bad args {calls['bad_args']}, call-like text in content {calls['unparsed_in_content']}); tools run "
          f"{calls['tool_runs']}: raised {calls['tool_raised']}, returned an error {calls['tool_returned_error']}")


def record_json(r: dict) -> dict:
    out = {k: v for k, v in r.items() if k not in ("messages", "answer", "metrics_before")}
    out["ttft_s"] = r["t_first"] - r["t0"] if r.get("t_first") else None
    out["e2e_s"] = r["t_end"] - r["t0"] if r.get("t_end") else None
    out["answer"] = messages_to_dict([r["answer"]])[0] if "answer" in r else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--trace-id", default="multi_turn_base_1", help="a trace of BFCL_v4_multi_turn_base.json")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=256, help="per model request")
    ap.add_argument("--max-steps", type=int, default=5, help="model calls per user turn at most (recursion_limit)")
    ap.add_argument("--first-call", choices=("auto", "required"), default="auto",
                    help="tool_choice of the model call answering each user message (middleware); later calls: auto")
    ap.add_argument("--modes", default="sparsex,none", help="--cache modes; the first runs the agent live, the "
                                                           "ratio is first / last")
    ap.add_argument("--reps", type=int, default=2, help="runs per mode; rep 1 in --modes order, rep 2 reversed, ...")
    ap.add_argument("--server-python", default=sys.executable, help="python with sparsex and bfcl-eval")
    ap.add_argument("--torch-threads", type=int, default=0, help="the servers' --torch-threads (0: their default)")
    ap.add_argument("--base-url", help="a running server: run the agent live only, no comparison")
    ap.add_argument("--request-timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, help="folder for result.json and the server logs")
    args = ap.parse_args()
    modes = args.modes.split(",")
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="langchain-agent-"))
    out_dir.mkdir(parents=True, exist_ok=True)

    bfcl = import_bfcl(args.server_python)
    trace = load_trace(bfcl, args.trace_id)
    result: dict[str, Any] = {"trace_id": args.trace_id, "involved_classes": trace["involved_classes"],
                              "excluded_function": trace.get("excluded_function"),
                              "user_turns": [" ".join(m["content"] for m in t) for t in trace["question"]],
                              "args": {k: str(v) for k, v in vars(args).items()}, "load_before": uptime()}
    log(f"{args.trace_id}: {len(trace['question'])} user turns, classes {trace['involved_classes']}; {result['load_before']}")

    if args.base_url:
        box = Toolbox(bfcl, trace)
        rec, bodies = Recorder(args.base_url.removesuffix("/v1")), BodyLog()
        result["turns"] = run_agent(args, args.base_url.removesuffix("/v1"), trace, box, rec, bodies)
        calls = check_calls(rec.records, box)
        result.update(calls=calls, records=[record_json(r) for r in rec.records], load_after=uptime())
        for r in rec.records:
            print(f"turn {r['turn']} step {r['step']} ({r['tool_choice'] or 'auto'}): prompt {r['usage'].get('input_tokens')} tokens, "
                  f"TTFT {r['t_first'] - r['t0']:.2f} s, {answer_key(r['answer'])[:120]!r}")
        print(json.dumps({k: v for k, v in calls.items() if k != "problems"}))
        (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
        return

    runs: list[dict] = []
    requests: list[dict] | None = None
    ref_bodies: list[dict] | None = None
    calls = None
    server_cmds: dict[str, str] = {}
    for rep in range(1, args.reps + 1):
        order = modes if rep % 2 else modes[::-1]
        for mode in order:
            if requests is None and mode != modes[0]:
                continue            # the live run comes first
            srv = Server(args, mode, out_dir)
            server_cmds[mode] = " ".join(srv.cmd)
            try:
                warm_up(srv.url, args.model)
                rec, bodies = Recorder(srv.url), BodyLog()
                load0, t0 = uptime(), time.perf_counter()
                if requests is None:
                    box = Toolbox(bfcl, trace)
                    result["turns"] = run_agent(args, srv.url, trace, box, rec, bodies)
                    requests, ref_bodies = rec.records, bodies.bodies
                    calls = check_calls(requests, box)
                    kind = "live"
                else:
                    replay(args, srv.url, requests, box.tools, rec, bodies)
                    kind = "replay"
                    if bodies.bodies != ref_bodies:
                        diff = sum(a != b for a, b in zip(bodies.bodies, ref_bodies)) + abs(len(bodies.bodies) - len(ref_bodies))
                        raise SystemExit(f"replay sent {diff} request bodies unlike the live run's: not paired")
                runs.append({"rep": rep, "mode": mode, "kind": kind, "records": rec.records, "load_before": load0,
                             "load_after": uptime(), "wall_s": time.perf_counter() - t0})
                log(f"rep {rep} {mode} ({kind}): {len(rec.records)} requests in {runs[-1]['wall_s']:.0f} s; "
                    f"TTFT " + " ".join(f"{r['t_first'] - r['t0']:.2f}" for r in rec.records))
            finally:
                srv.stop()
    assert requests is not None and calls is not None
    rows, summ = summarize(runs, modes, requests)
    print_table(rows, summ, modes, calls)
    result.update(rows=rows, summary=summ, calls=calls, load_after=uptime(),
                  runs=[{k: v for k, v in run.items() if k != "records"}
                        | {"records": [record_json(r) for r in run["records"]]} for run in runs],
                  request_bodies_checked_identical=True, server_cmds=server_cmds)
    print(f"load: before {result['load_before']}; after {result['load_after']}")
    (out_dir / "result.json").write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {out_dir / 'result.json'}")


if __name__ == "__main__":
    main()
