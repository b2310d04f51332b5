"""Exact tests of flashguard.numerics.formats (FloatFormat, get_format, exmy, round_to).

References used:
* ml_dtypes / numpy casts from float32 (correct round-to-nearest-even),
* torch casts float32 -> bfloat16/float16/float8 and float64 -> float32,
* for float64 inputs: round-to-odd to float32 followed by a float32 RNE cast (exactly
  RNE of the float64 value since float32 has >= 2 more bits than every target),
* a slow pure-Python reference over fractions.Fraction (all deterministic modes).
"""

from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
import torch

from flashguard.numerics import (
    BF16,
    E4M3,
    E5M2,
    FORMATS,
    FP16,
    FP32,
    FP64,
    FloatFormat,
    exmy,
    get_format,
    is_representable,
    round_to,
)
from flashguard.numerics.formats import _round_generic

# numpy warns when casting out-of-range values (to inf / NaN); that is what we test.
pytestmark = pytest.mark.filterwarnings(
    "ignore:overflow encountered in cast:RuntimeWarning",
    "ignore:invalid value encountered in cast:RuntimeWarning",
)

MODES = ("nearest", "stochastic", "up", "down", "toward_zero")
DIRECTED = ("nearest", "up", "down", "toward_zero")
INF = math.inf
NAN = math.nan

# name -> (format, ml_dtypes/numpy dtype, torch dtype whose bit patterns we enumerate)
LOW_PRECISION = {
    "bf16": (BF16, ml_dtypes.bfloat16, torch.bfloat16),
    "fp16": (FP16, np.float16, torch.float16),
    "e4m3": (E4M3, ml_dtypes.float8_e4m3fn, torch.float8_e4m3fn),
    "e5m2": (E5M2, ml_dtypes.float8_e5m2, torch.float8_e5m2),
}


# ------------------------------------------------------------------------ helpers
def bits64(t) -> torch.Tensor:
    """Bit patterns of the float64 image of t (tensor or array), NaNs canonicalised."""
    t = torch.as_tensor(t).double()
    b = t.view(torch.int64).clone()
    b[torch.isnan(t)] = 0x7FF8000000000000
    return b


def assert_bitwise_equal(actual, expected, inputs=None) -> None:
    a, e = bits64(actual), bits64(expected)
    bad = (a != e).nonzero().flatten()
    if bad.numel():
        i = bad[:10]
        av = torch.as_tensor(actual).double().flatten()[i].tolist()
        ev = torch.as_tensor(expected).double().flatten()[i].tolist()
        xs = torch.as_tensor(inputs).double().flatten()[i].tolist() if inputs is not None else None
        raise AssertionError(
            f"{bad.numel()} mismatches; first: inputs={xs} actual={av} expected={ev}"
        )


def all_patterns(torch_dtype) -> torch.Tensor:
    """Every bit pattern of a 8/16-bit torch dtype, decoded to float32."""
    n = 256 if torch_dtype.itemsize == 1 else 65536
    ints = torch.arange(n, dtype=torch.int32)
    stored = ints.to(torch.uint8) if n == 256 else ints.to(torch.int16)
    return stored.view(torch_dtype).float()


def finite_positive_values(name) -> np.ndarray:
    """Sorted finite values >= 0 of a named low-precision format, float64."""
    v = all_patterns(LOW_PRECISION[name][2]).double().numpy()
    v = v[np.isfinite(v) & (v >= 0)]
    return np.unique(v)


