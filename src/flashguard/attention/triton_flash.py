"""Fused flash attention in Triton, with flashguard's stabilizers (the GPU fast path).

``triton_flash_attention(q, k, v, *, is_causal, scale, stabilizer)`` computes what
``flash_attention(..., precision="fa2")`` computes, in four Triton kernels (forward; backward
delta preprocess, dK/dV, dQ; see ``_triton_kernels``) instead of a Python loop over tiles:
inputs in bf16 / fp16 / fp32, fp32 scores, statistics and accumulators, Pbar and dS rounded to
the input format as matmul operands, O rounded once, gradients accumulated in fp32. The
stabilizers ``none``, ``paper(beta, tol)`` and ``safe`` choose the softmax shift per key tile
exactly as ``flashguard.attention.stabilizers`` defines them (``safe``'s dither counts rows
within a query tile of the forward's ``block_m``, as the PyTorch path's does with ``block_q``).

Attention dropout (``dropout_p``) uses the mask of ``flashguard.attention.dropout``: the same
seed gives the same keep bits as the PyTorch path.

Not supported (raise NotImplementedError naming the feature): ``attn_mask``, ``softcap``,
precision policies other than the ``fa2`` structure (``fa2``, ``fa2-fp16``, ``fp32``, or a
policy with the same layout), Stabilizer classes other than the three, head dims over 128.

Triton is optional: this module imports without it; ``triton_available()`` says whether it can
be used, without importing it. The kernels run on CUDA tensors, or on CPU tensors in Triton's
interpreter (slow, for tests), which needs ``TRITON_INTERPRET=1`` set before triton is first
imported: Triton reads it then, and its own library functions (tl.sum, tl.max) are built for
one mode or the other at that point.
"""
from __future__ import annotations

import functools
import importlib.util
import math
import numbers
import os
import sys

import torch

from ..numerics.policy import PrecisionPolicy, get_policy
from .dropout import check_dropout_p, draw_seed, keep_scale, threshold
from .options import DEFAULT_PRECISION, DEFAULT_STABILIZER
from .stabilizers import (SAFE_DELTA_MIN, SAFE_DELTA_SPAN, NoStabilizer, PaperStabilizer, SafeStabilizer,
                          Stabilizer, get_stabilizer)

