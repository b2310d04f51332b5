"""flashguard's PyTorch flash attention as torch custom operators, so that torch.compile can
capture a model that calls it (``torch.compile(model, fullgraph=True)``).

``flashguard::flash_attention_fwd`` and ``flashguard::flash_attention_bwd`` run
``options.run_forward`` / ``options.run_backward``, as the eager autograd Function does; ``register_fake`` gives the compiler their
output shapes and dtypes without running them, and ``register_autograd`` connects the backward
op. To the compiler they are opaque: the tiles, the Python loop over them and every rounding
step run exactly as in eager mode, so compiled and eager results are bit-identical.
``flash_attention`` calls them only while torch.compile traces (eager mode runs the same
functions through an autograd.Function, without the operators' dispatch cost); they can be
called directly, eagerly, too (``flash_attention_op``; tests/attention/test_compile.py).

An operator takes tensors, numbers and strings only, so the options travel as text and
numbers (the tiles, the soft-cap), made a FlashOptions again (and cached) inside the op: the
policy as its ``short_str()`` (``"fa2"``, ``"paper[pv=fp32]"``) and the stabilizer as its
option string (``"paper:beta=7.0,tol=0.001"``), both parsed back (and cached) inside the op.
A policy or stabilizer that text cannot reproduce exactly (a user-defined Stabilizer class, a
policy named outside the presets) is kept in a process-local table under a ``#<n>`` key
instead; such a compiled graph then only runs in the process that built it.

What the backward needs beyond its inputs comes back as extra forward outputs: O in the
policy's output storage (when it differs from the returned dtype), the lse, the high-precision
O (``delta_source="o_highp"``) and q, k, v rounded to the input format (when rounding changed
them: they are not recomputed in backward because stochastic rounding would draw new random
bits). Unneeded ones are empty tensors, as an operator's outputs cannot be None.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools

import torch

from ..numerics.arith import storage_dtype
from ..numerics.policy import POLICIES, PrecisionPolicy, get_policy
from .dropout import TileDropout
from .options import (DEFAULT_PRECISION, DEFAULT_STABILIZER, FlashOptions, Forward, highp_dtype, run_backward,
                      run_forward)
from .stabilizers import NoStabilizer, PaperStabilizer, SafeStabilizer, Stabilizer, get_stabilizer

__all__ = ["encode_policy", "encode_stabilizer", "decode_policy", "decode_stabilizer", "flash_attention_op"]

_TABLE: dict[str, object] = {}
_COUNTER = itertools.count()


def _register(obj) -> str:
    for key, known in _TABLE.items():
        if type(known) is type(obj) and known == obj:
            return key
    key = f"#{next(_COUNTER)}"
    _TABLE[key] = obj
    return key


def encode_policy(policy: PrecisionPolicy) -> str:
    """A string the op turns back into ``policy`` (equal in every field, the name aside:
    the name changes no arithmetic)."""
    if policy.name in POLICIES and POLICIES[policy.name] == policy:
        return policy.name
    text = policy.short_str()
    try:
        back = get_policy(text)
    except ValueError:
        back = None
    if back is not None and dataclasses.replace(back, name=policy.name) == policy:
        return text
    return _register(policy)


def encode_stabilizer(stab: Stabilizer) -> str:
    if type(stab) is NoStabilizer:
        return "none"
    if type(stab) is SafeStabilizer:
        return "safe"
    if type(stab) is PaperStabilizer:
        return f"paper:beta={stab.beta!r},tol={stab.tol!r}"  # repr: floats round-trip exactly
    return _register(stab)


@functools.lru_cache(maxsize=256)
def decode_policy(text: str) -> PrecisionPolicy:
    if text.startswith("#"):
        return _TABLE[text]
    return get_policy(text)


@functools.lru_cache(maxsize=256)
def decode_stabilizer(text: str) -> Stabilizer:
    if text.startswith("#"):
        return _TABLE[text]
    return get_stabilizer(text)


def _rounded_dtype(t: torch.Tensor, policy: PrecisionPolicy):
    """The dtype q / k / v are rounded to for the kernel, or None when rounding leaves them as
    they are (a native input format equal to their dtype: ``cast`` returns the tensor itself)."""
    fmt = policy.inputs
    if fmt.torch_dtype is not None and t.dtype == fmt.torch_dtype:
        return None
    return storage_dtype(fmt)


@functools.lru_cache(maxsize=256)
def _options(precision: str, stabilizer: str, block_q: int, block_k: int, softcap: float | None) -> FlashOptions:
    """The FlashOptions an operator's arguments encode (the PyTorch kernel's)."""
    return FlashOptions(precision=decode_policy(precision), stabilizer=decode_stabilizer(stabilizer),
                        block_q=block_q, block_k=block_k, kernel="pytorch", softcap=softcap)


def _empty(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((0,))


def _dropout(seed, dropout_p, q):
    if not dropout_p:
        return None
    B, H, Tq, _ = q.shape
    return TileDropout(seed, dropout_p, B, H, Tq, q.device)


@torch.library.custom_op("flashguard::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None,
                        bias: torch.Tensor | None, seed: torch.Tensor | None, causal: bool, scale: float,
                        precision: str, stabilizer: str, block_q: int, block_k: int, softcap: float | None,
                        dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                   torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out in q's dtype, O in output storage or empty, lse, O high-precision or empty,
    q, k, v rounded to the input format or empty). ``seed``: (2,) int64 words, None without dropout."""
    options = _options(precision, stabilizer, block_q, block_k, softcap)
    qc, kc, vc, _, o, lse, o_hp = run_forward(q, k, v, options, keep=keep, bias=bias, causal=causal, scale=scale,
                                              dropout=_dropout(seed, dropout_p, q))
    out = o.to(q.dtype)
    # an op's outputs may not alias each other or its inputs: each extra output is either a
    # fresh tensor or empty (the backward then takes out, or the input itself)
    return (out, _empty(q) if out is o else o, lse, _empty(q) if o_hp is None else o_hp,
            *(_empty(q) if c is t else _like_input(c, t) for c, t in ((qc, q), (kc, k), (vc, v))))


