"""PNG plots of the workload bench (matplotlib: the optional `bench` extra, imported lazily)."""
from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING

from sparsex.bench.policy_summary import PolicySummary
from sparsex.bench.replay import RequestRecord
from sparsex.bench.report import horizon
from sparsex.bench.workload_config import StreamConfig, WorkloadBenchConfig

if TYPE_CHECKING:
    from sparsex.bench.policies import Policy
    from sparsex.bench.stream import StreamSummary


def _pareto(points: list[tuple[float, float]], better_low: bool) -> list[tuple[float, float]]:
    """Non-dominated points (lower x; lower or higher y), sorted by x."""
    front, best = [], math.inf
    for x, y in sorted(points, key=lambda p: (p[0], p[1] if better_low else -p[1])):
        v = y if better_low else -y
        if v < best:
            front.append((x, y))
            best = v
    return front


def plot_pareto(summaries: list[PolicySummary], path: str, cfg: WorkloadBenchConfig, env: dict) -> None:
    """Fidelity (KL, top-1) against mean TTFT and, because TTFT on a shared CPU is noisy, against
    the deterministic prefill compute share too; grey steps: the Pareto front of all points; bars: the
    named policies' 95% intervals over requests."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = [s for s in summaries if s.top1 is not None]
    if not pts:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    named = [s for s in pts if s.family != "sweep"]
    sweep = [s for s in pts if s.family == "sweep"]
    colors = {s.policy: plt.cm.tab10(j % 10) for j, s in enumerate(named)}
    f_values = sorted({_sweep_f(s.policy) for s in sweep})
    f_colors = {f: plt.cm.viridis(j / max(1, len(f_values) - 1)) for j, f in enumerate(f_values)}
    xs = (("ttft_mean_ms", 1.0, "mean TTFT (ms)"), ("compute_share", 100.0, "prefill compute (% of full prefill)"))
    ys = (("kl", True, "mean KL(full || policy), nats"), ("top1", False, "top-1 agreement with full prefill"))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for row, (ykey, low, ylabel) in enumerate(ys):
        for col, (xkey, xscale, xlabel) in enumerate(xs):
            ax = axes[row][col]
            front = _pareto([(getattr(s, xkey) * xscale, getattr(s, ykey)) for s in pts], low)
            ax.step([x for x, _ in front], [y for _, y in front], where="post", color="0.6", lw=1, zorder=1,
                    label="Pareto front")
            for f in f_values:
                group = [s for s in sweep if _sweep_f(s.policy) == f]
                ax.scatter([getattr(s, xkey) * xscale for s in group], [getattr(s, ykey) for s in group],
                           color=f_colors[f], s=20, zorder=2, alpha=0.85,
                           label=f"sweep F={f} ({'boundary' if f == 0 else 'default selector'})")
            for s in named:
                x, y = getattr(s, xkey) * xscale, getattr(s, ykey)
                lo, hi = getattr(s, ykey + "_low"), getattr(s, ykey + "_high")
                if lo is not None:          # the 95% interval over requests
                    ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], color=colors[s.policy], lw=0.8, capsize=2, zorder=2)
                ax.scatter(x, y, color=colors[s.policy], s=70, marker="D", edgecolor="black", lw=0.5, zorder=3,
                           label=s.policy)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if low:
                ax.set_yscale("symlog", linthresh=1e-3)
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=7, loc="upper right")
    fig.suptitle(f"{cfg.workload}: fidelity vs TTFT and prefill compute ({env['num_requests']} requests, "
                 f"{horizon(cfg)}; {env['model']} {env['dtype']}, "
                 f"{env['gpu'] or str(env['torch_threads']) + ' thread(s), ' + str(env['cores']) + '-core CPU'})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sweep_f(name: str) -> int:
    m = re.search(r"-F(\d+)-", name)
    return int(m.group(1)) if m else -1


def plot_ttft_cdf(records: list[RequestRecord], policies: list[Policy], path: str, cfg: WorkloadBenchConfig,
                  env: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in policies:
        if p.family == "sweep":
            continue
        xs = sorted(1000 * r.ttft_s for r in records if r.policy == p.name)
        if xs:
            ax.step(xs, [(j + 1) / len(xs) for j in range(len(xs))], where="post", label=p.name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{cfg.workload}: TTFT CDF, sequential replay ({env['num_requests']} requests)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stream(summaries: list[StreamSummary], path: str, cfg: StreamConfig, env: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for s in summaries:
        xs = [min((j + 1) * cfg.window, s.num_requests) for j in range(len(s.window_hit_rates))]
        ax.plot(xs, [100 * r for r in s.window_hit_rates], marker="o", ms=3,
                label=f"{s.eviction} (overall {s.segment_lookup_hit_rate:.1%})")
    ax.set_xlabel(f"queries served (window = {cfg.window})")
    ax.set_ylabel("segment hit rate in window (% of looked-up tokens)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend()
    s0 = summaries[0]
    ax.set_title(f"RAG stream, k={cfg.k}, pool {s0.pool_tokens / s0.corpus_tokens:.0%} of a {s0.corpus_tokens}-token "
                 f"corpus, Zipf a={cfg.zipf_a}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
