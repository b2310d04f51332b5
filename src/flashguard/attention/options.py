"""Flash options: how flashguard's flash attention runs, defined once, and the one run of them.

``FlashOptions`` is what every entry point takes or holds - ``flash_attention``,
``scaled_dot_product_attention``, ``override_sdpa``, ``integrations.hf.register``,
``flashguard.watch``, a model layer's ``AttentionSpec`` and ``trace``'s ``Arithmetic``:

    precision   a PrecisionPolicy or a preset name (``fa2``, ``paper``, ``paper[pv=fp32]``, ...)
    stabilizer  a Stabilizer or its name (``none``, ``paper``, ``paper:beta=7``; ``safe``: retired,
                measured not a fix, kept to reproduce that measurement)
    block_q     query / key tile edges; None = the kernel's default (DEFAULT_BLOCK on the
    block_k     PyTorch kernel, the Triton kernels' own)
    kernel      ``auto`` | ``pytorch`` | ``triton`` (KERNELS; function.choose_kernel resolves auto)
    softcap     attention-logit soft-capping, scores -> softcap * tanh(scores / softcap); None = off

The defaults are written here only, and so is every check: a bad value raises ``OptionError``
(a ValueError) naming the option. ``precision`` and ``stabilizer`` are resolved once, when the
options are made, so ``options.precision`` is a PrecisionPolicy and ``options.stabilizer`` a
Stabilizer; a call that holds options resolves nothing again. Dropout is not an option: like
``is_causal`` and ``scale`` it is an argument of each call (``dropout_p``, as SDPA's), since a
model switches it between training and evaluation with the same options.

``run_forward`` / ``run_backward`` run options on tensors: autocast off, the policy's rounding
mode, q, k, v (and dO) cast to the input format, then ``flash.flash_forward`` (keeping the
high-precision O where the policy's delta takes it) or ``flash.flash_backward``. The eager
autograd Function and the torch custom operators (``function``, ``ops``), the measurement
(``trace``) and the census (``diagnostics.census``) all run through them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import numbers
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..numerics.arith import cast, rounding, storage_dtype
from ..numerics.policy import PrecisionPolicy, get_policy
from .dropout import TileDropout
from .flash import flash_backward, flash_forward
from .stabilizers import Stabilizer, get_stabilizer

__all__ = ["FlashOptions", "OptionError", "RetiredStabilizerWarning", "flash_options", "KERNELS", "DEFAULT_PRECISION", "DEFAULT_STABILIZER",
           "DEFAULT_BLOCK", "DEFAULT_KERNEL", "split_mask", "highp_dtype", "arithmetic_context", "cast_inputs",
           "run_forward", "run_backward", "Forward"]

DEFAULT_PRECISION = "fa2"
DEFAULT_STABILIZER = "none"
# Tile edge of the PyTorch kernel when block_q / block_k are not given: the study's reference
# code uses 512, and on CPU large tiles keep the Python loop short. Production GPU kernels use 64-128.
DEFAULT_BLOCK = 512
DEFAULT_KERNEL = "auto"
# The kernel, which implementation runs the arithmetic: "pytorch" (the tiled PyTorch FA2 of .flash:
# any policy, any device, every intermediate rounded as the policy says), "triton" (fused kernels of
# .triton_flash: fa2-structured policies, no masks or soft-capping), or "auto": triton when q is on
# CUDA, triton imports and the call is one the kernels support, else pytorch.
KERNELS = ("auto", "pytorch", "triton")


class OptionError(ValueError):
    """A bad FlashOptions value; ``field`` names the option, ``problem`` says what is wrong with it."""

    def __init__(self, field_name: str, problem: str):
        sep = " " if problem.startswith("must") else ": "
        super().__init__(f"{field_name}{sep}{problem}")
        self.field, self.problem = field_name, problem


def _block_problem(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        return f"must be None or an integer >= 1 (None: the kernel's default tile), got {value!r}"
    return None


class RetiredStabilizerWarning(UserWarning):
    """A retired stabilizer in use where it was measured to do harm."""


# docs/lab/lab.md, measured on independent rows: in production arithmetic (the row sum from the
# unrounded Pbar) moving the dominant Pbar off 1 adds a lean and costs accuracy
SAFE_IN_PRODUCTION = ("stabilizer 'safe' is retired: measured on independent rows it is not a fix, and with a row "
                      "sum from the unrounded Pbar (fa2, fa2-fp16, torch-cpu, fp8) it adds a lean (fa2: pooled z -5.6) "
                      "and makes O up to 9.5x less accurate; use stabilizer 'none' (for the reference arithmetic: "
                      "precision 'paper-fp32fwd')")


@dataclass(frozen=True, repr=False)
class FlashOptions:
    """How flash attention runs (module docstring). Frozen; ``replace`` makes a changed copy."""

    precision: PrecisionPolicy = DEFAULT_PRECISION  # type: ignore[assignment]  (a name is resolved)
    stabilizer: Stabilizer = DEFAULT_STABILIZER  # type: ignore[assignment]
    block_q: int | None = None
    block_k: int | None = None
    kernel: str = DEFAULT_KERNEL
    softcap: float | None = None

    def __post_init__(self):
        # frozen: the one sanctioned way to normalise a field is object.__setattr__ in __post_init__
        for name, resolve, kind in (("precision", get_policy, PrecisionPolicy),
                                    ("stabilizer", get_stabilizer, Stabilizer)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                try:
                    object.__setattr__(self, name, resolve(value))
                except (ValueError, TypeError) as e:
                    raise OptionError(name, str(e)) from None
        if self.stabilizer.name == "safe" and not self.precision.row_sum_rounded:
            warnings.warn(SAFE_IN_PRODUCTION, RetiredStabilizerWarning, stacklevel=3)
        for name in ("block_q", "block_k"):
            problem = _block_problem(getattr(self, name))
            if problem:
                raise OptionError(name, problem)
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        if self.kernel not in KERNELS:
            raise OptionError("kernel", f"unknown kernel {self.kernel!r}; known: {', '.join(KERNELS)}")
        cap = self.softcap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0:
                raise OptionError("softcap", f"must be a positive float or None, got {cap!r}")
            object.__setattr__(self, "softcap", float(cap))

    def __repr__(self) -> str:
        """The precision as its ``short_str()``, the stabilizer as its ``str()``, then the options
        that differ from their defaults."""
        parts = [f"precision={self.precision.short_str()!r}", f"stabilizer={str(self.stabilizer)!r}"]
        parts += [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)[2:]
                  if getattr(self, f.name) != f.default]
        return f"FlashOptions({', '.join(parts)})"

    def replace(self, **changes) -> "FlashOptions":
        """A copy with some options changed (checked as the constructor checks them)."""
        unknown = sorted(set(changes) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; FlashOptions has {', '.join(FIELDS)}")
        return dataclasses.replace(self, **changes) if changes else self

    def capped(self, softcap: float | None) -> "FlashOptions":
        """These options with ``softcap`` (a model's or a call's own; None: these options as they
        are). Cached: a model layer asks for the same capped options on every call."""
        return self if softcap is None or softcap == self.softcap else _capped(self, type(softcap), softcap)

    def tiles(self) -> tuple[int, int]:
        """(block_q, block_k) on the PyTorch kernel: an unset tile is DEFAULT_BLOCK."""
        return (DEFAULT_BLOCK if self.block_q is None else self.block_q,
                DEFAULT_BLOCK if self.block_k is None else self.block_k)


FIELDS = tuple(f.name for f in dataclasses.fields(FlashOptions))


# The caches key on each value's type too: 64.0 == 64 and True == 1, but only 64 is a tile.

@functools.lru_cache(maxsize=128)
def _capped(options: FlashOptions, kind: type, softcap: float) -> FlashOptions:
    return options.replace(softcap=softcap)


@functools.lru_cache(maxsize=256)
def _cached(items: tuple) -> FlashOptions:
    return FlashOptions(**{name: value for name, _, value in items})


def flash_options(options: "FlashOptions | None" = None, fields: "dict | None" = None, *,
                  where: str = "flash_attention()") -> FlashOptions:
    """The FlashOptions an entry point's arguments name: ``options`` (None: the defaults) with
    ``fields`` (its keyword arguments: precision, stabilizer, block_q, block_k, kernel, softcap)
    changed. TypeError naming ``where`` for a keyword that is not an option. Options built from
    names alone are cached, so a call that names its options by keyword does not parse them again."""
    if options is not None and not isinstance(options, FlashOptions):
        raise TypeError(f"{where}: options must be a FlashOptions or None, got {type(options).__name__}")
    fields = fields or {}
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise TypeError(f"{where} got unknown option(s) {unknown}; options are {', '.join(FIELDS)}")
    if options is not None:
        return options.replace(**fields)  # itself, without fields
    if torch.compiler.is_compiling():  # dynamo traces the construction (and would ignore the cache)
        return FlashOptions(**fields)
    try:
        return _cached(tuple(sorted((name, type(value), value) for name, value in fields.items())))
    except TypeError:  # an unhashable value: built (and refused, if it is wrong) without the cache
        return FlashOptions(**fields)


# --------------------------------------------------------------------------------------------
# running options on tensors

def split_mask(attn_mask: "torch.Tensor | None") -> tuple:
    """(keep, bias) from an SDPA mask: a bool mask keeps where True, a float one is added to the
    scores (detached: the mask is not differentiated)."""
    if attn_mask is None:
        return None, None
    if attn_mask.dtype == torch.bool:
        return attn_mask, None
    return None, attn_mask.detach()


def highp_dtype(policy: PrecisionPolicy) -> torch.dtype:
    """The dtype of flash_forward's high-precision O (``delta_source="o_highp"``): fp64 where O
    accumulates in fp64, else fp32."""
    return torch.float64 if storage_dtype(policy.o_accum) == torch.float64 else torch.float32


@contextlib.contextmanager
def arithmetic_context(policy: PrecisionPolicy, device: torch.device):
    """Where a policy's arithmetic runs: autocast off (every format is the policy's) and the
    policy's rounding mode for emulated formats."""
    with torch.autocast(device.type, enabled=False), rounding(policy.rounding):
        yield


