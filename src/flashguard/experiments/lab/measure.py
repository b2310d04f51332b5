"""Run one lab problem through a precision policy and a stabilizer, against fp64."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...attention import flash_forward, get_stabilizer, reference_attention
from ...attention.flash import delta_preprocess
from ...numerics import get_policy
from ...numerics.arith import cast, rounding, rowsum
from .problems import Problem, make_problem
from .stats import ErrorStats, error_stats

__all__ = ["Measurement", "measure"]


@dataclass
class Measurement:
    problem: Problem
    policy: str
    stabilizer: str
    o: ErrorStats          # O_lp - O_exact, per element
    delta: ErrorStats      # delta_lp - delta_exact, per row
    pbar_one: float        # fraction of Pbar entries exactly 1
    rows_with_two_ones: float  # fraction of rows where >= 2 Pbar are exactly 1 (the tie mechanism)
    # where the O error comes from (single key tile): the rounding of the PV sum against the
    # exact sum of the same rounded Pbar times V, and the rounding of the row sum l likewise
    pv_err: ErrorStats | None = None
    l_err: ErrorStats | None = None

    def to_dict(self) -> dict:
        return {"condition": self.problem.label(), "problem": self.problem.to_dict(), "policy": self.policy,
                "stabilizer": self.stabilizer, "o": self.o.to_dict(), "delta": self.delta.to_dict(),
                "pbar_one": self.pbar_one, "rows_with_two_ones": self.rows_with_two_ones,
                "pv_err": self.pv_err.to_dict() if self.pv_err else None,
                "l_err": self.l_err.to_dict() if self.l_err else None}


def measure(problem: Problem, precision="paper", stabilizer="none", block_k: int = 512) -> Measurement:
    policy = get_policy(precision)
    stab = get_stabilizer(stabilizer)
    q, k, v, do = make_problem(problem)
    qc, kc, vc, doc = (cast(x, policy.inputs) for x in (q, k, v, do))
    counts = torch.zeros(3, dtype=torch.float64)  # ones, entries, rows with >= 2 ones

    seen = []

    def observe(tile, pbar, pv, **_):
        seen.append((pbar, pv))
        ones = pbar == 1
        counts[0] += ones.sum()
        counts[1] += ones.numel()
        counts[2] += (ones.sum(-1) >= 2).sum()

    torch.manual_seed(problem.seed)  # stochastic rounding, if the policy asks for it
    with torch.no_grad(), rounding(policy.rounding):
        o, lse, o_hp = flash_forward(qc, kc, vc, keep=None, bias=None, causal=False, scale=1 / math.sqrt(problem.d),
                                   policy=policy, stabilizer=stab, block_q=512, block_k=block_k,
                                   keep_highp_o=policy.delta_source == "o_highp", observe=observe)
        delta_lp = delta_preprocess(qc, kc, vc, o, lse, doc, o_hp, keep=None, bias=None, causal=False,
                                    scale=1 / math.sqrt(problem.d), policy=policy, block_q=512, block_k=block_k)
    exact = reference_attention(qc.double(), kc.double(), vc.double())
    delta_hp = (doc.double() * exact).sum(-1, keepdim=True)
    rows = counts[1] / max(problem.t, 1)
    pv_err = l_err = None
    if len(seen) == 1:  # one key tile: the tile's PV and row sum are the whole row's
        pbar, pv = seen[0]
        pv_err = error_stats(pv.double() - pbar.double() @ vc.double())
        if policy.row_sum_rounded:
            l_lp = rowsum(pbar, policy.stats)
            if policy.row_sum_floor is not None:
                l_lp = l_lp.clamp(min=policy.row_sum_floor)
            l_err = error_stats(l_lp.double() - pbar.double().sum(-1, keepdim=True))
    return Measurement(problem, policy.short_str(), str(stab), error_stats(o.double() - exact),
                       error_stats(delta_lp.double() - delta_hp), float(counts[0] / counts[1]),
                       float(counts[2] / rows) if rows else 0.0, pv_err, l_err)
