"""The softmax exponent steps of the GPU flash kernels, in their own step order (docs/kernels.md).

A GPU flash kernel does not compute exp(S - m) on scaled scores. Each folds the softmax scale
and log2(e) into an ``exp2`` in its own order, and that order decides the rounding of the one
number the tie bias turns on: the tied maximum's P̄, which exact arithmetic makes exactly 1.

``exp2_fma``      FlashAttention-2 and -3 as their repository builds them (flash_attn,
                  flash_attn_interface): the raw fp32 scores r = q·k (unscaled), their row max
                  m, c = fp32(scale * log2 e), and P̄ = exp2(fma(r, c, -fp32(m * c))): one FMA,
                  which nvcc contracts ``r * c - max_scaled`` into. At the tied maximum the
                  exponent is the rounding error of m * c (not 0), so P̄ = 2^err ≠ 1 in fp32 by a
                  relative 2^-24 or so; it rounds to 1 in bf16 for P̄·V while the row sum takes the
                  unrounded value (the same mismatch as torch's CPU kernel, a thousand times
                  smaller and of either sign).
``exp2_unfused``  the same kernel as PyTorch builds it for SDPA's FLASH_ATTENTION backend
                  (its softmax.h defines UNFUSE_FMA): exp2(fp32(fp32(r * c) - fp32(m * c))); at the
                  tied maximum both products round alike and P̄ = exp2(0) = 1 exactly.
``exp2_log2e``    PyTorch's memory-efficient kernel (xformers' cutlass kernel): the scores are
                  scaled first (S = fp32(r * scale), plus a bias), then t = fp32(S * fp32(log2 e)),
                  the row max of t, and P̄ = exp2(fp32(t - max t)); exactly 1 at the maximum.

The rescale of the running state and the log-sum-exp follow each kernel too (``rescale``,
``lse``); the backward's recomputation of P from lse as well (``p_from_lse``; the
memory-efficient kernel's backward takes expf(S - lse), the exact path: None).

The GPU's ``ex2.approx`` (what exp2f compiles to under --use_fast_math) has its own error, about
2 ulps, which is not documented bit for bit and is not emulated: exp2 here is correctly
rounded (computed in fp64 from the exact fp32 argument and rounded once to fp32). So are
``__logf`` (log) and the reciprocal 1 / l, approximate instructions on the GPU. Bit-exactness
against a GPU is therefore not claimed; ``flashguard audit --device cuda`` measures it.
"""
from __future__ import annotations

import math

import torch

from .fast_exp import fma32

__all__ = ["EXP2_IMPLEMENTATIONS", "Exp2Steps", "fp32", "kernel_log2e_scale", "LOG2E_F32", "exp2_f32", "fma32_ieee"]

EXP2_IMPLEMENTATIONS = ("exp2_fma", "exp2_unfused", "exp2_log2e")

_F32, _F64 = torch.float32, torch.float64


def fp32(x: float) -> float:
    """A Python float rounded to the nearest fp32 value."""
    return float(torch.tensor(x, dtype=_F64).to(_F32))


# float(M_LOG2E): the kernels' fp32 log2(e) constant
LOG2E_F32 = fp32(math.log2(math.e))


def kernel_log2e_scale(scale: float) -> float:
    """c = fp32(fp32(scale) * M_LOG2E): the softmax scale times log2(e) as the FA2 / FA3 hosts
    compute it (a float scale times the double M_LOG2E, stored in a float)."""
    return fp32(fp32(scale) * math.log2(math.e))


def exp2_f32(x: torch.Tensor) -> torch.Tensor:
    """2^x of fp32 ``x``, correctly rounded to fp32 (computed in fp64, rounded once)."""
    return torch.exp2(x.to(_F64)).to(_F32)


def _r32(x: torch.Tensor) -> torch.Tensor:
    return x.to(_F32)


