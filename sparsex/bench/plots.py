"""PNG plots of the workload bench's replay (`--plot-dir`; matplotlib: `sparsex.bench.pyplot`); each
plotting function returns the series it drew, so what a figure shows can be checked against the
tables. The `--stream` run draws its own plot (`sparsex.bench.stream`)."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sparsex.bench.policy_summary import PolicySummary
from sparsex.bench.pyplot import Series, pyplot
from sparsex.bench.replay import RequestRecord
from sparsex.bench.report import horizon
from sparsex.bench.workload_config import WorkloadBenchConfig

if TYPE_CHECKING:
    from sparsex.bench.policies import Policy


# ---------------------------------------------------------------- fidelity vs TTFT and compute

PARETO_X = (("ttft_mean_ms", 1.0, "mean TTFT (ms)"), ("compute_share", 100.0, "prefill compute (% of full prefill)"))
PARETO_Y = (("kl", True, "mean KL(full || policy), nats"), ("top1", False, "top-1 agreement with full prefill"))


@dataclass
class ParetoPanel:
    """One panel of the Pareto figure: the summaries' field `y` against field `x` (times `x_scale`)."""
    x: str
    y: str
    x_scale: float
    points: dict[str, tuple[float, float]]   # policy -> (x, y) as plotted
    front: list[tuple[float, float]]         # the non-dominated points, sorted by x


def _pareto(points: list[tuple[float, float]], better_low: bool) -> list[tuple[float, float]]:
    """Non-dominated points (lower x; lower or higher y), sorted by x."""
    front, best = [], math.inf
    for x, y in sorted(points, key=lambda p: (p[0], p[1] if better_low else -p[1])):
        v = y if better_low else -y
        if v < best:
            front.append((x, y))
            best = v
    return front


def pareto_panels(summaries: list[PolicySummary]) -> list[ParetoPanel]:
    """The four panels (KL and top-1 against mean TTFT and compute share) of the policies that have
    fidelity; rows of PARETO_Y, columns of PARETO_X."""
    pts = [s for s in summaries if s.top1 is not None]
    panels = []
    for ykey, low, _ in PARETO_Y:
        for xkey, xscale, _ in PARETO_X:
            points = {s.policy: (getattr(s, xkey) * xscale, getattr(s, ykey)) for s in pts}
            panels.append(ParetoPanel(xkey, ykey, xscale, points, _pareto(list(points.values()), low)))
    return panels


def plot_pareto(summaries: list[PolicySummary], path: str, cfg: WorkloadBenchConfig, env: dict) -> list[ParetoPanel]:
    """Fidelity (KL, top-1) against mean TTFT and, because TTFT on a shared CPU is noisy, against
    the deterministic prefill compute share too; grey steps: the Pareto front of all points; bars: the
    named policies' 95% intervals over requests. Nothing is written when no policy has fidelity."""
    panels = pareto_panels(summaries)
    pts = {s.policy: s for s in summaries if s.top1 is not None}
    if not pts:
        return panels
    plt = pyplot()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    named = [s for s in pts.values() if s.family != "sweep"]
    sweep = [s for s in pts.values() if s.family == "sweep"]
    colors = {s.policy: plt.cm.tab10(j % 10) for j, s in enumerate(named)}
    f_values = sorted({_sweep_f(s.policy) for s in sweep})
    f_colors = {f: plt.cm.viridis(j / max(1, len(f_values) - 1)) for j, f in enumerate(f_values)}
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    for j, panel in enumerate(panels):
        ax = axes[j // 2][j % 2]
        low = next(lo for key, lo, _ in PARETO_Y if key == panel.y)
        ax.step([x for x, _ in panel.front], [y for _, y in panel.front], where="post", color="0.6", lw=1, zorder=1,
                label="Pareto front")
        for f in f_values:
            group = [panel.points[s.policy] for s in sweep if _sweep_f(s.policy) == f]
            ax.scatter([x for x, _ in group], [y for _, y in group], color=f_colors[f], s=20, zorder=2, alpha=0.85,
                       label=f"sweep F={f} ({'boundary' if f == 0 else 'default selector'})")
        for s in named:
            x, y = panel.points[s.policy]
            lo, hi = getattr(s, panel.y + "_low"), getattr(s, panel.y + "_high")
            if lo is not None:          # the 95% interval over requests
                ax.errorbar(x, y, yerr=[[y - lo], [hi - y]], color=colors[s.policy], lw=0.8, capsize=2, zorder=2)
            ax.scatter(x, y, color=colors[s.policy], s=70, marker="D", edgecolor="black", lw=0.5, zorder=3,
                       label=s.policy)
        ax.set_xlabel(next(label for key, _, label in PARETO_X if key == panel.x))
        ax.set_ylabel(next(label for key, _, label in PARETO_Y if key == panel.y))
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
    return panels


def _sweep_f(name: str) -> int:
    m = re.search(r"-F(\d+)-", name)
    return int(m.group(1)) if m else -1


# ---------------------------------------------------------------- TTFT CDF

def ttft_cdf_series(records: list[RequestRecord], policies: list[Policy]) -> dict[str, Series]:
    """Per named policy (sweep points left out): its requests' TTFTs in ms, sorted, and the share of
    requests at or below each."""
    series = {}
    for p in policies:
        xs = sorted(1000 * r.ttft_s for r in records if r.policy == p.name)
        if p.family != "sweep" and xs:
            series[p.name] = (xs, [(j + 1) / len(xs) for j in range(len(xs))])
    return series


def plot_ttft_cdf(records: list[RequestRecord], policies: list[Policy], path: str, cfg: WorkloadBenchConfig,
                  env: dict) -> dict[str, Series]:
    series = ttft_cdf_series(records, policies)
    plt = pyplot()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (xs, ys) in series.items():
        ax.step(xs, ys, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{cfg.workload}: TTFT CDF, sequential replay ({env['num_requests']} requests)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return series
