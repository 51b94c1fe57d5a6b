"""Benchmarks (`sparsex bench ...`): see docs/architecture.md."""
from __future__ import annotations

import argparse
import sys
from typing import Callable


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
