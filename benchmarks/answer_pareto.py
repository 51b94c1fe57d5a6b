"""Answer score against compute: every reuse rule of one or more rag workload runs, paired against full prefill.

Each RUN is the `--out` directory of a `sparsex bench workload --workload rag` run with a `none` policy; a
rule's point is what the bench wrote to its `summary.json`: the paired answer-F1 difference against that
run's full prefill (bootstrap interval), the share of answers equal to full prefill's and the compute.
`--floor RUN` names a run whose `none` was made another way (bf16 full prefill of the same prompts,
`--policies none`): its per-request F1 (`requests.json`) paired against the first run's full prefill is
drawn as a band, the cost of rounding alone. Prints a table; `--plot` writes the figure.

    .venv/bin/python benchmarks/answer_pareto.py RUN1 RUN2 --floor BF16 --plot docs/img/rag_answer_pareto.png
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from sparsex.bench.stats import Interval, paired_difference


@dataclass(frozen=True)
class Point:
    policy: str
    run: str
    compute: float            # the bench's compute share
    f1: Interval              # paired F1 - full prefill's F1
    changed: int              # answers unlike full prefill's
    num_requests: int


def _load(run: str, name: str) -> dict:
    with open(os.path.join(run, name)) as f:
        return json.load(f)


def points(run: str) -> list[Point]:
    """One point per rule of `run`, from the paired F1 its summary holds against its `none`."""
    summaries = _load(run, "summary.json")["summary"]
    if not any(s["policy"] == "none" for s in summaries):
        raise ValueError(f"{run}: no `none` policy to pair against (run with --policies none,...)")
    return [Point(s["policy"], run, s["compute_share"],
                  Interval(s["f1_minus_none"], s["f1_minus_none_low"], s["f1_minus_none_high"]),
                  round((1.0 - s["answer_agreement"]) * s["num_requests"]), s["num_requests"])
            for s in summaries if s["policy"] != "none" and s.get("f1_minus_none") is not None]


def _none_f1(run: str) -> dict[int, float]:
    f1 = {r["index"]: r["f1"] for r in _load(run, "requests.json")["requests"] if r["policy"] == "none"}
    if not f1:
        raise ValueError(f"{run}: no `none` policy to pair against (run with --policies none,...)")
    return f1


def floor(run: str, reference: str) -> Interval:
    """The `none` of `run` paired against the `none` of `reference` (same prompts)."""
    a, b = _none_f1(run), _none_f1(reference)
    if set(a) != set(b):
        raise ValueError(f"{run} and {reference} do not hold the same requests")
    idx = sorted(b)
    return paired_difference([a[i] for i in idx], [b[i] for i in idx])


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
    ap.add_argument("runs", nargs="+", help="--out directories of rag workload runs, each with a `none` policy")
    ap.add_argument("--floor", help="--out directory of a `none`-only run made another way (bf16), paired "
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
