"""The report's table block and its cell format, shared by the report writer and its sections."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Table", "fmt"]


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    verdict_col: int | None = None  # this column's cells are verdicts (coloured in HTML)


def fmt(x) -> str:
    """A table cell: "-" for absent, 4 significant digits for floats, non-finite spelled out."""
    if x is None or x == "":
        return "-"
    if isinstance(x, float):
        return str(x) if not math.isfinite(x) else f"{x:.4g}"
    if isinstance(x, dict):
        return ", ".join(f"{k}={fmt(v)}" for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return "; ".join(fmt(v) for v in x)
    return str(x)
