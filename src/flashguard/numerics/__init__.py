"""Number formats and rounding for low-precision emulation."""

from .formats import (
    BF16,
    E4M3,
    E5M2,
    FORMATS,
    FP16,
    FP32,
    FP64,
    ROUNDING_MODES,
    FloatFormat,
    exmy,
    get_format,
    is_representable,
    round_to,
)

from .policy import DELTA_SOURCES, POLICIES, PrecisionPolicy, get_policy

__all__ = [
    "DELTA_SOURCES",
    "POLICIES",
    "PrecisionPolicy",
    "get_policy",
    "BF16",
    "E4M3",
    "E5M2",
    "FORMATS",
    "FP16",
    "FP32",
    "FP64",
    "ROUNDING_MODES",
    "FloatFormat",
    "exmy",
    "get_format",
    "is_representable",
    "round_to",
]
