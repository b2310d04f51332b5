"""Error injection: delta (backward) or O (forward) replaced by ref + alpha * rule(e).

The error-injection experiment (issue 12) asks whether the *sign structure* of the delta error,
not its size, makes training explode. At the ``delta`` point (the default), in the backward pass
of the PyTorch flash path the arithmetic's own delta (``delta_lp``, from
``flash.delta_preprocess``: the policy's delta_source and formats) is replaced by

    delta = delta_ref + alpha * rule(e),   e = delta_lp - delta_ref,

where ``delta_ref = rowsum(dO * O_ref)`` and ``O_ref`` is the exact attention
(``reference_attention`` in fp64 or fp32) of the same rounded q, k, v, with the same masks,
scale and soft-cap, and dO rounded to the policy's input format as the backward rounds it.
Sign rules (``RULES``), each per row of the (B, H, T_q) delta:

* ``real``       e as computed;
* ``coherent``   magnitude |e|, sign + with probability ``p`` (independent per row);
* ``zero-mean``  magnitude |e|, random sign: ``coherent`` with p = 1/2 (the same draws);
* ``shuffled``   the values of e permuted across the rows of the call (one permutation of all
                 B * H * T_q rows): the same multiset, so the same sum and sum of |e|;
* ``exact``      no error: delta = delta_ref (``delta`` point only; alpha must stay 1).

At the ``o`` point (``OutputHook``, issue 23: the lean of O itself removed at the same size) the
forward pass's O (B, H, T_q, D), in the policy's output storage, is replaced by
``O_ref + alpha * rule(e)``, e = O_lp - O_ref, per element (``shuffled``: across all elements of
the call), and rounded back to the output format *stochastically* with the injection's own
generator: rounded to nearest, a flipped error under a quarter of an ulp snaps back to the grid
point it came from (its sign, and a lean made of small errors, survive) and a larger one
overshoots to the far grid point, while stochastic rounding adds an unbiased error, so
the injected O is unbiased given e's sign and somewhat larger than |e| (the observer sees both;
the edge experiment reports the ratio). ``real`` at alpha = 1 returns O_lp exactly
(stochastic rounding of a representable value is that value). The backward's delta then reads
the injected O, as the next layer does.

Exactness: the new delta is computed in fp64 as ``delta_lp + (alpha * rule(e) - e)``, which is
``delta_ref + alpha * rule(e)`` up to one fp64 rounding and is ``delta_lp`` *exactly* for
``real`` at alpha = 1, so that run is bit-identical to no injection. It is handed to the
backward in fp32 (fp64 if the policy's delta storage is fp64), not rounded to the delta format
again: the injected error reaches dS = P (dP - delta) as injected (the real delta's rounding is
part of e).

Randomness comes from a generator of its own per call, seeded from (seed, step, call, layer,
rank) - never torch's global generator - so batches, dropout and the trainer's RNG state are
untouched, and a run (and a resumed run) draws the same signs and permutations at the same
step. ``InjectionClock`` carries the step (set by the trainer) and counts the calls of each layer
within it (micro-batches of gradient accumulation).

The hooks reach ``flash.flash_backward`` and the forward through the model's per-layer
``AttentionSpec`` (``delta_hook`` / ``output_hook``) and ``function.flash_attention_with_hooks``;
``flash_attention`` itself has no such argument.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass, field

import torch

from ..numerics.formats import round_to
from .reference import reference_attention

__all__ = ["RULES", "POINTS", "REFERENCES", "ErrorInjection", "InjectionClock", "DeltaHook", "OutputHook",
           "sign_rule", "inject", "reference_delta", "injection_generator", "make_hook"]

RULES = ("real", "coherent", "zero-mean", "shuffled", "exact")
POINTS = ("delta", "o")
REFERENCES = {"fp64": torch.float64, "fp32": torch.float32}


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class ErrorInjection:
    """What to inject: ``alpha`` (> 0), ``rule`` (one of RULES), ``p`` (``coherent`` only, in
    [0, 1]: the probability of a positive sign), ``seed`` (an integer >= 0), ``reference``
    (``fp64`` or ``fp32``: the arithmetic of O_ref and delta_ref) and ``point`` (``delta``: the
    backward's delta; ``o``: the forward's O). Checked on construction; a ValueError names the
    field."""

    alpha: float = 1.0
    rule: str = "real"
    p: float | None = None
    seed: int = 0
    reference: str = "fp64"
    point: str = "delta"

    def __post_init__(self):
        if not _real(self.alpha) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"alpha must be a finite number > 0, got {self.alpha!r}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {', '.join(RULES)}, got {self.rule!r}")
        if self.rule == "coherent":
            if self.p is None or not _real(self.p) or not 0.0 <= self.p <= 1.0:
                raise ValueError(f"p must be a number in [0, 1] for rule coherent, got {self.p!r}")
        elif self.p is not None:
            raise ValueError(f"p applies to rule coherent only (rule is {self.rule}), got {self.p!r}")
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")
        if self.point not in POINTS:
            raise ValueError(f"point must be one of {', '.join(POINTS)}, got {self.point!r}")
        if self.rule == "exact" and self.alpha != 1:
            raise ValueError(f"alpha applies to the rules with an error (rule exact injects none), got {self.alpha!r}")
        if self.rule == "exact" and self.point != "delta":
            raise ValueError("rule exact applies to point delta only (an O in the output format always carries "
                             "an error; rounded stochastically it is the zero-mean rule's floor)")

    @property
    def p_positive(self) -> float | None:
        """The probability of a positive sign (``coherent``: p, ``zero-mean``: 1/2), else None."""
        return float(self.p) if self.rule == "coherent" else 0.5 if self.rule == "zero-mean" else None

    def short_str(self) -> str:
        p = f",p={self.p:g}" if self.rule == "coherent" else ""
        at = "" if self.point == "delta" else f",point={self.point}"
        return f"{self.rule}{p},alpha={self.alpha:g}{at}"


def injection_generator(seed: int, step: int, call: int, layer: int, rank: int = 0,
                        device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator on ``device`` seeded from (seed, step, call, layer, rank) by a hash:
    independent streams for every combination, the same stream for the same one."""
    digest = hashlib.blake2b(repr(("flashguard-delta-injection", int(seed), int(step), int(call), int(layer),
                                   int(rank))).encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


def sign_rule(e: torch.Tensor, injection: ErrorInjection, generator: torch.Generator | None) -> torch.Tensor:
    """rule(e): ``e`` (any shape) with the injection's sign rule applied, same dtype."""
    rule = injection.rule
    if rule == "real":
        return e
    if rule == "exact":
        return torch.zeros_like(e)
    if rule == "shuffled":
        flat = e.reshape(-1)
        perm = torch.randperm(flat.numel(), generator=generator, device=e.device)
        return flat[perm].view_as(e)
    # coherent / zero-mean: |e| with sign + where a uniform draw falls below p
    u = torch.rand(e.shape, generator=generator, device=e.device, dtype=torch.float64)
    positive = u < injection.p_positive
    mag = e.abs()
    return torch.where(positive, mag, -mag)


def inject(delta_lp: torch.Tensor, delta_ref: torch.Tensor, injection: ErrorInjection,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(new value, e) in fp64: ``lp + (alpha * rule(e) - e)`` (= ref + alpha * rule(e); exactly lp
    for ``real`` at alpha = 1) and e = lp - ref. Any shape: delta's (B, H, T_q, 1) or O's."""
    lp, ref = delta_lp.to(torch.float64), delta_ref.to(torch.float64)
    e = lp - ref
    return lp + (injection.alpha * sign_rule(e, injection, generator) - e), e


def reference_delta(q, k, v, do, *, keep, bias, causal: bool, scale: float, softcap: float | None,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """delta_ref = rowsum(dO * O_ref), (B, H, T_q, 1) in ``dtype``, with O_ref the one reference
    attention of these (already rounded) inputs and masks."""
    mask = keep if keep is not None else bias
    with torch.no_grad():
        o_ref = reference_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, dtype=dtype,
                                    softcap=softcap)
        return (do.to(dtype) * o_ref).sum(dim=-1, keepdim=True)


@dataclass
class InjectionClock:
    """Where a run is: the step (``begin_step``, called by the trainer before each step) and, per
    layer, how many backward calls that step has made so far. Without ``begin_step`` the step
    stays 0 and the calls keep counting, so every call still draws afresh."""

    rank: int = 0
    step: int = 0
    calls: dict = field(default_factory=dict)

    def begin_step(self, step: int) -> None:
        self.step = int(step)
        self.calls.clear()

    def next_call(self, layer: int) -> tuple[int, int]:
        """(step, call index within the step) for the next backward call of ``layer``."""
        call = self.calls.get(layer, 0)
        self.calls[layer] = call + 1
        return self.step, call


class _Hook:
    """What both hooks hold: the injection (checked: its point is the hook's), the layer, the
    shared clock and the observer."""

    point = ""

    def __init__(self, injection: ErrorInjection, layer: int = 0, clock: InjectionClock | None = None,
                 observer=None):
        if not isinstance(injection, ErrorInjection):
            raise TypeError(f"injection must be an ErrorInjection, got {type(injection).__name__}")
        if injection.point != self.point:
            other = "OutputHook" if injection.point == "o" else "DeltaHook"
            raise ValueError(f"{type(self).__name__} injects at point {self.point}; this injection's point is "
                             f"{injection.point!r} ({other})")
        self.injection, self.layer = injection, int(layer)
        self.clock = clock if clock is not None else InjectionClock()
        self.observer = observer

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.injection.short_str()}, layer={self.layer})"


class DeltaHook(_Hook):
    """The callable ``flash_backward(..., delta_hook=)`` receives: replaces one layer's delta.

    ``hook(delta, q=, k=, v=, do=, keep=, bias=, causal=, scale=, softcap=)`` -> the new delta.
    ``observer``, if given, is called as ``observer(layer=, step=, call=, delta_lp=, delta_ref=,
    e=, injected=)`` (fp64 tensors) after each call: the tests read the rule's effect there."""

    point = "delta"

    def __call__(self, delta, *, q, k, v, do, keep, bias, causal, scale, softcap):
        inj = self.injection
        step, call = self.clock.next_call(self.layer)
        ref = reference_delta(q, k, v, do, keep=keep, bias=bias, causal=causal, scale=scale, softcap=softcap,
                              dtype=REFERENCES[inj.reference])
        gen = None
        if inj.rule not in ("real", "exact"):
            gen = injection_generator(inj.seed, step, call, self.layer, self.clock.rank, device=delta.device)
        new, e = inject(delta, ref, inj, gen)
        if self.observer is not None:
            self.observer(layer=self.layer, step=step, call=call, delta_lp=delta.to(torch.float64),
                          delta_ref=ref.to(torch.float64), e=e, injected=new)
        return new.to(torch.promote_types(delta.dtype, torch.float32))  # fp32, or fp64 storage


class OutputHook(_Hook):
    """The callable the forward pass hands its O to (``point = "o"``): replaces one layer's O.

    ``hook(o, q=, k=, v=, keep=, bias=, causal=, scale=, softcap=, fmt=)`` -> the new O, in o's
    dtype, rounded stochastically to ``fmt`` (the policy's output format; module docstring).
    ``observer(layer=, step=, call=, o_lp=, o_ref=, e=, injected=)`` as DeltaHook's (fp64; ``injected``
    after the final rounding)."""

    point = "o"

    def __call__(self, o, *, q, k, v, keep, bias, causal, scale, softcap, fmt):
        inj = self.injection
        step, call = self.clock.next_call(self.layer)
        mask = keep if keep is not None else bias
        with torch.no_grad():
            ref = reference_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                      dtype=REFERENCES[inj.reference], softcap=softcap)
            gen = injection_generator(inj.seed, step, call, self.layer, self.clock.rank, device=o.device)
            new, e = inject(o, ref, inj, gen if inj.rule != "real" else None)
            # (B, H, T_q, D) fp64 -> the output format, unbiased; exact where new is representable
            out = round_to(new, fmt, "stochastic", generator=gen).to(o.dtype)
        if self.observer is not None:
            self.observer(layer=self.layer, step=step, call=call, o_lp=o.to(torch.float64),
                          o_ref=ref.to(torch.float64), e=e, injected=out.to(torch.float64))
        return out


def make_hook(injection: ErrorInjection, layer: int, clock: InjectionClock, observer=None):
    """The hook of ``injection.point``: (AttentionSpec field name, hook)."""
    if injection.point == "o":
        return "output_hook", OutputHook(injection, layer, clock, observer=observer)
    return "delta_hook", DeltaHook(injection, layer, clock, observer=observer)