__all__ = ["triton_available", "triton_flash_attention", "triton_unsupported", "triton_unsupported_settings",
           "triton_device_problem", "triton_forward", "forward_tiles", "fa2_structured", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 128
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0   # as stabilizers._dither
_STAB_CODES = {NoStabilizer: 0, PaperStabilizer: 1, SafeStabilizer: 2}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_FP32_FIELDS = ("scores", "stats", "pv", "o_accum", "lse", "p", "dp", "delta_product", "delta",
                "grad_partial", "grad_accum")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when the ``triton`` package is installed (a CUDA device is a separate question).

    Looked up without importing it: Triton reads TRITON_INTERPRET when it is imported, so
    importing it here would fix the mode before a user (or the tests) could choose the CPU
    interpreter. It is imported when the kernels are first used."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _kernels():
    """The kernels module, imported on first use (so that flashguard imports without triton)."""
    if not triton_available():
        raise ImportError("the triton kernel needs the 'triton' package (pip install triton)")
    from . import _triton_kernels
    return _triton_kernels


def interpreted() -> bool:
    """Whether the kernels run (or, not loaded yet, will run) in Triton's CPU interpreter."""
    mod = sys.modules.get(__package__ + "._triton_kernels")
    if mod is not None:
        return mod.INTERPRETED
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def fa2_structured(policy: PrecisionPolicy) -> str | None:
    """None if the Triton kernels implement ``policy`` exactly, else what differs."""
    policy = get_policy(policy)
    inputs = policy.inputs.torch_dtype
    if inputs not in _DTYPES.values():
        return f"inputs format {policy.inputs.name} (the triton kernel takes bf16, fp16 or fp32 inputs)"
    wrong = [f"{f}={getattr(policy, f).name}" for f in _FP32_FIELDS
             if getattr(policy, f).torch_dtype != torch.float32]
    wrong += [f"{f}={getattr(policy, f).name}" for f in ("pbar", "ds", "output")
              if getattr(policy, f).torch_dtype != inputs]
    if policy.row_sum_floor is not None:
        wrong.append(f"row_sum_floor={policy.row_sum_floor}")
    if policy.pbar_scale:
        wrong.append(f"pbar_scale={policy.pbar_scale}")
    if policy.visit_masked_tiles:
        wrong.append("visit_masked_tiles=True")
    if policy.masked_scores != "inf":
        wrong.append(f"masked_scores={policy.masked_scores}")
    if policy.delta_source != "o_lowp":
        wrong.append(f"delta_source={policy.delta_source}")
    # the kernels' own steps: exact exp, O = acc / l, the scale on dS's operand (a model of another
    # kernel's exp, reciprocal or scale order runs on the PyTorch kernel, never silently dropped)
    for field, plain in (("exp", "exact"), ("normalize", "divide"), ("ds_scale", "operand")):
        value = getattr(policy, field, plain)
        if value != plain:
            wrong.append(f"{field}={value}")
    if wrong:
        return (f"precision policy {policy.name!r} is not fa2-structured ({', '.join(wrong)}); the triton kernel "
                f"implements fp32 scores/statistics/accumulators with Pbar, dS and O in the input format")
    return None


def _block(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 16 <= value <= 128 \
            or value & (value - 1):
        raise ValueError(f"triton kernel: {name} must be a power of two in [16, 128], got {value!r}")
    return int(value)


def triton_unsupported_settings(*, precision=DEFAULT_PRECISION, stabilizer=DEFAULT_STABILIZER, block_q=None, block_k=None, attn_mask=None,
                                softcap=None, dropout_p=0.0) -> str | None:
    """Why the triton kernel cannot run these settings, whatever the tensors (None when it can):
    masks, soft-capping, a policy that is not fa2-structured, a stabilizer it lacks, tiles that are
    not powers of two in [16, 128]. A model layer checks its AttentionSpec with it."""
    if attn_mask is not None:
        return "attn_mask (the triton kernel supports is_causal only)"
    if softcap is not None:
        return "softcap (not implemented in the triton kernel)"
    reason = fa2_structured(get_policy(precision))
    if reason:
        return reason
    stab = get_stabilizer(stabilizer)
    if type(stab) not in _STAB_CODES:
        return f"stabilizer {type(stab).__name__} (the triton kernel has none, paper and safe)"
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                                  or not 16 <= value <= 128 or value & (value - 1)):
            return f"{name}={value!r} (triton tiles are powers of two in [16, 128])"
    return None


def triton_device_problem(device) -> str | None:
    """Why the triton kernels cannot run on ``device`` (a torch.device or its type; None when they can):
    triton not installed, or not CUDA and not Triton's CPU interpreter."""
    if not triton_available():
        return "triton is not installed"
    kind = device if isinstance(device, str) else device.type
    if kind != "cuda" and not interpreted():
        return (f"tensors on {kind} (the triton kernels need CUDA tensors, or Triton's CPU interpreter: "
                "TRITON_INTERPRET=1 set before triton is first imported)")
    return None


def triton_unsupported(q, k, v, *, attn_mask=None, softcap=None, precision=DEFAULT_PRECISION,
                       stabilizer=DEFAULT_STABILIZER, block_q=None, block_k=None, need_device=True,
                       dropout_p=0.0) -> str | None:
    """Why the triton kernel cannot run this call (None when it can). ``need_device``: also
    require CUDA tensors (or the interpreter) and an importable triton."""
    reason = triton_unsupported_settings(precision=precision, stabilizer=stabilizer, block_q=block_q,
                                         block_k=block_k, attn_mask=attn_mask, softcap=softcap,
                                         dropout_p=dropout_p)
    if reason:
        return reason
    if 0 in (*q.shape, *k.shape, *v.shape):
        return f"empty tensors (q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})"
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        return f"head dim {max(q.shape[-1], v.shape[-1])} (the triton kernel supports head dims up to {MAX_HEAD_DIM})"
    if need_device:
        return triton_device_problem(q.device)
    return None


# ---------------------------------------------------------------------------------------------
# tile configurations (GPU); under the interpreter larger tiles mean fewer Python-level steps

# The GPU choices were checked by compiling for sm_90 (tools/triton_compile_check.py): Hopper
# matrix instructions, no register spills, shared memory in bounds. fp32 inputs take IEEE fp32
# dots, which run on the FMA units and spill at the bf16 tiles: smaller tiles, and still slow.

def _fwd_config(d_pad, interp, dtype=torch.bfloat16):
    if interp:
        return 32, 32, 1, 1
    if dtype == torch.float32:
        return 32, 64, 4, 2
    return 128, 64, (4 if d_pad <= 64 else 8), 3        # BLOCK_M, BLOCK_N, num_warps, num_stages


def _bwd_config(d_pad, interp, dtype=torch.bfloat16):
    if interp:
        return (32, 32), (32, 32), 1, 1
    if dtype == torch.float32:
        return (32, 32), (32, 32), 4, 2
    # (dK/dV kernel: BLOCK_M, BLOCK_N), (dQ kernel: BLOCK_M, BLOCK_N), num_warps, num_stages
    return (32, 128), (128, 32), (4 if d_pad <= 64 else 8), (4 if d_pad <= 64 else 3)


_STAGES: dict = {}  # (kernel, tile constexprs) -> the num_stages that fit (see _launch)


def _launch(kernel, grid, args, num_warps, num_stages, **constexprs):
    """kernel[grid](*args, **constexprs) with the given warps and pipelining depth; if the
    compiled kernel needs more shared memory than the GPU has, retry with fewer stages (the
    depth changes no result, unlike the tiles) and remember what fit."""
    key = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), num_warps,
           tuple(sorted((k, str(v)) for k, v in constexprs.items())), str(args[0].dtype))
    stages = _STAGES.get(key, num_stages)
    while True:
        try:
            kernel[grid](*args, num_warps=num_warps, num_stages=stages, **constexprs)
            _STAGES[key] = stages
            return
        except Exception as e:  # triton.runtime.errors.OutOfResources, without importing triton here
            if type(e).__name__ != "OutOfResources" or stages <= 1:
                raise
            stages -= 1


