"""Reading the structure of generated markdown and console text, so that tests assert on cells,
headings and numbers rather than on the sentences around them."""
from __future__ import annotations

import re

NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:,\d{3})*(?:\.\d+)?(?:e[+-]?\d+)?")


def numbers(text: str) -> list[float]:
    """The numbers in ``text``, in order (thousands separators dropped)."""
    return [float(x.replace(",", "")) for x in NUMBER.findall(text)]


def headings(md: str, level: int = 2) -> list[str]:
    """The titles of the markdown headings of ``level``, in order."""
    mark = "#" * level + " "
    return [line[len(mark):].strip() for line in md.splitlines() if line.startswith(mark)]


def section(md: str, title: str, level: int = 2) -> str:
    """The body of the heading ``title`` of ``level``, up to the next heading of that level or higher
    (KeyError when there is no such heading)."""
    lines = md.splitlines()
    mark = "#" * level + " "
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith(mark) and line[len(mark):].strip() == title)
    except StopIteration:
        raise KeyError(title) from None
    end = next((i for i in range(start + 1, len(lines))
                if re.match(r"#{1,%d} " % level, lines[i])), len(lines))
    return "\n".join(lines[start + 1:end])


def tables(md: str) -> list[list[list[str]]]:
    """Every markdown table in ``md``: a list of rows (the header first, the --- row dropped),
    each a list of its cells, stripped."""
    out, cur = [], []
    for line in md.splitlines() + [""]:
        s = line.strip()
        if s.startswith("|") and s.endswith("|") and len(s) > 1:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", s[1:-1])]
            if not all(re.fullmatch(r":?-{3,}:?", c) for c in cells):
                cur.append(cells)
        elif cur:
            out.append(cur)
            cur = []
    return out


def table_dicts(table: list[list[str]]) -> list[dict[str, str]]:
    """The rows of a table (as ``tables`` returns it) as dicts keyed by the header's cells."""
    head, *rows = table
    return [dict(zip(head, row)) for row in rows]
