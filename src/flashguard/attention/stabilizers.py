"""Stabilizers: how the softmax shift m of each row (per key tile) is chosen.

Flash attention computes Pbar = exp(S - m) with m the running row maximum, so the largest
entry of a row is exp(0) = 1 exactly. When a row's maximum repeats (ties), several V rows
enter the PV sum with weight exactly 1 and low-precision rounding of that sum errs in one
direction (Qiu & Yao 2025, arXiv 2510.04212). Softmax is invariant to the shift, so any
m >= max(S) gives the same attention in exact arithmetic; a stabilizer picks one that keeps
Pbar away from 1.

A stabilizer maps a key tile's scores ``s`` (..., rows, keys) and their row maxima
``row_max`` (..., rows, 1), both in the policy's scores storage, to this tile's shift
candidate in the policy's stats storage. The attention then takes
m_new = max(candidate, m_running), as FA2 does with the plain row maximum.

* ``none``   the row maximum (standard flash attention).
* ``paper``  the study's fix: if the tile row's maximum r is repeated (at least two scores
             >= r - tol), use beta * r when r > 0 and 0 when r < 0. beta = 2, tol = 1e-3
             is the reference code's STABLE=1.
* ``safe``   ours, no knob: m = r + delta for every row, delta in [ln(2)/2, ln 2) dithered
             over the rows (see SafeStabilizer), rounded upward in the stats format so that
             m - r >= delta holds exactly. One exception, forced
             by the reference arithmetic's 1e-10 floor on tile row sums: where the stats
             format is so coarse at r (bf16 with |r| >= 1024) that the smallest admissible
             gap would push the row sum near that floor, the row keeps the plain maximum.
             Measured on independent rows (docs/lab/lab.md), it is not a fix: in the reference
             arithmetic the bf16 PV sum and row sum still lean whatever the shift, and in
             production arithmetic (row sum from the unrounded Pbar) moving the dominant Pbar
             off 1 adds a lean and costs accuracy. Kept to reproduce that measurement; the
             lab's recommendation is no stabilizer with fp32 forward accumulators
             (``paper-fp32fwd`` for the reference code; ``fa2`` as it is).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..numerics import fused_softmax
from ..numerics.arith import cast
from ..numerics.formats import round_to
from ..numerics.policy import PrecisionPolicy

__all__ = ["count_true", "count_cmp", "exact_ties", "Stabilizer", "NoStabilizer", "PaperStabilizer", "SafeStabilizer",
           "get_stabilizer", "STABILIZERS"]


def count_true(mask: torch.Tensor) -> torch.Tensor:
    """Number of True entries along the last dim (kept), as int32.

    Summing a bool tensor is slow on CPU (about 2 ms for a 512 x 512 x 24 tile, int64 default:
    8 ms), which made the tie rule cost ~20 % of the forward. When rows are contiguous, a
    multiple of 8 long and at most 2040 long, the bytes are summed 8 at a time as int64 words:
    each byte lane then holds at most 255 ones, so no carry crosses lanes, and the 8 lanes of
    the row total add up to the count.
    """
    n = mask.shape[-1]
    if n % 8 or n > 2040 or not mask.is_contiguous():
        return mask.sum(dim=-1, keepdim=True, dtype=torch.int32)
    words = mask.view(torch.int64).sum(dim=-1, keepdim=True)           # (..., 1) int64
    lanes = words.view(torch.uint8).view(*words.shape[:-1], 8)          # (..., 8) bytes
    return lanes.sum(dim=-1, keepdim=True, dtype=torch.int32)


def count_cmp(s: torch.Tensor, thr: torch.Tensor, op: str) -> torch.Tensor:
    """Per row, how many scores are >= (op "ge") or == (op "eq") the row's ``thr`` (..., rows, 1),
    as int32 (..., rows, 1): one C pass over the tile where numerics.fused_softmax runs, else a
    boolean tile counted by ``count_true``."""
    n = fused_softmax.count_cmp(s, thr, op)
    if n is None:
        n = count_true(((s >= thr) if op == "ge" else (s == thr)).contiguous())
    return n


def exact_ties(s: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """(..., rows, 1) bool: the row's maximum occurs at least twice, bit for bit. With m equal
    to that maximum, those keys all get Pbar = exp(0) = 1: the study's trigger."""
    return count_cmp(s, row_max, "eq") > 1


