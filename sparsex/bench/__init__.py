"""Benchmarks users run (`sparsex bench ...`, registered in sparsex/cli.py) and the pieces they share:
see docs/architecture.md. Analyses that only produce numbers or figures for the docs live in
benchmarks/ at the repository root; they may import this package, never the reverse."""
from __future__ import annotations

import argparse
import shlex
import sys
from typing import Callable

from sparsex.arg_types import positive_int

THREADS_HELP = "torch intra-op threads (default: torch's)"


def add_threads_arg(p: argparse.ArgumentParser, help: str = THREADS_HELP) -> None:
    """`--threads N` (an integer >= 1, checked by argparse: a usage error before anything loads)."""
    p.add_argument("--threads", type=positive_int, default=None, help=help)


def add_engine_flag(p: argparse.ArgumentParser, name: str, help: str | None = None) -> None:
    """`--model`, `--dtype`, `--device`: an EngineConfig knob's flag, declared as `sparsex generate`
    and `serve` declare theirs (`knob_args.add_knob_arg`; `help` replaces the knob's)."""
    from sparsex.config import EngineConfig
    from sparsex.knob_args import add_knob_arg
    add_knob_arg(p, EngineConfig, name, help)


def set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch
        torch.set_num_threads(threads)


def command_line(name: str) -> str:
    """The `sparsex bench <name> ...` command this process runs, for a report's caption."""
    argv = sys.argv[1:]
    if name in argv:
        argv = argv[argv.index(name) + 1:]
        return shlex.join(["sparsex", "bench", name, *argv])
    return f"sparsex bench {name} (in-process)"


def module_main(module: str, command: str, add_parser: Callable, argv: list[str] | None = None) -> int:
    """`python -m sparsex.bench.<module> ...`: the same options as `sparsex bench <command>`; a
    ValueError is a usage error (exit 2), as on the CLI."""
    parser = argparse.ArgumentParser(prog=f"python -m sparsex.bench.{module}")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"sparsex bench {command}: error: {e}", file=sys.stderr)
        return 2
