"""The one reader of the package's JSON-lines logs (a run's metrics.jsonl and batches.jsonl)."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_jsonl"]


def read_jsonl(path, *, missing_ok: bool = True) -> list[dict]:
    """The records of a JSON-lines file, in file order. Reading stops at the first line that
    does not parse: the writers flush whole lines, so only a line cut by a kill can be bad,
    and it is the last. A missing file gives [] (``missing_ok``) or FileNotFoundError."""
    p = Path(path)
    if not p.exists() and missing_ok:
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out
