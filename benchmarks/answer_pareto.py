"""Answer score against compute: every reuse rule of one or more rag workload runs, paired against full prefill.

Each `requests.json` (from `sparsex bench workload --workload rag`) holds a `none` policy and the rules it
was run with; a rule's point is its paired answer-F1 difference against that run's full prefill (bootstrap
interval) at its compute (token-layers against full prefill's). `--floor RUN` names a run whose `none` was
made another way (bf16 full prefill of the same prompts, `--policies none`): its paired difference against
the first run's full prefill is drawn as a band, the cost of rounding alone. Prints a table; `--plot` writes
the figure.

    .venv/bin/python benchmarks/answer_pareto.py RUN1/requests.json RUN2/requests.json \
        --floor BF16/requests.json --plot docs/img/rag_answer_pareto.png
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from sparsex.bench.stats import Interval, paired_difference


@dataclass(frozen=True)
class Point:
    policy: str
    run: str
    compute: float            # token-layers against full prefill's
    f1: Interval              # paired F1 - full prefill's F1
    changed: int              # answers unlike full prefill's
    num_requests: int


def _by_policy(path: str) -> dict[str, dict[int, dict]]:
    with open(path) as f:
        data = json.load(f)
    out: dict[str, dict[int, dict]] = {}
    for r in data["requests"]:
        out.setdefault(r["policy"], {})[r["index"]] = r
    if "none" not in out:
        raise ValueError(f"{path}: no `none` policy to pair against (run with --policies none,...)")
    return out


def points(path: str) -> list[Point]:
    """One point per rule of the run in `path`, paired against its `none`."""
    runs = _by_policy(path)
    none = runs.pop("none")
    out = []
    for policy, recs in runs.items():
        idx = sorted(recs)
        if any(i not in none for i in idx):
            raise ValueError(f"{path}: policy {policy!r} has requests full prefill lacks")
        f1 = paired_difference([recs[i]["f1"] for i in idx], [none[i]["f1"] for i in idx])
        compute = sum(recs[i]["token_layers"] for i in idx) / sum(none[i]["token_layers"] for i in idx)
        changed = sum(recs[i]["answer"] != none[i]["answer"] for i in idx)
        out.append(Point(policy, path, compute, f1, changed, len(idx)))
    return out


def floor(path: str, reference: str) -> Interval:
    """The `none` of run `path` paired against the `none` of run `reference` (same prompts)."""
    a, b = _by_policy(path)["none"], _by_policy(reference)["none"]
    idx = sorted(set(a) & set(b))
    if len(idx) != len(b):
        raise ValueError(f"{path} and {reference} do not hold the same requests")
    return paired_difference([a[i]["f1"] for i in idx], [b[i]["f1"] for i in idx])


def table(pts: list[Point], band: Interval | None) -> str:
    lines = ["| rule | compute | answer F1 − full prefill, paired [95% CI] | answers changed |", "|---|---|---|---|"]
    for p in sorted(pts, key=lambda p: p.compute):
        lines.append(f"| {p.policy} | {p.compute:.1%} | {p.f1.mean:+.3f} [{p.f1.low:+.3f}, {p.f1.high:+.3f}] | "
                     f"{p.changed} of {p.num_requests} |")
    if band is not None:
        lines.append(f"| bf16 full prefill (rounding only) | 100.0% | {band.mean:+.3f} [{band.low:+.3f}, {band.high:+.3f}] | |")
    return "\n".join(lines)


def plot(pts: list[Point], band: Interval | None, path: str) -> None:
    from sparsex.bench.pyplot import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    if band is not None:
        ax.axhspan(band.low, band.high, color="0.85", label="bf16 full prefill (rounding), 95% CI")
        ax.axhline(band.mean, color="0.6", lw=1)
    ax.axhline(0.0, color="k", lw=0.8)
    for p in pts:
        ax.errorbar([100 * p.compute], [p.f1.mean], yerr=[[p.f1.mean - p.f1.low], [p.f1.high - p.f1.mean]],
                    fmt="o", capsize=3)
        ax.annotate(p.policy.replace(":rescore_layers=auto", "").replace(":min_blend_tokens=256", ""),
                    (100 * p.compute, p.f1.mean), fontsize=6, xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("compute, % of full prefill's token-layers")
    ax.set_ylabel("answer token F1 − full prefill's (paired)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="requests.json of rag workload runs, each with a `none` policy")
    ap.add_argument("--floor", help="requests.json of a `none`-only run made another way (bf16), paired "
                                    "against the first run's full prefill")
    ap.add_argument("--plot", help="PNG to write")
    args = ap.parse_args(argv)
    pts = [p for run in args.runs for p in points(run)]
    band = floor(args.floor, args.runs[0]) if args.floor else None
    print(table(pts, band))
    if args.plot:
        plot(pts, band, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