def cast_inputs(policy: PrecisionPolicy, *tensors):
    """``tensors`` rounded to the policy's input format, in order (None stays None). Inside
    ``arithmetic_context``: under stochastic rounding the order is the order of the draws."""
    return tuple(None if t is None else cast(t, policy.inputs) for t in tensors)


class Forward(NamedTuple):
    """What ``run_forward`` returns: the inputs as the arithmetic received them (rounded to its
    input format; ``do`` None unless given), O in the output storage, lse (B, H, T_q, 1) and the
    high-precision O (None unless the policy's delta takes it)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor | None
    o: torch.Tensor
    lse: torch.Tensor
    o_highp: torch.Tensor | None


def run_forward(q, k, v, options: FlashOptions, *, keep=None, bias=None, causal: bool, scale: float,
                dropout: TileDropout | None = None, observe=None, do=None, rounded: bool = False) -> Forward:
    """The PyTorch kernel's forward of ``options`` on (q, k, v) (``keep`` / ``bias``: the halves of
    ``split_mask``): the one preamble of every path (module docstring). ``do``, when given, is
    rounded with the inputs, after them (the order of a stochastic rounding's draws).
    ``rounded``: q, k, v are already in the input format (``Forward`` of an earlier run), not cast."""
    policy = options.precision
    block_q, block_k = options.tiles()
    with arithmetic_context(policy, q.device):
        if rounded:
            qc, kc, vc, doc = q, k, v, do
        else:
            qc, kc, vc, doc = cast_inputs(policy, q, k, v, do)
        o, lse, o_hp = flash_forward(
            qc, kc, vc, keep=keep, bias=bias, causal=causal, scale=scale, policy=policy,
            stabilizer=options.stabilizer, block_q=block_q, block_k=block_k,
            keep_highp_o=policy.delta_source == "o_highp", softcap=options.softcap, observe=observe,
            dropout=dropout)
    return Forward(qc, kc, vc, doc, o, lse, o_hp)


def run_backward(fwd: Forward, do, options: FlashOptions, *, keep=None, bias=None, causal: bool, scale: float,
                 dropout: TileDropout | None = None, delta_hook=None, dtypes=None, dq_only: bool = False) -> tuple:
    """(dq, dk, dv) of ``run_forward``'s ``fwd`` for the output gradient ``do``, each converted to
    ``dtypes`` (the inputs' dtypes; None: left in the policy's gradient storage). ``dq_only``:
    (dq, None, None), dQ with the same bits, under a policy that rounds to nearest (ValueError
    under stochastic rounding, where the skipped roundings would move dQ's draws)."""
    if dq_only and options.precision.rounding != "nearest":
        raise ValueError(f"run_backward: dq_only leaves dQ as it is only under rounding to nearest; "
                         f"{options.precision.name} rounds {options.precision.rounding}")
    policy = options.precision
    block_q, block_k = options.tiles()
    o_hp = fwd.o_highp if policy.delta_source == "o_highp" else None
    with arithmetic_context(policy, do.device):
        grads = flash_backward(
            fwd.q, fwd.k, fwd.v, fwd.o, fwd.lse, do, o_hp, keep=keep, bias=bias, causal=causal, scale=scale,
            policy=policy, block_q=block_q, block_k=block_k, softcap=options.softcap, delta_hook=delta_hook,
            dropout=dropout, dq_only=dq_only)
    if dtypes is None:
        return grads
    return tuple(None if g is None else g.to(dt) for g, dt in zip(grads, dtypes))
