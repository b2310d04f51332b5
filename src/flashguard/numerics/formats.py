"""Floating-point formats and the project's one rounding routine.

``FloatFormat`` describes a binary floating-point format (sign bit, ``exponent_bits``,
``mantissa_bits`` stored fraction bits, ``bias``) together with its special-value
conventions.  ``round_to`` rounds a torch tensor to the values of such a format, in one
step from the input value (never through an intermediate format), vectorised, with
gradual underflow, signed zeros, NaN/inf and overflow handled as described below.

Every value of every format this module accepts is exactly representable in float64,
so the rounded values are always returned in an ordinary torch floating dtype: the
input's own dtype when that dtype holds every value of the format, else float32, else
float64.

Semantics of ``round_to`` (``x`` finite unless stated):

* The magnitude is rounded on the format's grid with the exponent clamped below at
  ``emin`` (subnormal spacing ``min_subnormal``) and *unbounded above*; the sign is
  then restored with ``copysign``, so a negative value that rounds to zero gives -0.0.
* Modes: ``"nearest"`` (ties to even), ``"up"`` (toward +inf), ``"down"`` (toward
  -inf), ``"toward_zero"``, ``"stochastic"`` (to the upper of the two neighbours with
  probability equal to the distance from the lower one in units of the spacing;
  exact values are left alone).
* A rounded magnitude above ``max_finite``:
    - ``overflow == "saturate"``: becomes ``±max_finite`` in every mode; for a format
      without infinities ``±inf`` inputs also become ``±max_finite`` (NVIDIA
      ``satfinite`` behaviour); for a format with infinities ``±inf`` stays ``±inf``.
    - ``overflow == "inf"``: IEEE 754.  ``"nearest"`` gives ``±inf`` (so ``|x| >=
      max_finite + ulp(max_finite)/2`` overflows); directed modes give ``±inf`` when
      they round away from zero and ``±max_finite`` when they round toward zero
      (``"toward_zero"``; ``"up"`` on negatives; ``"down"`` on positives).
      ``"stochastic"`` rounds on the unbounded grid and an upper neighbour beyond
      ``max_finite`` becomes ``±inf``.
* NaN stays NaN (also for a format whose ``nan`` is ``"none"``: the NaN is propagated
  rather than silently turned into a number).  ``±inf`` stays ``±inf`` for formats with
  infinities.

The implementation assumes IEEE subnormal arithmetic in torch (do not run it under
``torch.set_flush_denormal(True)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

import torch

__all__ = [
    "FloatFormat",
    "FP64",
    "FP32",
    "BF16",
    "FP16",
    "E4M3",
    "E5M2",
    "FORMATS",
    "ROUNDING_MODES",
    "exmy",
    "get_format",
    "round_to",
    "is_representable",
]

_NAN_KINDS = ("ieee", "fn", "none")
_OVERFLOW_KINDS = ("inf", "saturate")
ROUNDING_MODES = ("nearest", "stochastic", "up", "down", "toward_zero")


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format with a sign bit.

    ``nan``: ``"ieee"`` (exponent all ones and mantissa != 0 is NaN; requires
    ``has_inf``), ``"fn"`` (only exponent all ones *and* mantissa all ones is NaN, the
    rest of the top binade holds finite values, as OCP e4m3fn; requires no infinities),
    or ``"none"`` (no NaN encodings; with no infinities either, every exponent code
    holds finite values).

    ``overflow``: what a finite value too large to represent becomes when rounded:
    ``"inf"`` (IEEE; requires ``has_inf``) or ``"saturate"`` (``±max_finite``).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_inf: bool
    nan: str
    overflow: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"FloatFormat.name must be a non-empty string, got {self.name!r}")
        for field, lo, hi in (("exponent_bits", 2, 11), ("mantissa_bits", 0, 52)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"FloatFormat.{field} must be an int, got {value!r}")
            if not lo <= value <= hi:
                raise ValueError(f"FloatFormat.{field} must be in {lo}..{hi}, got {value}")
        if isinstance(self.bias, bool) or not isinstance(self.bias, int):
            raise ValueError(f"FloatFormat.bias must be an int, got {self.bias!r}")
        if not isinstance(self.has_inf, bool):
            raise ValueError(f"FloatFormat.has_inf must be a bool, got {self.has_inf!r}")
        if self.nan not in _NAN_KINDS:
            raise ValueError(f"FloatFormat.nan must be one of {_NAN_KINDS}, got {self.nan!r}")
        if self.overflow not in _OVERFLOW_KINDS:
            raise ValueError(
                f"FloatFormat.overflow must be one of {_OVERFLOW_KINDS}, got {self.overflow!r}"
            )
        if self.has_inf and self.nan != "ieee":
            raise ValueError(
                f"FloatFormat.nan must be 'ieee' when has_inf=True (the top exponent is "
                f"reserved for inf/NaN), got {self.nan!r}"
            )
        if not self.has_inf and self.nan == "ieee":
            raise ValueError(
                "FloatFormat.nan='ieee' requires has_inf=True; use nan='fn' or 'none' for a "
                "format without infinities"
            )
        if self.overflow == "inf" and not self.has_inf:
            raise ValueError(
                "FloatFormat.overflow='inf' requires has_inf=True; use overflow='saturate'"
            )
        if self.emax > 1023 or self.emin - self.mantissa_bits < -1074:
            raise ValueError(
                f"FloatFormat.bias={self.bias} puts the format's range "
                f"[2**{self.emin - self.mantissa_bits}, 2**{self.emax + 1}) outside float64"
            )

    # ----------------------------------------------------------------- derived values
    @property
    def total_bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top_code = (1 << self.exponent_bits) - 1
        if self.has_inf:  # top exponent code reserved for inf / NaN
            return top_code - 1 - self.bias
        if self.nan == "fn" and self.mantissa_bits == 0:
            # the top binade's only code (mantissa 0 == all ones) is the NaN
            return top_code - 1 - self.bias
        return top_code - self.bias

    @property
    def max_finite(self) -> float:
        m = self.mantissa_bits
        if self.nan == "fn" and m > 0:
            # mantissa all ones at the top exponent is NaN: the largest mantissa is all ones - 1
            frac_units = (1 << (m + 1)) - 2
        else:
            frac_units = (1 << (m + 1)) - 1
        return float(frac_units) * 2.0 ** (self.emax - m)

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mantissa_bits)

    @property
    def eps(self) -> float:
        return 2.0 ** -self.mantissa_bits

    # ------------------------------------------------------------------ torch mapping
    def _key(self) -> tuple:
        return (
            self.exponent_bits,
            self.mantissa_bits,
            self.bias,
            self.has_inf,
            self.nan,
            self.overflow,
        )

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """The torch dtype with (CPU) arithmetic for exactly this format, or None."""
        return _NATIVE_BY_KEY.get(self._key())

    @property
    def is_native(self) -> bool:
        return self.torch_dtype is not None

    def __str__(self) -> str:
        return self.name


def _ieee(name: str, e: int, m: int) -> FloatFormat:
    return FloatFormat(name, e, m, (1 << (e - 1)) - 1, True, "ieee", "inf")


FP64 = _ieee("fp64", 11, 52)
FP32 = _ieee("fp32", 8, 23)
BF16 = _ieee("bf16", 8, 7)
FP16 = _ieee("fp16", 5, 10)
E4M3 = FloatFormat("e4m3", 4, 3, 7, False, "fn", "saturate")  # OCP e4m3fn, max 448
E5M2 = _ieee("e5m2", 5, 2)  # OCP e5m2, max 57344

FORMATS: dict[str, FloatFormat] = {f.name: f for f in (FP64, FP32, BF16, FP16, E4M3, E5M2)}

_NATIVE_BY_KEY = {
    FP64._key(): torch.float64,
    FP32._key(): torch.float32,
    BF16._key(): torch.bfloat16,
    FP16._key(): torch.float16,
}
_FORMAT_OF_DTYPE = {
    torch.float64: FP64,
    torch.float32: FP32,
    torch.bfloat16: BF16,
    torch.float16: FP16,
}

_ALIASES = {
    "float64": "fp64",
    "double": "fp64",
    "float32": "fp32",
    "float": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "e4m3fn": "e4m3",
}
_EXMY_RE = re.compile(r"e(\d+)m(\d+)(_ieee)?")


@lru_cache(maxsize=None)
def exmy(e: int, m: int) -> FloatFormat:
    """IEEE-like format with ``e`` exponent and ``m`` mantissa bits.

    Bias ``2**(e-1) - 1``, IEEE infinities and NaNs, overflow to inf.  Returns the named
    constant where one has exactly these properties (e8m7 -> BF16, e5m10 -> FP16,
    e8m23 -> FP32, e11m52 -> FP64, e5m2 -> E5M2).  ``exmy(4, 3)`` is *not* E4M3 (which
    is the OCP "fn" variant without infinities): it is named ``"e4m3_ieee"`` so that the
    two never share a name.
    """
    for arg, label, lo, hi in ((e, "e", 2, 11), (m, "m", 0, 52)):
        if isinstance(arg, bool) or not isinstance(arg, int) or not lo <= arg <= hi:
            raise ValueError(f"exmy: {label} must be an int in {lo}..{hi}, got {arg!r}")
    name = f"e{e}m{m}"
    bias = (1 << (e - 1)) - 1
    candidate = FloatFormat(name, e, m, bias, True, "ieee", "inf")
    for named in FORMATS.values():
        if named._key() == candidate._key():
            return named
    if name in FORMATS:  # same name as a different named format (e4m3)
        candidate = FloatFormat(name + "_ieee", e, m, bias, True, "ieee", "inf")
    return candidate


def get_format(name_or_format: Union[str, FloatFormat]) -> FloatFormat:
    """A FloatFormat as is, or the format of a (case-insensitive) name.

    Names: fp64, fp32, bf16, fp16, e4m3 (alias e4m3fn), e5m2; aliases float64, double,
    float32, float, bfloat16, float16, half; and any ``eXmY`` (IEEE-like, see ``exmy``;
    ``eXmY_ieee`` forces the IEEE-like variant, e.g. ``e4m3_ieee``).
    """
    if isinstance(name_or_format, FloatFormat):
        return name_or_format
    if not isinstance(name_or_format, str):
        raise ValueError(
            f"format must be a FloatFormat or a name, got {type(name_or_format).__name__}"
        )
    key = name_or_format.strip().lower()
    key = _ALIASES.get(key, key)
    if key in FORMATS:
        return FORMATS[key]
    match = _EXMY_RE.fullmatch(key)
    if match:
        return exmy(int(match.group(1)), int(match.group(2)))
    known = sorted(FORMATS) + sorted(_ALIASES)
    raise ValueError(
        f"unknown float format {name_or_format!r}; known names: {', '.join(known)}, "
        f"or 'eXmY' / 'eXmY_ieee' (IEEE-like, X exponent bits 2..11, Y mantissa bits 0..52)"
    )


# --------------------------------------------------------------------------- rounding
_SUPPORTED_INPUT = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _contains(big: FloatFormat, small: FloatFormat) -> bool:
    """Every finite value of ``small`` is a value of ``big``."""
    return (
        big.mantissa_bits >= small.mantissa_bits
        and big.max_finite >= small.max_finite
        and big.min_subnormal <= small.min_subnormal
        and big.emin <= small.emin
    )


def _result_dtype(dtype: torch.dtype, fmt: FloatFormat) -> torch.dtype:
    if _contains(_FORMAT_OF_DTYPE[dtype], fmt):
        return dtype
    if _contains(FP32, fmt):
        return torch.float32
    return torch.float64


# float dtype: (integer dtype of the same width, stored mantissa bits, exponent bias)
_LAYOUT = {
    torch.float32: (torch.int32, 23, 127),
    torch.float64: (torch.int64, 52, 1023),
}


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"round_to expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _SUPPORTED_INPUT:
        raise TypeError(
            f"round_to expects a floating tensor of dtype float64, float32, bfloat16 or "
            f"float16, got dtype {x.dtype}"
        )


def round_to(
    x: torch.Tensor,
    fmt: Union[str, FloatFormat],
    mode: str = "nearest",
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Round ``x`` to the values of ``fmt`` (see the module docstring for semantics).

    Returns a new tensor of ``x``'s dtype if that dtype holds every value of ``fmt``,
    otherwise of float32 (or float64 if float32 does not either); ``x`` is upcast
    exactly first, so rounding always happens once, from the input value.

    ``x`` must be float64, float32, bfloat16 or float16 (TypeError otherwise); ``mode``
    one of ``ROUNDING_MODES`` (ValueError otherwise).  ``generator`` (a torch.Generator
    on ``x``'s device) drives ``"stochastic"`` and is ignored by the other modes.  The
    result is detached from autograd (use ``x + (round_to(x, f) - x).detach()`` for a
    straight-through estimator).  Runs on any device; no Python loop over elements.
    """
    _check_input(x)
    x = x.detach()  # rounding is not differentiable; callers add a straight-through path
    fmt = get_format(fmt)
    if mode not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding mode mode={mode!r}; expected one of {ROUNDING_MODES}")

    out_dtype = _result_dtype(x.dtype, fmt)
    in_fmt = _FORMAT_OF_DTYPE[x.dtype]
    if _contains(fmt, in_fmt) and (in_fmt.has_inf <= fmt.has_inf):
        # every input value (incl. inf) is a value of fmt: nothing to round
        return x.to(out_dtype, copy=True)

    # float32 / float64 arithmetic of the (exactly upcast) input
    compute_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    xc = x.to(compute_dtype)

    native = fmt.torch_dtype
    if mode == "nearest" and native is not None:
        # torch's float32 -> bfloat16/float16 and float64 -> float32 casts are correctly
        # rounded (RNE, gradual underflow, IEEE overflow).  float64 -> bfloat16/float16
        # casts are NOT (they go through float32), so they take the generic path.
        if compute_dtype == torch.float32 and native in (torch.bfloat16, torch.float16):
            return xc.to(native).to(out_dtype)
        if compute_dtype == torch.float64 and native == torch.float32:
            return xc.to(native).to(out_dtype)

    y = _round_generic(xc, fmt, mode, generator)
    return y.to(out_dtype)


