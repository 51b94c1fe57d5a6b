"""matplotlib for the benchmarks' PNG plots. matplotlib is the optional `bench` extra
(`pip install sparsex[bench]`), imported only when a plot is drawn."""
from __future__ import annotations

import importlib.util
from typing import Any

Series = tuple[list[float], list[float]]      # (x values, y values) of one plotted line


def require_matplotlib() -> None:
    """Fail before any work when plots are asked for and matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("plots need matplotlib, which is not installed: pip install sparsex[bench]")


def pyplot() -> Any:
    """matplotlib.pyplot on the headless Agg backend (no display on CI or servers)."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