def _like_input(c: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The rounded input with the strides the fake implementation promises, empty_like(t)'s.
    Rounding is elementwise and keeps t's layout, so this copies nothing in practice; the copy
    is there so that a layout torch chose differently cannot break the compiled graph."""
    want = torch.empty_like(t, dtype=c.dtype)
    if c.stride() == want.stride():
        return c
    return want.copy_(c)


@flash_attention_fwd.register_fake
def _(q, k, v, keep, bias, seed, causal, scale, precision, stabilizer, block_q, block_k, softcap, dropout_p):
    policy = decode_policy(precision)
    B, H, Tq, _ = q.shape
    Dv = v.shape[-1]
    o_dt, lse_dt = storage_dtype(policy.output), storage_dtype(policy.lse)
    out = q.new_empty((B, H, Tq, Dv))
    o = _empty(q) if o_dt == q.dtype else q.new_empty((B, H, Tq, Dv), dtype=o_dt)
    lse = q.new_empty((B, H, Tq, 1), dtype=lse_dt)
    o_hp = q.new_empty((B, H, Tq, Dv), dtype=highp_dtype(policy)) if policy.delta_source == "o_highp" else _empty(q)
    rounded = []
    for t in (q, k, v):
        dt = _rounded_dtype(t, policy)
        rounded.append(_empty(q) if dt is None else torch.empty_like(t, dtype=dt))
    return (out, o, lse, o_hp, *rounded)


@torch.library.custom_op("flashguard::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        o: torch.Tensor, lse: torch.Tensor, o_hp: torch.Tensor, qc: torch.Tensor, kc: torch.Tensor,
                        vc: torch.Tensor, keep: torch.Tensor | None, bias: torch.Tensor | None,
                        seed: torch.Tensor | None, causal: bool, scale: float, precision: str, block_q: int,
                        block_k: int, softcap: float | None,
                        dropout_p: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in q's, k's and v's dtypes from the forward op's inputs and outputs."""
    options = _options(precision, "none", block_q, block_k, softcap)  # the backward has no stabilizer
    policy = options.precision
    o = out if storage_dtype(policy.output) == out.dtype else o
    qc, kc, vc = (t if _rounded_dtype(t, policy) is None else c for c, t in ((qc, q), (kc, k), (vc, v)))
    return run_backward(Forward(qc, kc, vc, None, o, lse, o_hp), do, options, keep=keep, bias=bias, causal=causal,
                        scale=scale, dropout=_dropout(seed, dropout_p, q), dtypes=(q.dtype, k.dtype, v.dtype))


@flash_attention_bwd.register_fake
def _(do, q, k, v, out, o, lse, o_hp, qc, kc, vc, keep, bias, seed, causal, scale, precision, block_q, block_k,
      softcap, dropout_p):
    # contiguous, as flash_backward's torch.cat makes them (not empty_like: q may be a transposed view)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, keep, bias, seed, causal, scale, precision, _stab, block_q, block_k, softcap, dropout_p = inputs
    out, o, lse, o_hp, qc, kc, vc = output
    ctx.save_for_backward(q, k, v, out, o, lse, o_hp, qc, kc, vc, keep, bias, seed)
    ctx.options = (causal, scale, precision, block_q, block_k, softcap, dropout_p)


def _backward(ctx, d_out, *_unused):
    q, k, v, out, o, lse, o_hp, qc, kc, vc, keep, bias, seed = ctx.saved_tensors
    if d_out is None:
        d_out = torch.zeros_like(out)
    dq, dk, dv = flash_attention_bwd(d_out, q, k, v, out, o, lse, o_hp, qc, kc, vc, keep, bias, seed,
                                     *ctx.options)
    return (dq, dk, dv) + (None,) * 11


flash_attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash_attention_op(q, k, v, *, keep=None, bias=None, seed=None, causal: bool = False, scale: float,
                       precision: "str | PrecisionPolicy" = DEFAULT_PRECISION,
                       stabilizer: "str | Stabilizer" = DEFAULT_STABILIZER,
                       block_q: int, block_k: int, softcap: float | None = None,
                       dropout_p: float = 0.0) -> torch.Tensor:
    """The output of the forward op, differentiable in q, k and v (the other outputs serve the
    backward op only). ``precision`` / ``stabilizer``: the encoded strings (``encode_policy``,
    ``encode_stabilizer``) or objects, encoded here. No argument checking: flash_attention's."""
    if not isinstance(precision, str):
        precision = encode_policy(precision)
    if not isinstance(stabilizer, str):
        stabilizer = encode_stabilizer(stabilizer)
    return flash_attention_fwd(q, k, v, keep, bias, seed, causal, scale, precision, stabilizer, block_q, block_k,
                               softcap, dropout_p)[0]
