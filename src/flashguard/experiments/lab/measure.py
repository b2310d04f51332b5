"""One lab cell: a problem through an arithmetic, against fp64 and against the noise floor.

The numbers come from ``attention.trace`` (the one measurement) and ``attention.error_stats``
(one value per independent unit, the problem's ``unit``). Each arithmetic is judged next to
its noise floor, ``floor_arithmetic(policy)`` (every intermediate fp32, the same input and
output formats) on the same problems: ``o_vs_floor`` and ``delta_vs_floor`` are the paired
leans of the arithmetic's unit errors beyond the floor's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...attention.error_stats import BiasStats, bias_stats, leans_beyond_floor, paired_bias, unit_means
from ...attention.trace import Arithmetic, Trace, floor_arithmetic, trace
from .problems import Problem, half_ulp_bf16, make_problem, tail_mass

__all__ = ["Measurement", "Bench", "BlackBox"]


@dataclass
class Measurement:
    problem: object          # a lab Problem or a captured.CapturedProblem
    arithmetic: str          # Arithmetic.label()
    policy: str              # policy.short_str()
    stabilizer: str
    o: BiasStats             # O error, one value per unit (absolute, against fp64)
    delta: BiasStats         # delta error likewise
    o_vs_floor: BiasStats    # paired: O unit error minus the floor's
    delta_vs_floor: BiasStats
    o_floor: BiasStats       # the floor's own O lean (its output rounding)
    o_mae: float             # mean |O error| over elements (accuracy)
    o_mae_floor: float
    bad_rows: int            # rows with a non-finite O, or O zeroed where the exact O is not
    tie_rate: float          # (row, key tile) pairs tied under the stabilizer's own rule
    multi_one: float         # rows with a tile of >= 2 Pbar == 1
    tail_half_ulps: float    # the problems' median tail mass in half-ulps of ties (bf16)

    @property
    def condition(self) -> str:
        return self.problem.label()

    @property
    def o_leans(self) -> bool:
        """O leans beyond the floor (attention.error_stats.leans_beyond_floor)."""
        return leans_beyond_floor(self.o, self.o_vs_floor)

    @property
    def delta_leans(self) -> bool:
        return leans_beyond_floor(self.delta, self.delta_vs_floor)

    @property
    def leans(self) -> bool:
        """O or delta leans beyond the floor: the one rule the lab, the audit and the captured
        problems judge by."""
        return self.o_leans or self.delta_leans

    def to_dict(self) -> dict:
        d = {"condition": self.condition, "problem": self.problem.to_dict(), "arithmetic": self.arithmetic,
             "policy": self.policy, "stabilizer": self.stabilizer}
        for name in ("o", "delta", "o_vs_floor", "delta_vs_floor", "o_floor"):
            d[name] = getattr(self, name).to_dict()
        d.update(o_leans=self.o_leans, delta_leans=self.delta_leans, o_mae=self.o_mae, o_mae_floor=self.o_mae_floor, bad_rows=self.bad_rows, tie_rate=self.tie_rate,
                 multi_one=self.multi_one, tail_half_ulps=self.tail_half_ulps)
        return d


def _bad_rows(t: Trace) -> int:
    nonfinite = ~torch.isfinite(t.o).all(-1)
    zeroed = (t.o == 0).all(-1) & (t.o_ref != 0).any(-1)
    return int((nonfinite | zeroed).sum())


@dataclass(frozen=True, eq=False)
class BlackBox:
    """An attention kernel seen from outside: ``fn(q, k, v) -> o`` (autograd for gradients),
    fed inputs in ``dtype``; its noise floor is ``floor_arithmetic(floor_policy)`` (the fp32
    arithmetic with the kernel's input and output formats)."""

    name: str
    fn: object
    dtype: torch.dtype = torch.bfloat16
    floor_policy: str = "fa2"

    def label(self) -> str:
        return self.name


class Bench:
    """Problems, their floors and their measurements, each computed once per run."""

    def __init__(self):
        self._inputs: dict = {}
        self._floors: dict = {}
        self._cells: dict = {}

    def inputs(self, p):
        """(q, k, v, do) of a lab ``Problem`` (made once) or of a captured problem (its own)."""
        if not isinstance(p, Problem):
            return p.inputs()
        if p not in self._inputs:
            self._inputs[p] = make_problem(p)
        return self._inputs[p]

    def _trace(self, p, a: "Arithmetic | BlackBox") -> Trace:
        q, k, v, do = self.inputs(p)
        torch.manual_seed(p.seed)  # stochastic rounding, if the policy asks for it
        kw = getattr(p, "trace_kwargs", {})
        if isinstance(a, BlackBox):
            q, k, v, do = (x.to(a.dtype) for x in (q, k, v, do))
            return trace(q, k, v, do, a.fn, grads=False, label=a.name, **kw)
        return trace(q, k, v, do, a, grads=False, **kw)

    def _floor(self, p: Problem, a: "Arithmetic | BlackBox"):
        fa = floor_arithmetic(a.floor_policy if isinstance(a, BlackBox) else a.precision)
        key = (p, fa.precision)
        if key not in self._floors:
            t = self._trace(p, fa)
            self._floors[key] = (unit_means(t.o_err, p.unit), unit_means(t.delta_err, p.unit, feature_dim=False),
                                 float(t.o_err.abs().mean()))
        return self._floors[key]

    def measure(self, p, a: "Arithmetic | BlackBox | str") -> Measurement:
        if isinstance(a, str):
            a = Arithmetic.of(a)
        key = (p, a)
        if key in self._cells:
            return self._cells[key]
        t = self._trace(p, a)
        o_u = unit_means(t.o_err, p.unit)
        d_u = unit_means(t.delta_err, p.unit, feature_dim=False)
        fo, fd, f_mae = self._floor(p, a)
        ties = t.ties  # None for a black box: its tiles and shifts are not visible
        tile_pairs = float(ties.tiles.sum()) if ties is not None else 0.0
        tails = torch.tensor([float("nan")])
        if isinstance(p, Problem):  # a planted problem: its tail mass in half-ulps of its ties
            q, k, _, _ = t.inputs
            tails = tail_mass(q, k) / half_ulp_bf16(p.ties)
        m = Measurement(
            problem=p, arithmetic=a.label(),
            policy=a.precision.short_str() if isinstance(a, Arithmetic) else f"black box ({a.dtype})".replace("torch.", ""),
            stabilizer=str(a.stabilizer) if isinstance(a, Arithmetic) else "?",
            o=bias_stats(o_u, p.unit), delta=bias_stats(d_u, p.unit), o_vs_floor=paired_bias(o_u, fo, p.unit),
            delta_vs_floor=paired_bias(d_u, fd, p.unit), o_floor=bias_stats(fo, p.unit),
            o_mae=float(t.o_err.abs().mean()), o_mae_floor=f_mae, bad_rows=_bad_rows(t),
            tie_rate=float(ties.tied.sum()) / tile_pairs if tile_pairs else float("nan"),
            multi_one=float((ties.multi_one > 0).double().mean()) if ties is not None else float("nan"),
            tail_half_ulps=float(tails.median()))
        self._cells[key] = m
        return m
