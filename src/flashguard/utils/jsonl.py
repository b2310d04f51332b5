"""The package's JSON-lines logs (a run's metrics.jsonl and batches.jsonl): the one reader and
the one append-only writer."""
from __future__ import annotations

import json
from pathlib import Path

from .atomic import atomic_write_text

__all__ = ["read_jsonl", "read_metrics", "JsonlLog"]


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


class JsonlLog:
    """Append-only JSON-lines log, flushed per line (a kill loses nothing written before)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self._f = open(self.path, "a") if enabled else None

    def write(self, record: dict) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()

    read = staticmethod(read_jsonl)  # records in file order; [] for a missing file

    @staticmethod
    def truncate_after(path: Path, step: int) -> None:
        """Keep the records of steps <= ``step`` (the ones a resumed run will not redo)."""
        if Path(path).exists():
            kept = [r for r in JsonlLog.read(path) if r.get("step", -1) <= step]
            atomic_write_text(Path(path), "".join(json.dumps(r) + "\n" for r in kept))