def forward_tiles(head_dim: int, dtype: torch.dtype, block_m: int | None = None,
                  block_n: int | None = None) -> tuple[int, int]:
    """The forward kernel's tiles (BLOCK_M, BLOCK_N) for operands of this head dim (the larger of
    q's and v's) and dtype: ``block_m`` / ``block_n`` where given, else the kernel's defaults (the
    ones triton_forward picks; they differ under the interpreter)."""
    bm, bn, _, _ = _fwd_config(_pad(head_dim), interpreted(), dtype)
    return block_m or bm, block_n or bn


def _pad(d):
    return max(16, triton_next_pow2(d))


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _f32_dot(dtype, interp):
    return dtype == torch.float32 or (interp and dtype == torch.bfloat16)


def _dropout_args(dropout_p, seed, like):
    """(SEED tensor on the device, threshold, 1 / (1 - p), DROPOUT) for the kernels."""
    if not dropout_p:
        return like, 0, 1.0, False  # SEED is not read: any pointer does
    return seed.to(device=like.device, dtype=torch.int64), threshold(dropout_p), keep_scale(dropout_p), True


def triton_forward(q, k, v, *, causal: bool, scale: float, stabilizer: Stabilizer, row_sum_rounded: bool = False,
                   block_m: int | None = None, block_n: int | None = None, return_m: bool = False,
                   dropout_p: float = 0.0, seed: torch.Tensor | None = None):
    """The forward kernel on (B, H, T, D) tensors of one dtype: returns (o, lse) with o in the
    input dtype and lse (B, H, T_q) fp32, plus the final running shift m (B, H, T_q) fp32 if
    ``return_m`` (tests read which shift a stabilizer chose through it). ``dropout_p`` > 0 with
    ``seed`` (the (2,) int64 words of attention.dropout.draw_seed): attention dropout."""
    kern = _kernels()
    interp = kern.INTERPRETED
    B, H, Tq, D = q.shape
    Tk, Dv = k.shape[-2], v.shape[-1]
    d_pad, dv_pad = _pad(D), _pad(Dv)
    bm, bn, warps, stages = _fwd_config(max(d_pad, dv_pad), interp, q.dtype)
    bm, bn = block_m or bm, block_n or bn
    o = torch.empty((B, H, Tq, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    m = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device) if return_m else lse
    consts = torch.tensor([SAFE_DELTA_MIN, SAFE_DELTA_SPAN, _GOLDEN], dtype=torch.float64, device=q.device)
    code = _STAB_CODES[type(stabilizer)]
    beta = float(getattr(stabilizer, "beta", 2.0))
    tol = float(getattr(stabilizer, "tol", 0.0))
    grid = (triton_cdiv(Tq, bm), B * H)
    seed_t, thr, rp, dropout = _dropout_args(dropout_p, seed, consts)
    _launch(kern._fwd_kernel, grid,
            (q, k, v, o, lse, m, consts, seed_t, *q.stride(), *k.stride(), *v.stride(), *o.stride(),
             H, Tq, Tk, D, Dv, float(scale), beta, tol, thr, rp), warps, stages,
            CAUSAL=bool(causal), STAB=code, ROW_SUM_ROUNDED=bool(row_sum_rounded), STORE_M=bool(return_m),
            DROPOUT=dropout,
            F32_DOT=_f32_dot(q.dtype, interp), BF16_RNE=interp and q.dtype == torch.bfloat16,
            BLOCK_M=bm, BLOCK_N=bn, D_PAD=d_pad, DV_PAD=dv_pad)
    if return_m:
        return o, lse, m
    return o, lse


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def triton_backward(q, k, v, o, lse, do, *, causal: bool, scale: float, dropout_p: float = 0.0,
                    seed: torch.Tensor | None = None):
    """dq, dk, dv in fp32 from the saved forward; ``do`` in the input dtype; the forward's
    ``dropout_p`` and ``seed``."""
    kern = _kernels()
    interp = kern.INTERPRETED
    B, H, Tq, D = q.shape
    Tk, Dv = k.shape[-2], v.shape[-1]
    d_pad, dv_pad = _pad(D), _pad(Dv)
    (bm1, bn1), (bm2, bn2), warps, stages = _bwd_config(max(d_pad, dv_pad), interp, q.dtype)
    delta = torch.empty((B, H, Tq), dtype=torch.float32, device=q.device)
    dq = torch.empty((B, H, Tq, D), dtype=torch.float32, device=q.device)
    dk = torch.empty((B, H, Tk, D), dtype=torch.float32, device=q.device)
    dv = torch.empty((B, H, Tk, Dv), dtype=torch.float32, device=q.device)
    f32 = _f32_dot(q.dtype, interp)
    rne = interp and q.dtype == torch.bfloat16
    bmd = 32 if interp else 64
    kern._bwd_delta_kernel[(triton_cdiv(Tq, bmd), B * H)](
        o, do, delta, *o.stride(), *do.stride(), H, Tq, Dv, BLOCK_M=bmd, DV_PAD=dv_pad)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    seed_t, thr, rp, dropout = _dropout_args(dropout_p, seed, delta)
    _launch(kern._bwd_dkdv_kernel, (triton_cdiv(Tk, bn1), B * H),
            (q, k, v, do, lse, delta, dk, dv, seed_t, *strides, *dk.stride(), *dv.stride(), H, Tq, Tk, D, Dv,
             float(scale), thr, rp),
            warps, stages, CAUSAL=bool(causal), F32_DOT=f32, BF16_RNE=rne, DROPOUT=dropout,
            BLOCK_M=bm1, BLOCK_N=bn1, D_PAD=d_pad, DV_PAD=dv_pad)
    _launch(kern._bwd_dq_kernel, (triton_cdiv(Tq, bm2), B * H),
            (q, k, v, do, lse, delta, dq, seed_t, *strides, *dq.stride(), H, Tq, Tk, D, Dv, float(scale), thr, rp),
            warps, stages, CAUSAL=bool(causal), F32_DOT=f32, BF16_RNE=rne, DROPOUT=dropout,
            BLOCK_M=bm2, BLOCK_N=bn2, D_PAD=d_pad, DV_PAD=dv_pad)
    return dq, dk, dv


def _operand(t, dtype):
    """t in the kernels' input dtype; any strides do, but a unit stride along the head dim
    keeps the loads coalesced (the (B, T, H, D).transpose(1, 2) layout of a GPT has it)."""
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


class _TritonFlashFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, stabilizer, dtype, row_sum_rounded, block_m, block_n, dropout_p, seed):
        qc, kc, vc = (_operand(t.detach(), dtype) for t in (q, k, v))
        o, lse = triton_forward(qc, kc, vc, causal=causal, scale=scale, stabilizer=stabilizer,
                                row_sum_rounded=row_sum_rounded, block_m=block_m, block_n=block_n,
                                dropout_p=dropout_p, seed=seed)
        ctx.save_for_backward(qc, kc, vc, o, lse, seed)
        ctx.meta = (causal, scale, dtype, q.dtype, k.dtype, v.dtype, dropout_p)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        qc, kc, vc, o, lse, seed = ctx.saved_tensors
        causal, scale, dtype, qdt, kdt, vdt, dropout_p = ctx.meta
        dq, dk, dv = triton_backward(qc, kc, vc, o, lse, _operand(do, dtype), causal=causal, scale=scale,
                                     dropout_p=dropout_p, seed=seed)
        return (dq.to(qdt), dk.to(kdt), dv.to(vdt)) + (None,) * 9


