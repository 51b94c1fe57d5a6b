"""argparse value types shared by every command line (`sparsex`, `sparsex serve`, `sparsex bench ...`):
a bad value is a usage error naming it, before anything loads. Imports nothing from sparsex, so
any module may use them."""
from __future__ import annotations

import argparse
import re


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}") from None
    if not value >= 0:          # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text!r}")
    return value


def length_list(text: str) -> tuple[int, ...]:
    """`512,1024,2048` -> (512, 1024, 2048)."""
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if not parts:
        raise argparse.ArgumentTypeError("expected a comma-separated list of token counts")
    return tuple(positive_int(p) for p in parts)


def int_pair(text: str) -> tuple[int, int]:
    """`300:500` -> (300, 500) (a MIN:MAX range; the caller checks the bounds)."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX (integers), got {text!r}") from None
    return lo, hi


def parse_bytes(text: str) -> int:
    """'1073741824', '512M', '1G', '1.5GiB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 1073741824, 512M, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