def spacing(a: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Distance from |a| (a value of fmt) to the next value of fmt's unbounded grid."""
    a = np.abs(np.asarray(a, dtype=np.float64))
    _, e = np.frexp(a)
    e = np.where(a == 0, fmt.emin, np.maximum(e - 1, fmt.emin))
    return np.ldexp(1.0, (e - fmt.mantissa_bits).astype(np.int32))


def ref_round(v: float, fmt: FloatFormat, mode: str) -> float:
    """Slow exact reference: round the float v to fmt with Fractions."""
    if math.isnan(v):
        return v
    if math.isinf(v):
        return v if fmt.has_inf else math.copysign(fmt.max_finite, v)
    if v == 0:
        return v
    neg = v < 0
    a = Fraction(abs(v))
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    ulp = Fraction(2) ** (max(e, fmt.emin) - fmt.mantissa_bits)
    q = a / ulp
    fl = math.floor(q)
    frac = q - fl
    if mode == "nearest":
        n = fl + (1 if frac > Fraction(1, 2) or (frac == Fraction(1, 2) and fl % 2) else 0)
    elif mode == "toward_zero":
        n = fl
    elif mode == "up":
        n = fl + (1 if frac and not neg else 0)
    elif mode == "down":
        n = fl + (1 if frac and neg else 0)
    else:
        raise ValueError(mode)
    mag = n * ulp
    if mag > Fraction(fmt.max_finite):
        away = mode == "nearest" or (mode == "up" and not neg) or (mode == "down" and neg)
        if fmt.overflow == "inf" and away:
            return -INF if neg else INF
        mag = Fraction(fmt.max_finite)
    return -float(mag) if neg else float(mag)


def round_to_odd_f32(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounding to odd (truncate, set the last bit if inexact)."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        f = x.astype(np.float32)
    too_big = np.abs(f.astype(np.float64)) > np.abs(x)  # False for NaN
    f = np.where(too_big, np.nextafter(f, np.float32(0)), f).astype(np.float32)
    inexact = (f.astype(np.float64) != x) & np.isfinite(x)
    return (f.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)


def ml_round(x32: np.ndarray, name: str) -> np.ndarray:
    """ml_dtypes/numpy RNE of float32 values, back to float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        return x32.astype(LOW_PRECISION[name][1]).astype(np.float32)


def nearest_test_values(name: str, n_total: int = 1_050_000, seed: int = 0) -> np.ndarray:
    """float32 values probing every tie / neighbourhood of a format, plus random bits."""
    fmt = LOW_PRECISION[name][0]
    rng = np.random.default_rng(seed)
    pos = finite_positive_values(name)
    top_ulp = pos[-1] - pos[-2]
    nxt = np.append(pos[1:], pos[-1] + top_ulp)  # includes the grid point above max
    mid = ((pos + nxt) / 2).astype(np.float32)  # exact: needs m + 2 <= 24 bits
    with np.errstate(over="ignore"):
        pos32 = pos.astype(np.float32)
    inf32 = np.float32(np.inf)
    parts = [
        pos32,
        mid,
        np.nextafter(mid, inf32),
        np.nextafter(mid, -inf32),
        np.nextafter(pos32, inf32),
        np.nextafter(pos32[1:], -inf32),
        # float32 subnormals
        rng.integers(1, 1 << 23, 20_000).astype(np.uint32).view(np.float32),
        # random values spanning the format's range (and a bit beyond)
        (
            np.ldexp(
                1.0 + rng.random(100_000),
                rng.integers(fmt.emin - fmt.mantissa_bits - 3, fmt.emax + 3, 100_000),
            )
        ).astype(np.float32),
        np.array(
            [0.0, np.inf, np.nan, np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1e-45,
             fmt.max_finite, fmt.max_finite + top_ulp / 2, fmt.min_subnormal / 2],
            dtype=np.float32,
        ),
    ]
    x = np.concatenate(parts).astype(np.float32)
    x = np.concatenate([x, -x])
    n_rand = max(n_total - x.size, 200_000)
    random_bits = rng.integers(0, 1 << 32, n_rand, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([x, random_bits.view(np.float32)])


@pytest.fixture(scope="module")
def nearest_values():
    return {name: nearest_test_values(name) for name in LOW_PRECISION}


# --------------------------------------------------------------- format properties
@pytest.mark.parametrize(
    "fmt, max_finite, min_normal, min_subnormal, eps, emin, emax, bits, dtype",
    [
        (FP64, 1.7976931348623157e308, 2.0**-1022, 2.0**-1074, 2.0**-52, -1022, 1023, 64, torch.float64),
        (FP32, 3.4028234663852886e38, 2.0**-126, 2.0**-149, 2.0**-23, -126, 127, 32, torch.float32),
        (BF16, 3.3895313892515355e38, 2.0**-126, 2.0**-133, 2.0**-7, -126, 127, 16, torch.bfloat16),
        (FP16, 65504.0, 2.0**-14, 2.0**-24, 2.0**-10, -14, 15, 16, torch.float16),
        (E4M3, 448.0, 2.0**-6, 2.0**-9, 2.0**-3, -6, 8, 8, None),
        (E5M2, 57344.0, 2.0**-14, 2.0**-16, 2.0**-2, -14, 15, 8, None),
        (exmy(3, 2), 14.0, 2.0**-2, 2.0**-4, 2.0**-2, -2, 3, 6, None),
        (exmy(4, 3), 240.0, 2.0**-6, 2.0**-9, 2.0**-3, -6, 7, 8, None),
        (exmy(8, 2), 1.75 * 2.0**127, 2.0**-126, 2.0**-128, 2.0**-2, -126, 127, 11, None),
        (FloatFormat("e3m2nn", 3, 2, 3, False, "none", "saturate"), 28.0, 0.25, 2.0**-4, 0.25, -2, 4, 6, None),
        (FloatFormat("e3m0fn", 3, 0, 3, False, "fn", "saturate"), 8.0, 0.25, 0.25, 1.0, -2, 3, 4, None),
    ],
    ids=str,
)
def test_format_properties(fmt, max_finite, min_normal, min_subnormal, eps, emin, emax, bits, dtype):
    assert fmt.max_finite == max_finite
    assert fmt.min_normal == min_normal
    assert fmt.min_subnormal == min_subnormal
    assert fmt.eps == eps
    assert (fmt.emin, fmt.emax, fmt.total_bits) == (emin, emax, bits)
    assert fmt.torch_dtype is dtype
    assert fmt.is_native == (dtype is not None)
    assert str(fmt) == fmt.name


def test_named_formats_match_torch_finfo():
    for fmt in (FP64, FP32, BF16, FP16):
        fi = torch.finfo(fmt.torch_dtype)
        assert (fmt.max_finite, fmt.min_normal, fmt.eps) == (fi.max, fi.tiny, fi.eps)
    for fmt, dt in ((E4M3, torch.float8_e4m3fn), (E5M2, torch.float8_e5m2)):
        fi = torch.finfo(dt)
        assert (fmt.max_finite, fmt.min_normal, fmt.eps) == (fi.max, fi.tiny, fi.eps)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("fp64", FP64), ("FP32", FP32), ("bf16", BF16), ("fp16", FP16), ("e4m3", E4M3),
        ("E4M3FN", E4M3), ("e5m2", E5M2), ("float32", FP32), ("bfloat16", BF16),
        ("float16", FP16), ("Float64", FP64), ("e8m7", BF16), ("e5m10", FP16),
        ("e8m23", FP32), ("e11m52", FP64), ("e5m2_ieee", E5M2), (E4M3, E4M3),
    ],
    ids=str,
)
def test_get_format_names(name, expected):
    assert get_format(name) is expected


def test_exmy():
    assert exmy(8, 7) is BF16 and exmy(5, 10) is FP16 and exmy(8, 23) is FP32
    assert exmy(11, 52) is FP64 and exmy(5, 2) is E5M2
    f = exmy(3, 2)
    assert (f.name, f.bias, f.has_inf, f.nan, f.overflow) == ("e3m2", 3, True, "ieee", "inf")
    assert get_format("e3m2") == f and get_format("E3M2") == f
    # the IEEE-like e4m3 is not OCP e4m3fn and must not share its name
    g = exmy(4, 3)
    assert g != E4M3 and g.name == "e4m3_ieee" and g.has_inf and g.max_finite == 240.0
    assert get_format("e4m3_ieee") == g
    assert set(FORMATS) == {"fp64", "fp32", "bf16", "fp16", "e4m3", "e5m2"}


def test_torch_dtype_by_content_not_name():
    same_as_fp16 = FloatFormat("myhalf", 5, 10, 15, True, "ieee", "inf")
    assert same_as_fp16.torch_dtype is torch.float16
    assert FloatFormat("sathalf", 5, 10, 15, True, "ieee", "saturate").torch_dtype is None


# ----------------------------------------------------- 1. every bit pattern is kept
def _exhaustive_cases():
    for name, (fmt, _, tdt) in LOW_PRECISION.items():
        in_dtypes = [tdt] if tdt in (torch.bfloat16, torch.float16) else []
        in_dtypes += [torch.float32, torch.float64]
        if tdt not in (torch.bfloat16, torch.float16):
            in_dtypes += [torch.bfloat16, torch.float16]
        for in_dtype in in_dtypes:
            for mode in MODES:
                yield pytest.param(name, in_dtype, mode, id=f"{name}-{str(in_dtype)[6:]}-{mode}")


@pytest.mark.parametrize("name, in_dtype, mode", list(_exhaustive_cases()))
def test_every_bit_pattern_is_fixed_point(name, in_dtype, mode):
    fmt, _, tdt = LOW_PRECISION[name]
    x = all_patterns(tdt).to(in_dtype)
    gen = torch.Generator().manual_seed(1)
    y = round_to(x, fmt, mode, generator=gen)
    assert y.shape == x.shape
    assert_bitwise_equal(y, x, x)


def test_fp8_decoding_agrees_with_ml_dtypes():
    for name in ("e4m3", "e5m2"):
        _, mld, tdt = LOW_PRECISION[name]
        ours = all_patterns(tdt)
        ref = np.arange(256, dtype=np.uint8).view(mld).astype(np.float32)
        assert_bitwise_equal(ours, torch.from_numpy(ref))


# --------------------------------------------- 2. nearest vs ml_dtypes and torch
E4M3_ML_DTYPES_NAN_THRESHOLD = 464.0  # |x| > 464 rounds past 448: ml_dtypes -> NaN, ours 448


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_nearest_matches_ml_dtypes(name, nearest_values):
    fmt = LOW_PRECISION[name][0]
    x = nearest_values[name]
    assert x.size >= 1_000_000
    ours = round_to(torch.from_numpy(x), fmt).numpy()
    ref = ml_round(x, name)
    if name == "e4m3":
        # documented difference: ml_dtypes' e4m3fn turns overflow (and inf) into NaN,
        # ours saturates (NVIDIA satfinite).  Exactly the |x| > 464 inputs differ.
        differ = np.isnan(ref) & ~np.isnan(x)
        np.testing.assert_array_equal(differ, np.abs(x) > E4M3_ML_DTYPES_NAN_THRESHOLD)
        assert differ.sum() > 1000
        np.testing.assert_array_equal(ours[differ], np.copysign(448.0, x[differ]).astype(np.float32))
        ref = np.where(differ, ours, ref)
    assert_bitwise_equal(torch.from_numpy(ours), torch.from_numpy(ref), x)


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_nearest_matches_torch_casts(name, nearest_values):
    # torch 2.13 CPU float32 -> float8_e4m3fn saturates (inf too), like ours.
    fmt, _, tdt = LOW_PRECISION[name]
    x = torch.from_numpy(nearest_values[name])
    assert_bitwise_equal(round_to(x, fmt), x.to(tdt).float(), x)


@pytest.mark.parametrize("name", list(LOW_PRECISION))
@pytest.mark.parametrize("compute", [torch.float32, torch.float64])
def test_generic_path_nearest_matches_ml_dtypes(name, compute, nearest_values):
    # round_to shortcuts float32 -> bf16/fp16 'nearest' with a torch cast; the generic
    # arithmetic path (used for every other mode and for float64 input) must agree.
    fmt = LOW_PRECISION[name][0]
    x32 = nearest_values[name]
    ours = _round_generic(torch.from_numpy(x32).to(compute), fmt, "nearest", None)
    ref = ml_round(x32, name)
    if name == "e4m3":
        differ = np.isnan(ref) & ~np.isnan(x32)
        ref = np.where(differ, np.copysign(448.0, x32).astype(np.float32), ref)
    assert_bitwise_equal(ours, torch.from_numpy(ref), x32)


# ------------------------------------------------------------ 3. float64 inputs
def fp64_test_values(seed: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = 300_000
    mant = 1.0 + rng.random(n)  # 52 random fraction bits
    x = np.ldexp(mant, rng.integers(-160, 140, n))
    extremes = np.array(
        [0.0, 5e-324, 1e-300, 2.0**-1022, 1e300, np.finfo(np.float64).max, np.inf, np.nan,
         np.finfo(np.float32).max, 2.0**128, 2.0**128 - 2.0**103, 2.0**-150, 2.0**-150 * 1.0000001],
        dtype=np.float64,
    )
    # double-rounding traps: ties of each format nudged by 2**-30 relative, a shift far
    # below float32's half-ulp, so float64 -> float32 lands exactly on the tie.
    traps = []
    for name in LOW_PRECISION:
        pos = finite_positive_values(name)
        mid = (pos[1:] + pos[:-1]) / 2
        traps += [mid * (1 + 2.0**-30), mid * (1 - 2.0**-30)]
    x = np.concatenate([x, extremes] + traps)
    return np.concatenate([x, -x])


@pytest.fixture(scope="module")
def fp64_values():
    return fp64_test_values()


def test_round_to_odd_reference_is_sound(fp64_values):
    # the float64 reference (round-to-odd to float32, then RNE) agrees with numpy's direct
    # float64 -> float16 cast, which is correctly rounded.
    x = fp64_values
    with np.errstate(over="ignore"):
        direct = x.astype(np.float16).astype(np.float64)
        via_odd = round_to_odd_f32(x).astype(np.float16).astype(np.float64)
    assert_bitwise_equal(torch.from_numpy(via_odd), torch.from_numpy(direct), x)


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_fp64_input_rounds_directly(name, fp64_values):
    fmt = LOW_PRECISION[name][0]
    x = fp64_values
    y = round_to(torch.from_numpy(x), fmt)
    assert y.dtype == torch.float64
    ro = round_to_odd_f32(x)
    ref = ml_round(ro, name).astype(np.float64)
    if name == "e4m3":
        differ = np.isnan(ref) & ~np.isnan(x)
        ref = np.where(differ, np.copysign(448.0, x), ref)
    assert_bitwise_equal(y, torch.from_numpy(ref), x)
    # the traps are real: rounding through float32 first gives a different answer
    with np.errstate(over="ignore"):
        double_rounded = ml_round(x.astype(np.float32), name).astype(np.float64)
    finite = np.isfinite(ref) & np.isfinite(double_rounded)
    assert (double_rounded[finite] != ref[finite]).sum() > 100


def test_fp64_to_fp32_matches_torch_and_numpy(fp64_values):
    rng = np.random.default_rng(3)
    f32 = rng.integers(0, 1 << 32, 500_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    f32 = f32[np.isfinite(f32)].astype(np.float64)
    nxt = np.nextafter(f32.astype(np.float32), np.float32(np.inf)).astype(np.float64)
    ties = (f32 + nxt) / 2  # exact in float64
    x = np.concatenate([fp64_values, ties, np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf)])
    xt = torch.from_numpy(x)
    y = round_to(xt, FP32)
    assert y.dtype == torch.float64
    assert_bitwise_equal(y, xt.to(torch.float32), x)
    with np.errstate(over="ignore"):
        assert_bitwise_equal(y, torch.from_numpy(x.astype(np.float32)), x)


def test_torch_fp64_to_bf16_cast_double_rounds():
    # Why round_to does not use torch's float64 -> bfloat16/float16 casts: they go via
    # float32.  1 + 2**-8 + 2**-40 is just above a bf16 tie: correct result 1 + 2**-7.
    x = torch.tensor([1 + 2.0**-8 + 2.0**-40, 1 + 2.0**-11 + 2.0**-40], dtype=torch.float64)
    assert x.to(torch.bfloat16).double().tolist()[0] == 1.0  # torch: double rounding
    assert x.to(torch.float16).double().tolist()[1] == 1.0  # torch: double rounding
    assert round_to(x[:1], BF16).tolist() == [1 + 2.0**-7]
    assert round_to(x[1:], FP16).tolist() == [1 + 2.0**-10]
    assert round_to(x[:1], BF16, "up").tolist() == [1 + 2.0**-7]
    assert round_to(x[:1], BF16, "down").tolist() == [1.0]


# ------------------------------------------------------------------- 4. tables
MAX_BF16 = 2.0**128 - 2.0**120
F32_MAX = 2.0**128 - 2.0**104

TABLE = [
    # bf16: m=7, min subnormal 2**-133, max 2**128 - 2**120
    ("bf16", "nearest", 1 + 2.0**-8, 1.0),  # tie -> even
    ("bf16", "nearest", 1 + 3 * 2.0**-8, 1 + 2.0**-6),  # tie -> even (up)
    ("bf16", "nearest", 1 + 2.0**-8 + 2.0**-23, 1 + 2.0**-7),
    ("bf16", "nearest", 1 + 2.0**-8 - 2.0**-23, 1.0),
    ("bf16", "nearest", -4.703990459442139, -4.71875),  # the paper's worked example
    ("bf16", "nearest", 2.0**-134, 0.0),  # tie with zero -> 0
    ("bf16", "nearest", -(2.0**-134), -0.0),
    ("bf16", "nearest", 3 * 2.0**-134, 2.0**-132),
    ("bf16", "nearest", 2.0**-134 + 2.0**-149, 2.0**-133),
    ("bf16", "nearest", 2.0**-126 - 2.0**-134, 2.0**-126),  # largest subnormal/min normal tie
    ("bf16", "nearest", MAX_BF16, MAX_BF16),
    ("bf16", "nearest", 2.0**128 - 2.0**119, INF),  # max + half ulp -> inf
    ("bf16", "nearest", 2.0**128 - 2.0**119 - 2.0**104, MAX_BF16),
    ("bf16", "nearest", -F32_MAX, -INF),
    ("bf16", "nearest", INF, INF),
    ("bf16", "nearest", -INF, -INF),
    ("bf16", "up", 1 + 2.0**-23, 1 + 2.0**-7),
    ("bf16", "down", 1 + 2.0**-23, 1.0),
    ("bf16", "toward_zero", -1 - 2.0**-23, -1.0),
    ("bf16", "down", -1 - 2.0**-23, -1 - 2.0**-7),
    ("bf16", "up", -(2.0**-149), -0.0),
    ("bf16", "down", 2.0**-149, 0.0),
    ("bf16", "up", 2.0**-149, 2.0**-133),
    ("bf16", "down", -(2.0**-149), -(2.0**-133)),
    ("bf16", "up", F32_MAX, INF),
    ("bf16", "toward_zero", F32_MAX, MAX_BF16),
    ("bf16", "down", -F32_MAX, -INF),
    ("bf16", "up", -F32_MAX, -MAX_BF16),
    # fp16: m=10, min subnormal 2**-24, max 65504 (ulp 32)
    ("fp16", "nearest", 1 + 2.0**-11, 1.0),
    ("fp16", "nearest", 1 + 3 * 2.0**-11, 1 + 2.0**-9),
    ("fp16", "nearest", 2049.0, 2048.0),
    ("fp16", "nearest", 2051.0, 2052.0),
    ("fp16", "nearest", 2.0**-25, 0.0),
    ("fp16", "nearest", -(2.0**-25), -0.0),
    ("fp16", "nearest", 3 * 2.0**-25, 2.0**-23),
    ("fp16", "nearest", 2.0**-25 + 2.0**-40, 2.0**-24),
    ("fp16", "nearest", 2.0**-14 - 2.0**-25, 2.0**-14),
    ("fp16", "nearest", 65519.0, 65504.0),
    ("fp16", "nearest", 65519.99609375, 65504.0),
    ("fp16", "nearest", 65520.0, INF),
    ("fp16", "nearest", -65520.0, -INF),
    ("fp16", "nearest", 1e5, INF),
    ("fp16", "toward_zero", 1e5, 65504.0),
    ("fp16", "up", -1e5, -65504.0),
    ("fp16", "down", 1e5, 65504.0),
    ("fp16", "up", 1e5, INF),
    ("fp16", "down", -1e5, -INF),
    ("fp16", "toward_zero", INF, INF),
    ("fp16", "toward_zero", -INF, -INF),
    ("fp16", "up", 2.0**-40, 2.0**-24),
    ("fp16", "down", -(2.0**-40), -(2.0**-24)),
    ("fp16", "toward_zero", -(2.0**-40), -0.0),
    # e4m3 (OCP fn): m=3, min subnormal 2**-9, min normal 2**-6, max 448, saturating
    ("e4m3", "nearest", 464.0, 448.0),  # tie between 448 and 480 -> even 448
    ("e4m3", "nearest", -464.0, -448.0),
    ("e4m3", "nearest", 465.0, 448.0),  # rounds to 480 on the grid -> saturates
    ("e4m3", "nearest", 480.0, 448.0),
    ("e4m3", "nearest", 449.0, 448.0),
    ("e4m3", "nearest", 1e9, 448.0),
    ("e4m3", "nearest", INF, 448.0),
    ("e4m3", "nearest", -INF, -448.0),
    ("e4m3", "nearest", 2.0**-10, 0.0),
    ("e4m3", "nearest", -(2.0**-10), -0.0),
    ("e4m3", "nearest", 3 * 2.0**-10, 2.0**-8),
    ("e4m3", "nearest", 2.0**-10 + 2.0**-20, 2.0**-9),
    ("e4m3", "nearest", 2.0**-6 - 2.0**-10, 2.0**-6),
    ("e4m3", "nearest", 17.0, 16.0),
    ("e4m3", "nearest", 19.0, 20.0),
    ("e4m3", "nearest", 0.09765625, 0.09375),  # 12.5 units of 2**-7 -> 12
    ("e4m3", "nearest", 0.1015625 - 2.0**-10, 0.1015625),
    ("e4m3", "nearest", NAN, NAN),
    ("e4m3", "up", 448.5, 448.0),
    ("e4m3", "down", -1e9, -448.0),
    ("e4m3", "up", -INF, -448.0),
    ("e4m3", "toward_zero", INF, 448.0),
    ("e4m3", "stochastic", 1e9, 448.0),
    ("e4m3", "stochastic", -INF, -448.0),
    ("e4m3", "up", 2.0**-20, 2.0**-9),
    ("e4m3", "down", 2.0**-20, 0.0),
    ("e4m3", "down", -(2.0**-20), -(2.0**-9)),
    ("e4m3", "up", NAN, NAN),
    # e5m2: m=2, min subnormal 2**-16, max 57344 (ulp 8192), IEEE overflow
    ("e5m2", "nearest", 61440.0, INF),  # max + half ulp: tie -> even 65536 -> inf
    ("e5m2", "nearest", 61439.0, 57344.0),
    ("e5m2", "nearest", -61440.0, -INF),
    ("e5m2", "nearest", 57344.0, 57344.0),
    ("e5m2", "nearest", 2.0**-17, 0.0),
    ("e5m2", "nearest", 3 * 2.0**-17, 2.0**-15),
    ("e5m2", "nearest", 1.125, 1.0),
    ("e5m2", "nearest", 1.375, 1.5),
    ("e5m2", "nearest", 1e6, INF),
    ("e5m2", "nearest", INF, INF),
    ("e5m2", "nearest", NAN, NAN),
    ("e5m2", "toward_zero", 1e6, 57344.0),
    ("e5m2", "up", -1e6, -57344.0),
    ("e5m2", "down", -1e6, -INF),
    ("e5m2", "up", 1e6, INF),
    ("e5m2", "down", 1e6, 57344.0),
    ("e5m2", "toward_zero", -INF, -INF),
    ("e5m2", "up", -INF, -INF),
    ("e5m2", "down", INF, INF),
    ("e5m2", "stochastic", 1e6, INF),
    # e3m2 (IEEE-like): bias 3, min subnormal 2**-4, max 14 (ulp 2)
    ("e3m2", "nearest", 15.0, INF),
    ("e3m2", "nearest", 14.5, 14.0),
    ("e3m2", "nearest", 13.0, 12.0),
    ("e3m2", "nearest", 2.0**-5, 0.0),
    ("e3m2", "nearest", 3 * 2.0**-5, 0.125),
    ("e3m2", "nearest", 0.296875, 0.3125),
    ("e3m2", "toward_zero", 100.0, 14.0),
    # e8m2: bf16's range with 2 mantissa bits
    ("e8m2", "nearest", 1.125, 1.0),
    ("e8m2", "nearest", 1.375, 1.5),
    ("e8m2", "nearest", 2.0**-129, 0.0),
    ("e8m2", "nearest", 3 * 2.0**-129, 2.0**-127),
    ("e8m2", "nearest", 1.75 * 2.0**127 + 2.0**124, INF),
    ("e8m2", "nearest", 1.75 * 2.0**127 + 2.0**123, 1.75 * 2.0**127),
    # e8m5
    ("e8m5", "nearest", 1 + 2.0**-6, 1.0),
    ("e8m5", "nearest", 1 + 3 * 2.0**-6, 1 + 2.0**-4),
    ("e8m5", "up", 1 + 2.0**-20, 1 + 2.0**-5),
]


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fmt_name, mode, x, expected", TABLE)
def test_table(fmt_name, mode, x, expected, in_dtype):
    xt = torch.tensor([x], dtype=in_dtype)
    assert xt.item() == x or math.isnan(x)  # the input is exact in float32
    y = round_to(xt, fmt_name, mode, generator=torch.Generator().manual_seed(0))
    assert_bitwise_equal(y, torch.tensor([expected], dtype=torch.float64), xt)
    if mode != "stochastic":
        assert_bitwise_equal(y, torch.tensor([ref_round(x, get_format(fmt_name), mode)]), xt)


def test_paper_example_from_every_input_dtype():
    x = -4.703990459442139
    for dt in (torch.float64, torch.float32):
        assert round_to(torch.tensor([x], dtype=dt), BF16).tolist() == [-4.71875]


# ------------------------------------------------ 5. Fraction reference, all formats
BIG_SUBNORMAL = FloatFormat("e3m1_bigsub", 3, 1, -2, False, "none", "saturate")  # min sub 4

REFERENCE_FORMATS = [
    (BF16, torch.float32),
    (FP16, torch.float32),
    (E4M3, torch.float32),
    (E5M2, torch.float32),
    (exmy(3, 2), torch.float32),
    (exmy(8, 2), torch.float32),
    (exmy(8, 5), torch.float32),
    (exmy(4, 3), torch.float32),
    (exmy(2, 1), torch.float32),
    (exmy(3, 0), torch.float32),
    (FloatFormat("e3m0fn", 3, 0, 3, False, "fn", "saturate"), torch.float32),
    (FloatFormat("e3m2nn", 3, 2, 3, False, "none", "saturate"), torch.float32),
    (FloatFormat("e5m2sat", 5, 2, 15, True, "ieee", "saturate"), torch.float32),
    (BIG_SUBNORMAL, torch.float32),
    (BF16, torch.float64),
    (FP32, torch.float64),
    (exmy(11, 5), torch.float32),
    (exmy(11, 50), torch.float64),
    (E4M3, torch.bfloat16),
    (E5M2, torch.float16),
]


def reference_values(fmt: FloatFormat, in_dtype: torch.dtype, n: int = 1500, seed: int = 4):
    """Values around fmt's whole range, exact in in_dtype; ties and neighbours included."""
    rng = np.random.default_rng(seed)
    lo = max(math.log2(fmt.min_subnormal) - 4, -1070)
    hi = min(math.log2(fmt.max_finite) + 3, 1020)
    if in_dtype != torch.float64:
        fi = torch.finfo(in_dtype)
        lo, hi = max(lo, math.log2(fi.smallest_normal) - 20), min(hi, math.log2(fi.max) - 1)
    mags = torch.from_numpy(np.exp2(rng.uniform(lo, hi, n))).to(in_dtype).double().numpy()
    grid = round_to(torch.from_numpy(mags).to(in_dtype), fmt, "down").double().numpy()
    grid = grid[np.isfinite(grid)]
    mids = grid + spacing(grid, fmt) / 2
    top = fmt.max_finite + float(spacing(fmt.max_finite, fmt)) / 2
    extra = [0.0, INF, NAN, fmt.max_finite, fmt.min_subnormal, fmt.min_normal, top,
             fmt.min_subnormal / 2, 1.0, 1.5]
    allv = np.concatenate([mags, grid, mids, np.array(extra)])
    allv = np.concatenate([allv, -allv])
    x = torch.from_numpy(allv).to(in_dtype)
    keep = torch.isnan(x) | (x.double() == torch.from_numpy(allv))
    return x[keep]


@pytest.mark.parametrize(
    "fmt, in_dtype", REFERENCE_FORMATS, ids=[f"{f}-{str(d)[6:]}" for f, d in REFERENCE_FORMATS]
)
def test_against_fraction_reference(fmt, in_dtype):
    x = reference_values(fmt, in_dtype)
    assert x.numel() > 1000
    xs = x.double().tolist()
    for mode in DIRECTED:
        y = round_to(x, fmt, mode)
        ref = torch.tensor([ref_round(v, fmt, mode) for v in xs], dtype=torch.float64)
        assert_bitwise_equal(y, ref, x)


def test_big_min_subnormal_directed_underflow():
    # min subnormal 4 > 1: quotients of tiny inputs underflow in float32 arithmetic
    x = torch.tensor([2.0**-149, -(2.0**-149), 1e-30, -1e-30, 3.0, 2.0, -2.0, 1.0])
    assert round_to(x, BIG_SUBNORMAL, "up").tolist() == [4.0, -0.0, 4.0, -0.0, 4.0, 4.0, -0.0, 4.0]
    assert round_to(x, BIG_SUBNORMAL, "down").tolist() == [0.0, -4.0, 0.0, -4.0, 0.0, 0.0, -4.0, 0.0]
    assert round_to(x, BIG_SUBNORMAL, "nearest").tolist() == [0.0, -0.0, 0.0, -0.0, 4.0, 0.0, -0.0, 0.0]


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_directed_mode_properties(name, nearest_values):
    fmt = LOW_PRECISION[name][0]
    x32 = nearest_values[name][::4]
    x = torch.from_numpy(x32)
    xd = x32.astype(np.float64)
    up = round_to(x, fmt, "up").double().numpy()
    down = round_to(x, fmt, "down").double().numpy()
    tz = round_to(x, fmt, "toward_zero").double().numpy()
    near = round_to(x, fmt, "nearest").double().numpy()
    sto = round_to(x, fmt, "stochastic", generator=torch.Generator().manual_seed(5)).double().numpy()
    inrange = np.isfinite(xd) & (np.abs(xd) <= fmt.max_finite)
    xd, up, down, tz, near, sto = (a[inrange] for a in (xd, up, down, tz, near, sto))
    assert np.all(down <= xd) and np.all(xd <= up)
    exact = up == down
    np.testing.assert_array_equal(exact, down == xd)
    gap = (up - down)[~exact]
    np.testing.assert_array_equal(gap, spacing(np.minimum(np.abs(up), np.abs(down))[~exact], fmt))
    np.testing.assert_array_equal(tz, np.where(xd >= 0, down, up))
    assert np.all(np.abs(tz) <= np.abs(xd))
    assert np.all((near == up) | (near == down))
    assert np.all((sto == up) | (sto == down))
    # nearest is the closer neighbour (ties checked against ml_dtypes elsewhere)
    assert np.all(np.abs(near - xd) <= np.abs(np.where(near == up, down, up) - xd))


# ------------------------------------------------------------------ 6. stochastic
STOCHASTIC_CASES = [
    (BF16, [1 + 2.0**-9, 1 + 3 * 2.0**-9, -(1 + 2.0**-8), 3.0 + 2.0**-10, 2.0**-135,
            -3 * 2.0**-136, 0.1, -1234.5678, 2.0**-133 * 0.999, 7.0e20]),
    (E4M3, [0.1, -0.3, 2.0**-11, 300.0, 440.0, -5.3, 2.0**-9 * 0.01, 1.0 / 3, -100.0, 0.7]),
]


@pytest.mark.parametrize("fmt, values", STOCHASTIC_CASES, ids=["bf16", "e4m3"])
def test_stochastic_is_unbiased_on_two_neighbours(fmt, values):
    reps = 100_000
    x = torch.tensor(values, dtype=torch.float32).repeat_interleave(reps)
    assert x.numel() >= 1_000_000
    gen = torch.Generator().manual_seed(1234)
    y = round_to(x, fmt, "stochastic", generator=gen).double().view(len(values), reps)
    xv = torch.tensor(values, dtype=torch.float32).double()
    lo = round_to(xv, fmt, "down")
    hi = round_to(xv, fmt, "up")
    for i, v in enumerate(xv.tolist()):
        assert lo[i] < v < hi[i], "test values must be inexact"
        row = y[i]
        assert bool(((row == lo[i]) | (row == hi[i])).all())
        p = (v - lo[i].item()) / (hi[i] - lo[i]).item()
        se = (hi[i] - lo[i]).item() * math.sqrt(p * (1 - p) / reps)
        mean_err = (row - v).mean().item()
        assert abs(mean_err) <= 3 * se, (v, mean_err, se)
        frac_up = (row == hi[i]).double().mean().item()
        assert abs(frac_up - p) <= 3 * math.sqrt(p * (1 - p) / reps)


def test_stochastic_seed_reproducible_and_sign_of_zero():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 1e-2
    a = round_to(x, E4M3, "stochastic", generator=torch.Generator().manual_seed(7))
    b = round_to(x, E4M3, "stochastic", generator=torch.Generator().manual_seed(7))
    c = round_to(x, E4M3, "stochastic", generator=torch.Generator().manual_seed(8))
    assert_bitwise_equal(a, b)
    assert not torch.equal(a, c)
    # negative values that round to zero keep -0.0, in every format and mode
    tiny = torch.full((20_000,), -(2.0**-140))  # bf16 min subnormal is 2**-133
    for fmt in (BF16, FP16, E4M3, E5M2):
        for mode in MODES:
            y = round_to(tiny, fmt, mode, generator=torch.Generator().manual_seed(3))
            zero = y == 0
            if mode in ("nearest", "toward_zero", "up"):
                assert bool(zero.all())
            assert bool(torch.signbit(y).all()), (fmt, mode)
            if mode == "stochastic":
                assert 0 < int(zero.sum()) < 20_000 or fmt is not BF16
    pos = round_to(tiny.neg(), E4M3, "stochastic", generator=torch.Generator().manual_seed(3))
    assert not bool(torch.signbit(pos).any())


def test_stochastic_overflow():
    gen = torch.Generator().manual_seed(0)
    x = torch.full((10_000,), 60000.0)
    y = round_to(x, E5M2, "stochastic", generator=gen)
    assert set(y.unique().tolist()) == {57344.0, INF}
    y = round_to(torch.full((10_000,), -450.0), E4M3, "stochastic", generator=gen)
    assert set(y.unique().tolist()) == {-448.0}


# -------------------------------------------------------------- misc behaviour
@pytest.mark.parametrize(
    "in_dtype, fmt, out_dtype",
    [
        (torch.bfloat16, FP32, torch.float32),
        (torch.bfloat16, BF16, torch.bfloat16),
        (torch.float16, BF16, torch.float32),
        (torch.bfloat16, FP16, torch.float32),
        (torch.bfloat16, E4M3, torch.bfloat16),
        (torch.float16, E4M3, torch.float16),
        (torch.float16, E5M2, torch.float16),
        (torch.bfloat16, exmy(8, 2), torch.bfloat16),
        (torch.bfloat16, exmy(8, 8), torch.float32),
        (torch.float32, exmy(8, 2), torch.float32),
        (torch.float32, exmy(11, 5), torch.float64),
        (torch.float32, FP64, torch.float64),
        (torch.float64, BF16, torch.float64),
        (torch.float64, E4M3, torch.float64),
    ],
    ids=str,
)
def test_output_dtype(in_dtype, fmt, out_dtype):
    x = torch.tensor([1.0, -3.3, 1e-3], dtype=torch.float32).to(in_dtype)
    for mode in MODES:
        y = round_to(x, fmt, mode)
        assert y.dtype == out_dtype


def test_returns_new_tensor_and_leaves_input_alone():
    x = torch.tensor([1.0, 2.5, -3.75], dtype=torch.bfloat16)
    y = round_to(x, FP32)
    assert y.dtype == torch.float32 and y.tolist() == [1.0, 2.5, -3.75]
    z = round_to(x, BF16)
    assert z.data_ptr() != x.data_ptr()
    w = torch.tensor([1.1, 2.2])
    before = w.clone()
    round_to(w, E4M3, "stochastic")
    assert torch.equal(w, before)


def test_shapes_and_noncontiguous():
    x = torch.randn(4, 6, 5, generator=torch.Generator().manual_seed(0)).transpose(0, 2)
    for mode in ("nearest", "up"):
        y = round_to(x, E4M3, mode)
        assert y.shape == x.shape
        assert_bitwise_equal(y, round_to(x.contiguous(), E4M3, mode))
    assert round_to(torch.tensor(1.3), BF16).shape == ()
    assert round_to(torch.empty(0, 3), E5M2).shape == (0, 3)


def test_is_representable():
    x = torch.tensor([1.0, 1.0625, 448.0, 480.0, INF, NAN, -0.0, 2.0**-9, 2.0**-10])
    assert is_representable(x, E4M3).tolist() == [True, False, True, False, False, True, True, True, False]
    assert is_representable(x, E5M2).tolist() == [True, False, True, False, True, True, True, True, True]
    assert is_representable(torch.tensor([2.0**-16, 2.0**-17, 1.25, 1.125]), E5M2).tolist() == [True, False, True, False]
    assert is_representable(x, "bf16").tolist() == [True] * 9
    nn = FloatFormat("e3m2nn", 3, 2, 3, False, "none", "saturate")
    assert is_representable(torch.tensor([NAN, 1.0]), nn).tolist() == [False, True]
    for name, (fmt, _, tdt) in LOW_PRECISION.items():
        assert bool(is_representable(all_patterns(tdt), fmt).all())


# ------------------------------------------------------------------- 7. errors
def test_unknown_format_name():
    with pytest.raises(ValueError, match=r"'fp12'.*bf16.*e4m3.*eXmY"):
        get_format("fp12")
    with pytest.raises(ValueError, match="'int8'"):
        round_to(torch.ones(2), "int8")
    with pytest.raises(ValueError):
        get_format("e12m3")  # pattern matches, but exponent_bits out of range


def test_unknown_mode():
    with pytest.raises(ValueError, match=r"mode='nearest_even'"):
        round_to(torch.ones(2), BF16, "nearest_even")


@pytest.mark.parametrize(
    "dtype", [torch.int32, torch.int64, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.complex64]
)
def test_non_float_input_raises_type_error(dtype):
    x = torch.zeros(3, dtype=dtype)
    with pytest.raises(TypeError, match=str(dtype)):
        round_to(x, BF16)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(exponent_bits=1), "exponent_bits"),
        (dict(exponent_bits=12), "exponent_bits"),
        (dict(exponent_bits=4.0), "exponent_bits"),
        (dict(mantissa_bits=-1), "mantissa_bits"),
        (dict(mantissa_bits=53), "mantissa_bits"),
        (dict(nan="quiet"), "nan"),
        (dict(overflow="wrap"), "overflow"),
        (dict(has_inf=True, nan="fn"), "nan"),
        (dict(has_inf=False, nan="ieee", overflow="saturate"), "nan"),
        (dict(has_inf=False, nan="fn", overflow="inf"), "overflow"),
        (dict(has_inf=1), "has_inf"),
        (dict(bias=-1100), "bias"),
        (dict(bias=2000), "bias"),
        (dict(name=""), "name"),
    ],
)
def test_invalid_float_format(kwargs, field):
    base = dict(name="x", exponent_bits=4, mantissa_bits=3, bias=7, has_inf=True, nan="ieee", overflow="inf")
    base.update(kwargs)
    with pytest.raises(ValueError, match=rf"FloatFormat\.{field}"):
        FloatFormat(**base)


def test_exmy_invalid():
    with pytest.raises(ValueError, match="exmy: e"):
        exmy(1, 3)
    with pytest.raises(ValueError, match="exmy: m"):
        exmy(5, 60)
