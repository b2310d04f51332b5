"""Number checks shared by the model's configuration, its attention choice and its accessors.

bool is an int subclass in Python; a True where a count or a size belongs is a mistake, so
neither check accepts it.
"""
from __future__ import annotations

import numbers

__all__ = ["is_int", "is_real"]


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