def fma32_ieee(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``numerics.fast_exp.fma32`` (fp32 a * b + c with one rounding) that also passes infinities
    and NaN through as IEEE arithmetic does (fma32's exactness trick needs finite values)."""
    plain = (a.to(_F64) * b.to(_F64) + c.to(_F64)).to(_F32)
    finite = torch.isfinite(plain)
    if bool(finite.all()):
        return fma32(a, b, c)
    safe = [torch.where(finite, t.to(_F32), torch.zeros((), dtype=_F32)) for t in (a, b, c)]
    return torch.where(finite, fma32(*safe), plain)


class Exp2Steps:
    """One kernel's exponent, rescale, lse and backward-P steps for one call.

    ``raw``: the kernel's exponent takes the unscaled scores r = q·k (FA2 / FA3 without a bias or
    soft-cap) with the multiplier c = fp32(scale * log2 e); otherwise it takes the scaled (biased,
    capped) scores S with c = fp32(log2 e) (the memory-efficient kernel always; FA2 has no
    arbitrary bias, and flashguard applies its exponent form to S there). ``units(m)`` converts a
    shift on S's scale to the exponent's input units (a stabilizer's shift)."""

    def __init__(self, name: str, scale: float, raw: bool):
        if name not in EXP2_IMPLEMENTATIONS:
            raise ValueError(f"Exp2Steps: unknown exp {name!r} (one of {EXP2_IMPLEMENTATIONS})")
        if name == "exp2_log2e":
            raw = False
        self.name, self.raw = name, raw
        self.unit_scale = fp32(scale) if raw else 1.0
        self.c = kernel_log2e_scale(scale) if raw else LOG2E_F32

    def units(self, m: torch.Tensor) -> torch.Tensor:
        """A shift on the scale of S in the exponent's input units (fp32)."""
        return m if not self.raw else _r32(m.to(_F64) / self.unit_scale)

    def exponent(self, u: torch.Tensor, m_u: torch.Tensor) -> torch.Tensor:
        """The fp32 argument of exp2 for inputs ``u`` and the row shift ``m_u`` (finite or 0)."""
        c = torch.tensor(self.c, dtype=_F32, device=u.device)
        max_scaled = _r32(m_u.to(_F32) * c)
        if self.name == "exp2_fma":
            return fma32_ieee(u, c.expand_as(u), (-max_scaled).expand_as(u))
        return _r32(_r32(u * c) - max_scaled)

    def p(self, u: torch.Tensor, m_u: torch.Tensor) -> torch.Tensor:
        """P̄ = exp2(exponent) in fp32 (hidden entries, u = -inf, give 0)."""
        return exp2_f32(self.exponent(u, m_u))

    def rescale(self, m_old: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
        """The factor the running sum and O are multiplied by when the shift moves from m_old
        (-inf before the first visible key) to m_new (finite, or 0 for a row with nothing
        visible yet). FA2 / FA3: exp2(fp32(fp32(m_old - m_new) * c)) (softmax.h,
        softmax_rescale_o); memory-efficient: exp2(fp32(t_old - t_new)) of the log2-scaled maxima
        (kernel_forward.h, iterative_softmax)."""
        c = torch.tensor(self.c, dtype=_F32, device=m_new.device)
        if self.name == "exp2_log2e":
            return exp2_f32(_r32(_r32(m_old * c) - _r32(m_new * c)))
        return exp2_f32(_r32(_r32(m_old - m_new) * c))

    def lse(self, m_u: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
        """The row log-sum-exp in fp32 (natural log, on S's scale). FA2 / FA3:
        fma(m, scale, log l) (nvcc contracts ``row_max * softmax_scale + __logf(sum)``);
        memory-efficient: fp32(fp32(t_max / log2 e) + log l)."""
        log_l = _r32(torch.log(l.to(_F32)))
        if self.name == "exp2_log2e":
            c = torch.tensor(self.c, dtype=_F32, device=m_u.device)
            return _r32(_r32(_r32(m_u * c) / c) + log_l)
        s = torch.tensor(self.unit_scale, dtype=_F32, device=m_u.device)
        return fma32_ieee(m_u.to(_F32), s.expand_as(log_l), log_l)

    @property
    def backward_exp2(self) -> bool:
        """Whether the backward recomputes P with exp2 (FA2 / FA3), not with expf (memory-efficient)."""
        return self.name != "exp2_log2e"

    def p_from_lse(self, u: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """The backward's P = exp2(u * c - fp32(lse * log2 e)) in the kernel's form (FA2
        flash_bwd_kernel.h: scale_apply_exp2 with Scale_max=false; FA3: the preprocess's
        lse * log2 e), fp32. Rows with lse = +inf (nothing visible) give 0."""
        lse_log2 = _r32(lse.to(_F32) * torch.tensor(LOG2E_F32, dtype=_F32, device=u.device))
        c = torch.tensor(self.c, dtype=_F32, device=u.device)
        if self.name == "exp2_fma":
            x = fma32_ieee(u, c.expand_as(u), (-lse_log2).expand_as(u))
        else:
            x = _r32(_r32(u * c) - lse_log2)
        return exp2_f32(x)