def _round_generic(
    x: torch.Tensor, fmt: FloatFormat, mode: str, generator: Optional[torch.Generator]
) -> torch.Tensor:
    """Round float32/float64 ``x`` to ``fmt`` (whose values all lie in ``x.dtype``)."""
    itype, M, B = _LAYOUT[x.dtype]
    m = fmt.mantissa_bits

    # Spacing of fmt's grid at x: 2**(max(e, emin) - m) where 2**e <= |x| < 2**(e+1),
    # with no upper clamp (rounding on a grid unbounded above; overflow handled below).
    # Built from the biased exponent field: the field of a subnormal x is 0 and clamps to
    # fmt's emin (>= the compute dtype's emin); inf/NaN (field 2B+1) clamp to the top
    # finite field so the spacing stays finite.
    lo = fmt.emin + B  # biased field of fmt's smallest normal exponent, >= 1
    field = torch.bitwise_and(x.view(itype), (2 * B + 1) << M).clamp_(lo << M, (2 * B) << M)
    if lo - m >= 1:
        # every spacing is a normal number of the compute dtype
        ulp = field.sub_(m << M).view(x.dtype)
        scaled = x / ulp  # exact: division by a power of two, no underflow
        ulp_lo = None
    else:
        # spacings below the compute dtype's normal range (e.g. bf16 in float32): split
        # 2**k = 2**k1 * 2**k2 with both factors normal; k1 = max(k, 1 - B), k2 <= 0.
        field = field.sub_(m << M)
        ulp = field.clamp_min(1 << M).view(x.dtype)  # 2**k1
        ulp_lo = (field.clamp_max_(1 << M) + ((B - 1) << M)).view(x.dtype)  # 2**k2
        scaled = x / ulp / ulp_lo  # both exact (the second scales up)

    if mode == "nearest":
        r = torch.round(scaled)  # half to even; keeps the sign of -0.x
    elif mode == "toward_zero":
        r = torch.trunc(scaled)
    elif mode == "up":
        r = torch.ceil(scaled)
    elif mode == "down":
        r = torch.floor(scaled)
    else:  # stochastic
        r = torch.floor(scaled)
        frac = scaled - r  # exact
        u = torch.rand(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        r = r + (u < frac).to(x.dtype)

    if fmt.min_subnormal > 1.0 and mode in ("up", "down"):
        # With a spacing above 1 the quotient of a value far below the spacing can
        # underflow to zero; directed rounding away from zero must still give one unit.
        # (Stochastic rounding then misses a probability below 2**-126: ignored.)
        if mode == "up":
            r = torch.where((r == 0) & (x > 0), torch.ones_like(r), r)
        else:
            r = torch.where((r == 0) & (x < 0), -torch.ones_like(r), r)

    y = r * ulp_lo * ulp if ulp_lo is not None else r * ulp  # exact (values of fmt)
    if mode == "stochastic":
        y = torch.copysign(y, x)  # -0.3 -> floor -1 + 1 = +0.0: restore the sign

    max_finite = fmt.max_finite
    if fmt.overflow == "saturate":
        clamped = y.clamp(-max_finite, max_finite)  # NaN stays NaN
        if fmt.has_inf:
            clamped = torch.where(torch.isinf(x), x, clamped)
        return clamped
    inf = float("inf")
    if mode in ("nearest", "stochastic"):
        return torch.where(y.abs() > max_finite, y * inf, y)
    if mode == "toward_zero":
        return torch.where(torch.isinf(x), x, y.clamp(-max_finite, max_finite))
    if mode == "up":  # negatives round toward zero, positives away
        y = torch.where(y > max_finite, y * inf, y)
        return torch.where((y < -max_finite) & torch.isfinite(x), -max_finite, y)
    # down: positives round toward zero, negatives away
    y = torch.where(y < -max_finite, y * inf, y)
    return torch.where((y > max_finite) & torch.isfinite(x), max_finite, y)


def is_representable(x: torch.Tensor, fmt: Union[str, FloatFormat]) -> torch.Tensor:
    """Boolean tensor: which elements of ``x`` are values of ``fmt``.

    NaN counts as representable iff the format has NaN encodings; ``±inf`` iff it has
    infinities; -0.0 and 0.0 always.
    """
    fmt = get_format(fmt)
    r = round_to(x, fmt)
    xr = x.to(r.dtype)
    same = r == xr
    if fmt.nan != "none" and not (fmt.nan == "ieee" and fmt.mantissa_bits == 0):
        same = same | (torch.isnan(xr) & torch.isnan(r))
    return same
