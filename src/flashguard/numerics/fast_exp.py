"""The softmax exponentials of real kernels, bit for bit, and the fused multiply-add they use.

``fexp_u20`` is the fast exponential of PyTorch's fused CPU flash-attention kernel
(ATen ``FlashAttentionKernel.cpp``, ``_exp_reduce_sum_fusion_kernel``: fp32 scores with a bf16
P̄ take ``fexp_u20``; ATen's vec512_float.h and vec256_float.h hold its AVX-512 and AVX2 bodies,
one algorithm at two widths). It follows Malossi et al.,
"Fast exponential computation on SIMD architectures" (2015): with s = x·log2(e) and f its
fractional part, 2^f is approximated by a cubic, and the result is assembled by writing
2^23·(s − poly(f)) + 127·2^23, truncated to an integer, as the bits of a float. Its error is
about 20 fp32 ulps, a relative 5e-5 at worst, far below bf16's half ulp (2e-3), which is why
it was chosen for a P̄ rounded to bf16. But it is not exact at 0: fexp_u20(0) = 1 − 2^-14.2
(0.99994659), while the tied maximum of a row needs exp(0) = 1. The kernel sums the
unrounded values into the row sum and rounds P̄ to bf16 (where 0.99994659 becomes 1) for P̄·V,
so every row's O is divided by a row sum 5.3e-5 too small: O is inflated by a relative 5.3e-5
towards V's sign (docs/audit/torch-cpu.md measures it).

Only the vectorised part of a row runs ``fexp_u20``: the first multiple of ``fexp_lanes()``
columns of a key tile (16 fp32 lanes with ATen's AVX-512 kernels, 8 with its AVX2 ones); the
last ``n % lanes`` take libm's ``exp`` (and ATen's scalar DEFAULT build maps ``std::exp`` over
every lane). ``fma32`` is a single-rounding fp32
fused multiply-add, as the kernel's ``_mm512_fmadd_ps``: the product of two fp32 values is
exact in fp64, the sum is rounded to odd in fp64 (two more bits than needed), and that
rounds to fp32 exactly as one rounding would (Boldo & Melquiond, "Emulation of FMA and
correctly rounded sums: proved algorithms using rounding to odd", 2008).

Both run as one C pass where a C compiler is at hand (numerics/native.py: fp32 tensors on the
CPU), else in PyTorch as written here; the two agree bit for bit (tests/numerics/test_native.py).
"""
from __future__ import annotations

import platform

import torch

from . import native

__all__ = ["fma32", "fexp_u20", "fexp_lanes", "EXP_IMPLEMENTATIONS"]

# ATen's Vectorized<float> width in fp32 lanes, per CPU capability whose fexp_u20 is the cubic
# modelled here (vec512_float.h, vec256_float.h); the kernel compiles once per capability and
# runs the one torch picked for this CPU (ATEN_CPU_CAPABILITY overrides it)
_CUBIC_LANES = {"AVX512": 16, "AVX2": 8}
EXP_IMPLEMENTATIONS = ("exact", "fexp_u20")

_F32, _F64 = torch.float32, torch.float64


