"""Delta error injection: the backward pass's delta replaced by delta_ref + alpha * rule(e).

The error-injection experiment (issue 12) asks whether the *sign structure* of the delta error,
not its size, makes training explode. In the backward pass of the PyTorch flash path the
arithmetic's own delta (``delta_lp``, from ``flash.delta_preprocess``: the policy's
delta_source and formats) is replaced by

    delta = delta_ref + alpha * rule(e),   e = delta_lp - delta_ref,

where ``delta_ref = rowsum(dO * O_ref)`` and ``O_ref`` is the exact attention
(``reference_attention`` in fp64 or fp32) of the same rounded q, k, v, with the same masks,
scale and soft-cap, and dO rounded to the policy's input format as the backward rounds it.
Sign rules (``RULES``), each per row of the (B, H, T_q) delta:

* ``real``       e as computed;
* ``coherent``   magnitude |e|, sign + with probability ``p`` (independent per row);
* ``zero-mean``  magnitude |e|, random sign: ``coherent`` with p = 1/2 (the same draws);
* ``shuffled``   the values of e permuted across the rows of the call (one permutation of all
                 B * H * T_q rows): the same multiset, so the same sum and sum of |e|.

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

The hook reaches ``flash.flash_backward`` through the model's per-layer ``AttentionSpec``
(``delta_hook``) and ``function.flash_attention_with_delta_hook``; ``flash_attention`` itself
has no such argument.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass, field

import torch

from .reference import reference_attention

__all__ = ["RULES", "REFERENCES", "DeltaInjection", "InjectionClock", "DeltaHook", "sign_rule", "inject",
           "reference_delta", "injection_generator"]

RULES = ("real", "coherent", "zero-mean", "shuffled")
REFERENCES = {"fp64": torch.float64, "fp32": torch.float32}


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class DeltaInjection:
    """What to inject: ``alpha`` (> 0), ``rule`` (one of RULES), ``p`` (``coherent`` only, in
    [0, 1]: the probability of a positive sign), ``seed`` (an integer >= 0) and ``reference``
    (``fp64`` or ``fp32``: the arithmetic of O_ref and delta_ref). Checked on construction; a
    ValueError names the field."""

    alpha: float = 1.0
    rule: str = "real"
    p: float | None = None
    seed: int = 0
    reference: str = "fp64"

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

    @property
    def p_positive(self) -> float | None:
        """The probability of a positive sign (``coherent``: p, ``zero-mean``: 1/2), else None."""
        return float(self.p) if self.rule == "coherent" else 0.5 if self.rule == "zero-mean" else None

    def short_str(self) -> str:
        p = f",p={self.p:g}" if self.rule == "coherent" else ""
        return f"{self.rule}{p},alpha={self.alpha:g}"


def injection_generator(seed: int, step: int, call: int, layer: int, rank: int = 0,
                        device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator on ``device`` seeded from (seed, step, call, layer, rank) by a hash:
    independent streams for every combination, the same stream for the same one."""
    digest = hashlib.blake2b(repr(("flashguard-delta-injection", int(seed), int(step), int(call), int(layer),
                                   int(rank))).encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") >> 1)


def sign_rule(e: torch.Tensor, injection: DeltaInjection, generator: torch.Generator | None) -> torch.Tensor:
    """rule(e): ``e`` (any shape) with the injection's sign rule applied, same dtype."""
    rule = injection.rule
    if rule == "real":
        return e
    if rule == "shuffled":
        flat = e.reshape(-1)
        perm = torch.randperm(flat.numel(), generator=generator, device=e.device)
        return flat[perm].view_as(e)
    # coherent / zero-mean: |e| with sign + where a uniform draw falls below p
    u = torch.rand(e.shape, generator=generator, device=e.device, dtype=torch.float64)
    positive = u < injection.p_positive
    mag = e.abs()
    return torch.where(positive, mag, -mag)


def inject(delta_lp: torch.Tensor, delta_ref: torch.Tensor, injection: DeltaInjection,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(new delta, e) in fp64: ``delta_lp + (alpha * rule(e) - e)`` (= delta_ref + alpha * rule(e);
    exactly delta_lp for ``real`` at alpha = 1) and e = delta_lp - delta_ref."""
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


class DeltaHook:
    """The callable ``flash_backward(..., delta_hook=)`` receives: replaces one layer's delta.

    ``hook(delta, q=, k=, v=, do=, keep=, bias=, causal=, scale=, softcap=)`` -> the new delta.
    ``observer``, if given, is called as ``observer(layer=, step=, call=, delta_lp=, delta_ref=,
    e=, injected=)`` (fp64 tensors) after each call: the tests read the rule's effect there."""

    def __init__(self, injection: DeltaInjection, layer: int = 0, clock: InjectionClock | None = None,
                 observer=None):
        if not isinstance(injection, DeltaInjection):
            raise TypeError(f"injection must be a DeltaInjection, got {type(injection).__name__}")
        self.injection, self.layer = injection, int(layer)
        self.clock = clock if clock is not None else InjectionClock()
        self.observer = observer

    def __repr__(self) -> str:
        return f"DeltaHook({self.injection.short_str()}, layer={self.layer})"

    def __call__(self, delta, *, q, k, v, do, keep, bias, causal, scale, softcap):
        inj = self.injection
        step, call = self.clock.next_call(self.layer)
        ref = reference_delta(q, k, v, do, keep=keep, bias=bias, causal=causal, scale=scale, softcap=softcap,
                              dtype=REFERENCES[inj.reference])
        gen = None
        if inj.rule != "real":
            gen = injection_generator(inj.seed, step, call, self.layer, self.clock.rank, device=delta.device)
        new, e = inject(delta, ref, inj, gen)
        if self.observer is not None:
            self.observer(layer=self.layer, step=step, call=call, delta_lp=delta.to(torch.float64),
                          delta_ref=ref.to(torch.float64), e=e, injected=new)
        return new.to(torch.promote_types(delta.dtype, torch.float32))  # fp32, or fp64 storage
