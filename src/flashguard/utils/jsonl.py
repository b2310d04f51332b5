"""The one reader of the package's JSON-lines logs (a run's metrics.jsonl and batches.jsonl)."""
from __future__ import annotations

import json
from pathlib import Path

__all__ = ["read_jsonl", "read_metrics"]


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


def read_metrics(path) -> list[dict]:
    """Records of a metrics.jsonl (or of the run folder holding one); a cut last line is dropped;
    FileNotFoundError when there is none."""
    p = Path(path)
    return read_jsonl(p / "metrics.jsonl" if p.is_dir() else p, missing_ok=False)
