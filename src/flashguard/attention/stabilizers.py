"""Stabilizers: how the softmax shift m of each row (per key tile) is chosen.

Flash attention computes Pbar = exp(S - m) with m the running row maximum, so the largest
entry of a row is exp(0) = 1 exactly. When a row's maximum repeats (ties), several V rows
enter the PV sum with weight exactly 1 and low-precision rounding of that sum errs in one
direction (paper-notes §3). Softmax is invariant to the shift, so any m >= max(S) gives the
same attention in exact arithmetic; a stabilizer picks one that keeps Pbar away from 1.

A stabilizer maps a key tile's scores ``s`` (..., rows, keys) and their row maxima
``row_max`` (..., rows, 1), both in the policy's scores storage, to this tile's shift
candidate in the policy's stats storage. The attention then takes
m_new = max(candidate, m_running), as FA2 does with the plain row maximum.

* ``none``   the row maximum (standard flash attention).
* ``paper``  the study's fix: if the tile row's maximum r is repeated (at least two scores
             >= r - tol), use beta * r when r > 0 and 0 when r < 0. beta = 2, tol = 1e-3
             is the reference code's STABLE=1.
* ``safe``   ours, no knob: m = r + delta for every row, delta = ln(2) / 2, rounded upward
             in the stats format so that m - r >= delta holds exactly. One exception, forced
             by the reference arithmetic's 1e-10 floor on tile row sums: where the stats
             format is so coarse at r (bf16 with |r| >= 1024) that the smallest admissible
             gap would push the row sum near that floor, the row keeps the plain maximum.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..numerics.arith import cast
from ..numerics.formats import round_to
from ..numerics.policy import PrecisionPolicy

__all__ = ["Stabilizer", "NoStabilizer", "PaperStabilizer", "SafeStabilizer",
           "get_stabilizer", "STABILIZERS"]


class Stabilizer:
    name = "base"

    def shift(self, s: torch.Tensor, row_max: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
        raise NotImplementedError

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

    def shift(self, s, row_max, policy):
        fmt = policy.scores
        near_max = s >= cast(row_max - self.tol, fmt)
        # int32 count: summing a bool tensor in torch's default int64 is ~4x slower on CPU
        tied = near_max.sum(dim=-1, keepdim=True, dtype=torch.int32) > 1
        r = row_max
        r = torch.where(tied & (r > 0), cast(self.beta * r, fmt), r)
        r = torch.where(tied & (r < 0), torch.zeros_like(r), r)
        return cast(r, policy.stats)

    def __str__(self) -> str:
        return f"paper(beta={self.beta:g},tol={self.tol:g})"


# Why ln(2)/2: the largest Pbar becomes exp(-delta) = 1/sqrt(2), the middle of the binade
# [0.5, 1) in log scale - as far from 1 and from the power of two 0.5 as possible - which keeps
# every Pbar < 1 in any format with at least one mantissa bit, costs half a bit of range, and
# can never underflow a row (exp(-delta - ulp(m)) is far above every format's smallest value
# for the fp32 statistics of production kernels).
SAFE_DELTA = math.log(2.0) / 2.0


@dataclass(frozen=True)
class SafeStabilizer(Stabilizer):
    """Knob-free: shift every row by a fixed margin, rounded up so the margin is exact."""

    name = "safe"

    def shift(self, s, row_max, policy):
        # Computed in fp64 then rounded *upward* to the stats format: guarantees m >= r + delta
        # even where delta is below half an ulp of r (bf16 statistics at |r| = 1e4), so every
        # S - m <= -delta and, rounding being monotonic, every Pbar <= round(exp(-delta)) < 1.
        r = row_max.to(torch.float64)
        stats = policy.stats
        up = round_to(r + SAFE_DELTA, stats, mode="up")
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
