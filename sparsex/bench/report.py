"""The workload bench's outputs: markdown tables, JSON/CSV files, and the run's environment."""
from __future__ import annotations

import csv
import json
import math
import os
import platform
import subprocess
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from sparsex.bench.policy_summary import NEAR_TIE, PolicySummary
from sparsex.bench.replay import RequestRecord
from sparsex.bench.workload_config import WorkloadBenchConfig

if TYPE_CHECKING:
    from sparsex.bench.policies import Policy


def _fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    text = format(v * scale, spec)
    # a KL of -1e-9 (rounding noise of two equal distributions) prints as 0, not -0.0000
    return text[1:] if text.startswith("-") and not any(c in "123456789" for c in text) else text


def horizon(cfg: WorkloadBenchConfig) -> str:
    """What a fidelity position is, for table and plot captions."""
    if cfg.fidelity_past_eos:
        return f"{cfg.fidelity_tokens} teacher-forced tokens each, past EOS"
    return f"teacher-forced tokens through the reference's EOS, at most {cfg.fidelity_tokens}"


def summary_markdown(summaries: list[PolicySummary], fidelity_tokens: int) -> str:
    rag = any(s.f1 is not None for s in summaries)
    recur = any(s.recurring_served_share is not None for s in summaries)
    head = ["policy", "prefix hit", "approx prefix", "segment hit"] + (["recurring served [95% CI]"] if recur else []) + [
            "computed tok", "compute", "prefill GFLOP",
            "TTFT mean / p50 / p99 (ms)", "vs none", "select (ms)", "span search (ms, % of TTFT)", "top-1", "KL", f"match (of <= {fidelity_tokens})"]
    if rag:
        head += ["F1", "EM", "answer = none's"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        row = [s.policy, _fmt(s.prefix_hit_rate, ".1%"), _fmt(s.approx_prefix_rate, ".1%"), _fmt(s.segment_hit_rate, ".1%")]
        if recur:
            row.append(_recurring_cell(s))
        row += [str(s.computed_tokens),
               _fmt(s.compute_share, ".1%"), _fmt(s.prefill_gflops, ".0f"),
               f"{s.ttft_mean_ms:.0f} / {s.ttft_p50_ms:.0f} / {s.ttft_p99_ms:.0f}",
               _fmt(s.ttft_speedup, ".2f") + ("×" if s.ttft_speedup is not None else ""),
               _fmt(s.selection_ms, ".1f"), f"{s.span_search_ms:.2f} ({_fmt(s.span_search_share, '.2%')})",
               _fmt(s.top1, ".1%"), _fmt(s.kl, ".4f"), _fmt(s.match_len, ".1f")]
        if rag:
            row += [_fmt(s.f1, ".3f"), _fmt(s.em, ".3f"), _fmt(s.answer_agreement, ".1%")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _recurring_cell(s: PolicySummary) -> str:
    if s.recurring_served_share is None:
        return "—"
    if s.recurring_served_low is None:
        return f"{s.recurring_served_share:.1%}"
    return f"{s.recurring_served_share:.1%} [{s.recurring_served_low:.1%}, {s.recurring_served_high:.1%}]"


def fidelity_markdown(summaries: list[PolicySummary]) -> str:
    """The fidelity columns again with their 95% intervals (bootstrap over requests), and each
    policy's KL against the default's on the same requests (paired): with a few dozen requests the
    interval, not the mean, says whether two policies differ."""
    rows = [s for s in summaries if s.top1_low is not None]
    if not rows:
        return ""
    answers = any(s.f1_minus_none is not None for s in rows)
    lines = ["| policy | requests | top-1 [95% CI] | KL [95% CI] | KL − sparsex, paired [95% CI] | "
             f"top-1 misses (near-ties: full prefill's top two within {NEAR_TIE:g}) |"
             + (" answer F1 − none, paired [95% CI] |" if answers else ""),
             "|---|---|---|---|---|---|" + ("---|" if answers else "")]
    for s in rows:
        diff = "—" if s.kl_minus_sparsex is None else (
            f"{s.kl_minus_sparsex:+.4f} [{s.kl_minus_sparsex_low:+.4f}, {s.kl_minus_sparsex_high:+.4f}]")
        misses = "—" if s.top1_misses is None else f"{s.top1_misses} ({s.near_tie_misses})"
        line = (f"| {s.policy} | {s.fidelity_requests} | {s.top1:.1%} [{s.top1_low:.1%}, {s.top1_high:.1%}] | "
                f"{_fmt(s.kl, '.4f')} [{_fmt(s.kl_low, '.4f')}, {_fmt(s.kl_high, '.4f')}] | {diff} | {misses} |")
        if answers:
            line += " — |" if s.f1_minus_none is None else (
                f" {s.f1_minus_none:+.3f} [{s.f1_minus_none_low:+.3f}, {s.f1_minus_none_high:+.3f}] |")
        lines.append(line)
    return "\n".join(lines) + "\n"


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        if not rows:
            return
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def write_outputs(out: str, cfg: WorkloadBenchConfig, policies: list[Policy], records: list[RequestRecord],
                  summaries: list[PolicySummary], env: dict) -> None:
    os.makedirs(out, exist_ok=True)
    meta = {"config": jsonable(asdict(cfg)), "environment": env,
            "policies": [{"name": p.name, "cache": p.cache, "family": p.family, "description": p.description,
                          "knobs": asdict(p.knobs()) if p.knobs() else None} for p in policies]}
    with open(os.path.join(out, "requests.json"), "w") as f:
        json.dump({**meta, "requests": [asdict(r) for r in records]}, f, indent=1)
    write_csv(os.path.join(out, "requests.csv"), [asdict(r) for r in records])
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump({**meta, "summary": [asdict(s) for s in summaries]}, f, indent=1)
    write_csv(os.path.join(out, "summary.csv"), [asdict(s) for s in summaries])
    with open(os.path.join(out, "summary.md"), "w") as f:
        warm = (f" after ingesting the corpus in {env['prewarm_prompts']} prompts, each opened by a preamble "
                f"passage, {env['prewarm_passes']} pass(es) (untimed)") if cfg.prewarm else ""
        f.write(f"{cfg.workload} ({cfg.prompt_form} prompts): {env['num_requests']} requests{warm}, fidelity on {env['fidelity_requests']} "
                f"({horizon(cfg)}); {env['model']} {env['dtype']}, "
                f"{env['gpu'] or str(env['torch_threads']) + ' thread(s), ' + env['cpu']}, "
                f"load {env['load_avg_start']:.1f}→"
                f"{env['load_avg_end']:.1f}\n\n")
        f.write(summary_markdown(summaries, cfg.fidelity_tokens))
        fid = fidelity_markdown(summaries)
        if fid:
            f.write("\nFidelity with 95% intervals (bootstrap over requests; sparsex.bench.stats):\n\n" + fid)


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def loadavg() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def resolved_dtype(dtype: str, device: str = "cpu") -> str:
    """The dtype the engine runs for `dtype` ("auto" resolved as EngineConfig resolves it), for reports."""
    from sparsex.config import parse_dtype
    return str(parse_dtype(dtype, device)).removeprefix("torch.")


def environment(model: str, dtype: str, device: str = "cpu") -> dict:
    import torch
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    gpu = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None
    return {"model": model, "dtype": resolved_dtype(dtype, device), "device": device, "gpu": gpu, "cpu": cpu,
            "cores": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "load_avg_start": loadavg(), "commit": commit,
            "python": platform.python_version(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
