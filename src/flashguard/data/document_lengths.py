"""Document-length statistics recorded in ``meta.json`` (``document_tokens``).

Why: whether a training window holds several documents (and so several separators, the
identical tokens attention sinks form on) is read off these numbers without reading the
token files. Lengths count a document's own tokens, not the separator after it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["length_summary"]


def length_summary(lengths: Sequence[int]) -> dict:
    """count, min, p10, median, mean, p90, max of ``lengths`` (None for the statistics of none)."""
    a = np.asarray(lengths, dtype=np.int64)
    if a.size == 0:
        return {"count": 0, "min": None, "p10": None, "median": None, "mean": None, "p90": None, "max": None}
    p10, median, p90 = (float(v) for v in np.percentile(a, [10, 50, 90]))
    return {
        "count": int(a.size),
        "min": int(a.min()),
        "p10": p10,
        "median": median,
        "mean": round(float(a.mean()), 3),
        "p90": p90,
        "max": int(a.max()),
    }
