"""Answer score against compute: every reuse rule of one or more rag workload runs, paired against full prefill.

Each RUN is the `--out` directory of a `sparsex bench workload --workload rag` run with a `none` policy; a
rule's point is what the bench wrote to its `summary.json`: the paired answer-F1 difference against that
run's full prefill (bootstrap interval), the share of answers equal to full prefill's and the compute.
`--floor RUN` names a run whose `none` was made another way (bf16 full prefill of the same prompts,
`--policies none`): its per-request F1 (`requests.json`) paired against the first run's full prefill is
drawn as a band, the cost of rounding alone, and its answers unlike that full prefill's are the floor of the
"answers changed" column. Each row also gives the run's mean TTFT over its full prefill's (on the run's own
device); `--label SPEC=NAME` names a rule in the table and the figure; `RUN@POLICY[@POLICY...]` takes only
those rules of a run. Prints a table; `--plot` writes the figure.

    .venv/bin/python benchmarks/answer_pareto.py RUN1 RUN2 --floor BF16 --label sparse_q:4:auto=auto \
        --plot docs/img/rag_answer_pareto.png
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
    ttft: float               # mean TTFT / full prefill's mean TTFT, in the same run
    device: str


@dataclass(frozen=True)
class Floor:
    f1: Interval              # bf16 full prefill's F1 - fp32 full prefill's, paired
    changed: int              # its answers unlike fp32 full prefill's
    num_requests: int


def _load(run: str, name: str) -> dict:
    with open(os.path.join(run, name)) as f:
        return json.load(f)


def points(run: str) -> list[Point]:
    """One point per rule of `run`, from the paired F1 its summary holds against its `none`."""
    summaries = _load(run, "summary.json")["summary"]
    if not any(s["policy"] == "none" for s in summaries):
        raise ValueError(f"{run}: no `none` policy to pair against (run with --policies none,...)")
    env = _load(run, "summary.json")["environment"]
    device = env.get("gpu") or env.get("cpu") or env.get("device", "?")
    return [Point(s["policy"], run, s["compute_share"],
                  Interval(s["f1_minus_none"], s["f1_minus_none_low"], s["f1_minus_none_high"]),
                  round((1.0 - s["answer_agreement"]) * s["num_requests"]), s["num_requests"],
                  1.0 / s["ttft_speedup"], device)
            for s in summaries if s["policy"] != "none" and s.get("f1_minus_none") is not None]


def selected(spec: str) -> list[Point]:
    """The points of `RUN`, or of `RUN@POLICY@...` only those policies (ValueError naming one it lacks)."""
    run, *keep = spec.split("@")
    pts = points(run)
    missing = set(keep) - {p.policy for p in pts}
    if missing:
        raise ValueError(f"{run} has no rule {sorted(missing)} (it has {[p.policy for p in pts]})")
    return [p for p in pts if not keep or p.policy in keep]


def _none(run: str) -> dict[int, dict]:
    rows = {r["index"]: r for r in _load(run, "requests.json")["requests"] if r["policy"] == "none"}
    if not rows:
        raise ValueError(f"{run}: no `none` policy to pair against (run with --policies none,...)")
    return rows


def floor(run: str, reference: str) -> Floor:
    """The `none` of `run` paired against the `none` of `reference` (same prompts)."""
    a, b = _none(run), _none(reference)
    if set(a) != set(b):
        raise ValueError(f"{run} and {reference} do not hold the same requests")
    idx = sorted(b)
    return Floor(paired_difference([a[i]["f1"] for i in idx], [b[i]["f1"] for i in idx]),
                 sum(a[i]["answer"] != b[i]["answer"] for i in idx), len(idx))


def _short(policy: str) -> str:
    return policy.replace(":rescore_layers=auto", "").replace(":min_blend_tokens=256", "")


def _knobs(policy: str) -> str:
    """`selector:F:r...` -> "F=4, r=0.125"; "" for a named policy."""
    parts = policy.split(":")
    return f"F={parts[1]}, r={parts[2]}" if len(parts) >= 3 and parts[1].isdigit() else ""


def _name(p: Point, labels: dict[str, str]) -> str:
    """A labelled rule's name with its full layers and ratio; otherwise its spec."""
    for spec, name in labels.items():
        if p.policy == spec or p.policy.startswith(spec + ":"):
            knobs = _knobs(p.policy)
            return f"{name} ({knobs})" if knobs else name
    return _short(p.policy)


