"""The package's matplotlib set-up, shared by every figure writer (diagnostics' plots, the
report, the lab, the audit, the injection experiment).

``pyplot()``: matplotlib's pyplot on the Agg backend (no display needed), imported on first
use, so that importing a module that draws does not import matplotlib. ``save_png(fig,
path)``: the figure as a PNG (110 dpi, tight bounding box), written atomically (a reader never
sees half a file), then closed; returns the path.
"""
from __future__ import annotations

from pathlib import Path

from .atomic import atomic_output

__all__ = ["pyplot", "save_png"]


def pyplot():
    """``matplotlib.pyplot``, with the Agg backend selected."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def save_png(fig, path) -> Path:
    """Write ``fig`` to ``path`` as a PNG atomically, close it, return the path."""
    path = Path(path)
    with atomic_output(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path