def fexp_lanes() -> int:
    """The SIMD width of the kernel's fast exponential in this process: a key tile's first
    ``n - n % fexp_lanes()`` columns take ``fexp_u20``, the rest libm's exp. 0 where no column
    does (ATen's scalar DEFAULT build on x86, whose fexp_u20 is ``std::exp`` on every lane).
    ARM's NEON and SVE kernels have fexp_u20s of their own, not modelled: a ValueError."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap in _CUBIC_LANES:
        return _CUBIC_LANES[cap]
    if cap == "DEFAULT" and platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return 0
    raise ValueError(f"the torch-cpu model's fast exponential is modelled for ATen's AVX-512, AVX2 and x86 "
                     f"DEFAULT kernels; this process runs ATen's {cap} kernels on {platform.machine()}, "
                     "whose fexp_u20 is not modelled (use exp='exact' or another preset)")


def _native(name: str, *ts: torch.Tensor) -> "torch.Tensor | None":
    """The C kernel ``fg_<name>`` (numerics/native.py) on ``ts``, broadcast to one shape and made
    contiguous fp32: a new fp32 tensor, or None where the C path does not apply (then the
    caller's PyTorch fallback runs)."""
    if not all(t.device.type == "cpu" for t in ts):
        return None
    lib = native.library()
    if lib is None:
        return None
    shape = torch.broadcast_shapes(*(t.shape for t in ts))
    args = [t.to(_F32).expand(shape).contiguous() for t in ts]
    out = torch.empty_like(args[0])
    getattr(lib, f"fg_{name}")(*(t.data_ptr() for t in args), out.data_ptr(), out.numel())
    return out


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` with one rounding (round to nearest even), elementwise."""
    out = _native("fma32", a, b, c)
    return fma32_torch(a, b, c) if out is None else out


def fma32_torch(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``fma32`` in PyTorch (fp64 passes, any device): the fallback of the C path."""
    p = a.to(_F64) * b.to(_F64)       # exact: 24 + 24 significant bits
    c = c.to(_F64)
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)   # TwoSum: p + c = s + err exactly
    bits = s.view(torch.int64)
    inexact = err != 0
    # round to odd: the fp64 value truncated towards zero, with its last bit set when inexact
    below = inexact & ((err > 0) != (s > 0))  # |p + c| < |s|: truncation is one step below |s|
    bits = torch.where(below, bits - 1, bits)
    bits = torch.where(inexact, bits | 1, bits)
    return bits.view(_F64).to(_F32)


def _f32_bits(i: int) -> torch.Tensor:
    return torch.tensor([i - (1 << 32) if i >= 1 << 31 else i], dtype=torch.int32).view(_F32)[0]


_LOG2E = _f32_bits(0x3FB8AA3B)
_LN_FLT_MIN = _f32_bits(0xC2AEAC50)   # below: 0
_LN_FLT_MAX = _f32_bits(0x42B17218)   # above: +inf
# the cubic's coefficients (double literals rounded to float, as _mm512_set1_ps does)
_C = [torch.tensor(x, dtype=_F32) for x in
      (0.00010703434948458272, 0.30354260500649682, -0.22433836478672356, -0.079204240219773236)]
_A = torch.tensor(2.0 ** 23, dtype=_F32)
_B = torch.tensor(2.0 ** 23 * 127, dtype=_F32)


def fexp_u20(x: torch.Tensor) -> torch.Tensor:
    """ATen's AVX-512 / AVX2 ``fexp_u20`` of fp32 ``x``, bit for bit (a new fp32 tensor)."""
    out = _native("fexp_u20", x)
    return fexp_u20_torch(x) if out is None else out


def fexp_u20_torch(x: torch.Tensor) -> torch.Tensor:
    """``fexp_u20`` in PyTorch (any device): the fallback of the C path."""
    x = x.to(_F32)
    dev = x.device
    c0, c1, c2, c3 = (c.to(dev).expand_as(x) for c in _C)
    src = x * _LOG2E.to(dev)
    frac = src - torch.floor(src)
    poly = fma32_torch(frac, fma32_torch(frac, fma32_torch(frac, c3, c2), c1), c0)
    src = src - poly
    word = torch.trunc(fma32_torch(_A.to(dev).expand_as(x), src, _B.to(dev).expand_as(x)))  # cvtt: towards 0
    out = torch.nan_to_num(word, nan=0.0).to(torch.int32).view(_F32)
    out = torch.where(x < _LN_FLT_MIN.to(dev), torch.zeros_like(out), out)
    out = torch.where(x > _LN_FLT_MAX.to(dev), torch.full_like(out, float("inf")), out)
    return torch.where(torch.isnan(x), x, out)
