"""Arithmetic whose result is stored in a given format.

Native formats (fp64, fp32, bf16, fp16) are computed by torch in that dtype: one op, one
rounding, which is what a kernel that stores the result in that dtype does. Other formats
are held in fp32 tensors ("storage") and rounded with ``round_to`` after each op, so an
emulated op computes in fp32 and rounds once more to the target format.

Emulated formats round to nearest (ties to even) unless a ``rounding("stochastic")`` context
is active; native formats always round as the hardware does, to nearest. Stochastic rounding
draws from torch's global generator, so a seeded run is reproducible.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from . import bf16_gemm
from .formats import FloatFormat, round_to

__all__ = ["storage_dtype", "cast", "emulate", "matmul", "matmul_conversion", "accumulation_dtype", "rowsum", "rounding", "ROUNDINGS"]

ROUNDINGS = ("nearest", "stochastic")
_MODE: contextvars.ContextVar[str] = contextvars.ContextVar("flashguard_rounding", default="nearest")


@contextlib.contextmanager
def rounding(mode: str):
    """Rounding mode of emulated formats inside the block: "nearest" or "stochastic"."""
    if mode not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {mode!r}")
    token = _MODE.set(mode)
    try:
        yield
    finally:
        _MODE.reset(token)


def emulate(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round an fp32/fp64 tensor to an emulated format in the current rounding mode."""
    return round_to(x, fmt, mode=_MODE.get())


def storage_dtype(fmt: FloatFormat) -> torch.dtype:
    """The torch dtype that holds values of ``fmt``: its own dtype, or fp32 for emulated ones."""
    return fmt.torch_dtype or torch.float32


def cast(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round ``x`` to ``fmt`` and return it in ``fmt``'s storage dtype (no copy if already there)."""
    dt = fmt.torch_dtype
    if dt is not None:
        return x if x.dtype == dt else x.to(dt)
    if x.dtype != torch.float32:
        x = x.to(torch.float32)
    return emulate(x, fmt)


def matmul(a: torch.Tensor, b: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """a @ b with a wide (fp32, or fp64 for fp64) accumulator and the result stored in ``fmt``.

    When both operands already have ``fmt``'s own dtype the native matmul is used (bf16 gemm
    accumulates in fp32 and rounds once; ``bf16_gemm.matmul``: torch's bits, faster where torch's
    own bf16 kernel is ATen's scalar one). Otherwise the operands - whose values are exact in
    fp32 - are multiplied in fp32 and the result rounded to ``fmt``.
    """
    conv = matmul_conversion(a.dtype, b.dtype, fmt)
    if conv is None:
        return bf16_gemm.matmul(a, b)
    return cast(a.to(conv) @ b.to(conv), fmt)


def accumulation_dtype(fmt: FloatFormat) -> torch.dtype:
    """The wide dtype a product stored in ``fmt`` is accumulated in: fp64 for fp64, else fp32."""
    return torch.float64 if fmt.torch_dtype == torch.float64 else torch.float32


def matmul_conversion(a_dtype: torch.dtype, b_dtype: torch.dtype, fmt: FloatFormat) -> "torch.dtype | None":
    """The rule of ``matmul``: None when both operands have ``fmt``'s own dtype (the native matmul),
    else the dtype both are converted to before they are multiplied (``accumulation_dtype``)."""
    dt = fmt.torch_dtype
    if dt is not None and a_dtype == dt and b_dtype == dt:
        return None
    return accumulation_dtype(fmt)


def rowsum(x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Sum over the last dim (kept), accumulated as torch does for ``fmt``'s dtype, stored in ``fmt``."""
    dt = storage_dtype(fmt)
    if x.dtype != dt:
        x = x.to(torch.promote_types(x.dtype, dt))
    return cast(x.sum(dim=-1, keepdim=True), fmt)