def table(pts: list[Point], band: Floor | None, labels: dict[str, str]) -> str:
    lines = ["| rule | compute | TTFT / full prefill's (device) | answer F1 − full prefill, paired [95% CI] | "
             "answers changed |", "|---|---|---|---|---|"]
    for p in sorted(pts, key=lambda p: p.compute):
        lines.append(f"| {_name(p, labels)} | {p.compute:.1%} | {p.ttft:.3f}x ({p.device}) | {p.f1.mean:+.3f} "
                     f"[{p.f1.low:+.3f}, {p.f1.high:+.3f}] | {p.changed} of {p.num_requests} |")
    if band is not None:
        f = band.f1
        lines.append(f"| bf16 full prefill (rounding only) | 100.0% | | {f.mean:+.3f} [{f.low:+.3f}, {f.high:+.3f}] | "
                     f"{band.changed} of {band.num_requests} |")
    return "\n".join(lines)


def plot(pts: list[Point], band: Floor | None, labels: dict[str, str], path: str) -> None:
    """Labelled rules in colour, each its own legend entry; the others small and grey, annotated."""
    from sparsex.bench.pyplot import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 5))
    if band is not None:
        ax.axhspan(band.f1.low, band.f1.high, color="0.88", label="bf16 full prefill (rounding), 95% CI")
        ax.axhline(band.f1.mean, color="0.6", lw=1)
    ax.axhline(0.0, color="k", lw=0.8)
    markers = "osD^vP*Xh<>p"
    named = [p for p in pts if _name(p, labels) != _short(p.policy)]
    for p in pts:
        if p in named:
            continue
        ax.errorbar([100 * p.compute], [p.f1.mean], yerr=[[p.f1.mean - p.f1.low], [p.f1.high - p.f1.mean]],
                    fmt="o", ms=4, color="0.55", capsize=2, lw=0.8)
        ax.annotate(_short(p.policy), (100 * p.compute, p.f1.mean), fontsize=6, color="0.4",
                    xytext=(4, 3), textcoords="offset points")
    for i, p in enumerate(sorted(named, key=lambda p: p.compute)):
        ax.errorbar([100 * p.compute], [p.f1.mean], yerr=[[p.f1.mean - p.f1.low], [p.f1.high - p.f1.mean]],
                    fmt=markers[i % len(markers)], ms=7, capsize=3, label=f"{_name(p, labels)}: {p.compute:.0%}")
    ax.set_xlabel("compute, % of full prefill's token-layers")
    ax.set_ylabel("answer token F1 − full prefill's (paired)")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _label(text: str) -> tuple[str, str]:
    spec, sep, name = text.rpartition("=")
    if not sep or not spec or not name:
        raise argparse.ArgumentTypeError(f"--label takes SPEC=NAME, got {text!r}")
    return spec, name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="--out directories of rag workload runs, each with a `none` policy")
    ap.add_argument("--floor", help="--out directory of a `none`-only run made another way (bf16), paired "
                                    "against the first run's full prefill")
    ap.add_argument("--label", type=_label, action="append", default=[], metavar="SPEC=NAME",
                    help="name the rule SPEC (a policy, or its prefix before a ':') NAME; repeatable")
    ap.add_argument("--plot", help="PNG to write")
    args = ap.parse_args(argv)
    labels = dict(args.label)
    pts = [p for run in args.runs for p in selected(run)]
    band = floor(args.floor, args.runs[0].split("@")[0]) if args.floor else None
    print(table(pts, band, labels))
    if args.plot:
        plot(pts, band, labels, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