class Stabilizer:
    name = "base"

    def shift(self, s: torch.Tensor, row_max: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
        raise NotImplementedError

    def tied(self, s: torch.Tensor, row_max: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
        """(..., rows, 1) bool: this stabilizer's tie rule on a key tile's scores. The default
        is an exactly repeated maximum; a stabilizer that acts on near-ties says its own rule.
        The measurement (``trace``) and the probes count ties through this method."""
        return exact_ties(s, row_max)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class NoStabilizer(Stabilizer):
    name = "none"

    def shift(self, s, row_max, policy):
        return cast(row_max, policy.stats)


@dataclass(frozen=True)
class PaperStabilizer(Stabilizer):
    """Qiu & Yao's fix, evaluated per key tile in the scores format, as their code does."""

    beta: float = 2.0
    tol: float = 1e-3
    name = "paper"

    def __post_init__(self):
        if not (self.beta > 1):
            raise ValueError(f"paper stabilizer: beta must be > 1, got {self.beta!r}")
        if not (self.tol >= 0):
            raise ValueError(f"paper stabilizer: tol must be >= 0, got {self.tol!r}")

    def tied(self, s, row_max, policy):
        # at least two scores within tol of the tile row's max, compared in the scores format
        return count_cmp(s, cast(row_max - self.tol, policy.scores), "ge") > 1

    def shift(self, s, row_max, policy):
        fmt = policy.scores
        tied = self.tied(s, row_max, policy)
        r = row_max
        r = torch.where(tied & (r > 0), cast(self.beta * r, fmt), r)
        r = torch.where(tied & (r < 0), torch.zeros_like(r), r)
        return cast(r, policy.stats)

    def __str__(self) -> str:
        return f"paper(beta={self.beta:g},tol={self.tol:g})"


# Why a dithered margin and not a fixed one: with a fixed margin delta every row's largest
# Pbar is the same number exp(-delta), rounded to the Pbar format with the same relative
# error in every row and every step. That error is coherent - it under- or over-weights the
# dominant keys everywhere alike - and measured as a new bias (the study also reports that a
# fixed additive offset re-introduces bias). Spreading delta over [ln 2 / 2, ln 2) with a
# low-discrepancy (golden-ratio) sequence over the rows of a tile gives each row a different
# largest Pbar in (1/2, 1/sqrt 2], whose rounding errors have mixed signs. The range keeps
# every Pbar < 1 with room in any format with a mantissa bit, and costs at most one bit of
# range, so no finite row can underflow.
SAFE_DELTA_MIN = math.log(2.0) / 2.0
SAFE_DELTA_SPAN = math.log(2.0) / 2.0
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _dither(shape, device) -> torch.Tensor:
    """Deterministic values in [0, 1), well spread over consecutive rows: frac(0.5 + i * phi)."""
    n = 1
    for d in shape:
        n *= d
    i = torch.arange(n, dtype=torch.float64, device=device).view(shape)
    return torch.frac(i * _GOLDEN + 0.5)


@dataclass(frozen=True)
class SafeStabilizer(Stabilizer):
    """Knob-free: shift every row by a dithered margin in [ln2/2, ln2), rounded up so that the
    margin holds exactly."""

    name = "safe"

    def shift(self, s, row_max, policy):
        # Computed in fp64 then rounded *upward* to the stats format: guarantees m >= r + delta
        # even where delta is below half an ulp of r (bf16 statistics at |r| = 1e4), so every
        # S - m <= -delta and, rounding being monotonic, every Pbar <= round(exp(-delta)) < 1.
        r = row_max.to(torch.float64)
        stats = policy.stats
        delta = SAFE_DELTA_MIN + SAFE_DELTA_SPAN * _dither(r.shape, r.device)
        up = round_to(r + delta, stats, mode="up")
        if policy.row_sum_floor is not None:
            # A row sum of exp(-gap) must stay far above the floor, or the floor rewrites l:
            # keep it 2^(M+1) * 16 times above (half an ulp of the stats format, with room for
            # 16 tiles' floors). Beyond that gap, shifting would corrupt O; keep the maximum.
            max_gap = -math.log(policy.row_sum_floor * 2.0 ** (stats.mantissa_bits + 1) * 16)
            up = torch.where(up - r > max_gap, r, up)
        return cast(up, stats)


STABILIZERS = {"none": NoStabilizer, "paper": PaperStabilizer, "safe": SafeStabilizer}


def get_stabilizer(stabilizer: "Stabilizer | str | None") -> Stabilizer:
    """Resolve ``"none"``, ``"paper"``, ``"paper:beta=7"``, ``"paper:beta=7,tol=0"``, ``"safe"``."""
    if stabilizer is None:
        return NoStabilizer()
    if isinstance(stabilizer, Stabilizer):
        return stabilizer
    if not isinstance(stabilizer, str):
        raise TypeError(f"stabilizer must be a name or a Stabilizer, got {type(stabilizer).__name__}")
    name, _, args = stabilizer.partition(":")
    if name not in STABILIZERS:
        raise ValueError(f"unknown stabilizer {stabilizer!r}; known: {', '.join(STABILIZERS)}"
                         " (options as 'paper:beta=7,tol=1e-3')")
    kwargs = {}
    if args:
        for item in args.split(","):
            key, eq, val = item.partition("=")
            if not eq:
                raise ValueError(f"stabilizer option {item!r} in {stabilizer!r} is not key=value")
            try:
                kwargs[key.strip()] = float(val)
            except ValueError:
                raise ValueError(f"stabilizer option {key!r} in {stabilizer!r} needs a number, got {val!r}") from None
    try:
        return STABILIZERS[name](**kwargs)
    except TypeError:
        raise ValueError(f"stabilizer {name!r} takes no option(s) {sorted(kwargs)}") from None