def triton_flash_attention(q, k, v, *, is_causal: bool = False, scale: float | None = None,
                           stabilizer: "str | Stabilizer" = "none", precision: "str | PrecisionPolicy | None" = None,
                           attn_mask=None, softcap=None, block_m: int | None = None,
                           block_n: int | None = None, dropout_p: float = 0.0,
                           dropout_seed: torch.Tensor | None = None) -> torch.Tensor:
    """Flash attention of (B, H, T_q, D), (B, H, T_k, D), (B, H, T_k, D_v) tensors in Triton.

    ``precision``: None = the fa2 arithmetic in q's dtype (bf16, fp16 or fp32); or an
    fa2-structured policy (``fa2``, ``fa2-fp16``, ``fp32``), whose input format q, k, v are
    rounded to first (as ``flash_attention`` does); the output has q's dtype and the gradients
    each input's dtype. ``block_m`` / ``block_n``: the forward's tiles (powers of two in
    [16, 128]; None = the defaults). ``attn_mask`` and ``softcap`` are not supported.
    ``dropout_p``: attention dropout with the PyTorch path's mask (same seed, same bits);
    ``dropout_seed`` the (2,) int64 words (None: drawn from torch's default generator).
    """
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or not t.is_floating_point():
            raise ValueError(f"{name} must be a 4-D floating tensor (batch, heads, seq_len, head_dim)")
    if attn_mask is not None:
        raise NotImplementedError("triton kernel: attn_mask is not supported (use is_causal, or kernel='pytorch')")
    if softcap is not None:
        raise NotImplementedError("triton kernel: softcap is not supported (use kernel='pytorch')")
    if precision is None:
        names = {v_: k_ for k_, v_ in _DTYPES.items()}
        if q.dtype not in names:
            raise NotImplementedError(f"triton kernel: {q.dtype} inputs (bf16, fp16 or fp32 only)")
        precision = "fp32" if q.dtype == torch.float32 else ("fa2" if q.dtype == torch.bfloat16 else "fa2-fp16")
    policy = get_policy(precision)
    stab = get_stabilizer(stabilizer)
    reason = triton_unsupported(q, k, v, precision=policy, stabilizer=stab, block_q=_block("block_m (block_q)", block_m),
                                block_k=_block("block_n (block_k)", block_n))
    if reason:
        if reason.startswith("triton is not installed"):
            raise ImportError("triton kernel: " + reason)
        raise NotImplementedError("triton kernel: " + reason)
    if q.shape[:2] != k.shape[:2] or k.shape[:2] != v.shape[:2] or q.shape[-1] != k.shape[-1] \
            or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    dropout_p = check_dropout_p(dropout_p)
    if dropout_p and dropout_seed is None:
        dropout_seed = draw_seed()
    return _TritonFlashFn.apply(q, k, v, bool(is_causal), float(scale), stab, policy.inputs.torch_dtype,
                                policy.row_sum_rounded, block_m, block_n, dropout_p,
                                dropout_seed if dropout_p else None)
