"""Tables: the one Markdown table writer, and the report's table block and cell format."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Table", "fmt", "markdown_table"]


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


def _line(cells) -> str:
    return "|" + "".join(" |" if c is None else f" {c} |" for c in cells)


def markdown_table(header, rows) -> str:
    """A Markdown table, its lines joined by newlines (no newline at the end): the header, the
    ``|---|`` rule, a line a row. Cells are written as they are (str() of them; any escaping is
    the caller's); a cell that is None is left blank, ``| |``, where "" writes ``|  |``."""
    return "\n".join([_line(header), "|" + "---|" * len(header)] + [_line(r) for r in rows])
