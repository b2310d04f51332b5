"""A few-second tour of the mechanism: tied maxima + same-sign V -> O leans in bf16.

`flashguard demo` is the README's main job; this tour stays for a first look. It runs one lab
problem family (rows drawn independently, each with k = 8 keys tied at its maximum and a
tail below half an ulp of the row sum; V mostly negative) through the reference-code
arithmetic (`paper`) with no fix and with the study's fix, through the arithmetic change
the lab recommends for it (`paper-fp32fwd`), and through production-kernel arithmetic
(`fa2`), and prints each lean beyond the fp32 noise floor, one value per row.
"""
from __future__ import annotations

import torch

from ..attention.trace import Arithmetic
from ..numerics import BF16, round_to
from .lab import Bench, Measurement, Problem

__all__ = ["SHOWCASE_PROBLEM", "SHOWCASE_ARITHMETICS", "run_showcase"]

SHOWCASE_PROBLEM = Problem(ties=8, tail=0.25, n_rows=1024)
SHOWCASE_ARITHMETICS = [("paper", "none"), ("paper", "paper"), ("paper-fp32fwd", "none"), ("fa2", "none")]


def run_showcase(print_fn=print) -> list[Measurement]:
    x = torch.tensor([-4.703990459442139], dtype=torch.float64)
    r = round_to(x, BF16).item()
    print_fn(f"The study's worked example: the exact sum -4.703990459442139 rounds in bf16 to {r} "
             f"(error {r - x.item():+.4f}).\n")
    p = SHOWCASE_PROBLEM
    print_fn(f"{p.n_rows} independent rows; each has {p.ties} keys tied at its maximum and a tail of other keys")
    print_fn(f"below half an ulp of the row sum; V ~ N({p.v_mean:g}, {p.v_sd:g}^2). Error of O and of delta =")
    print_fn("rowsum(dO * O) against fp64 on the same inputs, averaged over each row's features (unit: one row),")
    print_fn("beyond the noise floor (the fp32 arithmetic with the same bf16 output, same rows); z over rows.\n")
    header = f"{'arithmetic':<40}{'O beyond floor (1e-6, z)':>27}{'delta beyond floor':>22}{'|O err| / floor':>17}"
    print_fn(header)
    print_fn("-" * len(header))
    bench, rows = Bench(), []
    for precision, stab in SHOWCASE_ARITHMETICS:
        m = bench.measure(p, Arithmetic.of(precision, stab))
        rows.append(m)
        print_fn(f"{m.arithmetic:<40}{m.o_vs_floor.cell(marked=m.o_leans):>27}"
                 f"{m.delta_vs_floor.cell(marked=m.delta_leans):>22}"
                 f"{m.o_mae / m.o_mae_floor:>16.2f}x")
    print_fn("\n**bold**: a lean beyond the floor (its own error against fp64 and its difference from the floor both "
             "|z| >= 3.29 and |bias ratio| >= 0.02, same sign). One problem family, one seed: "
             "`flashguard lab` measures every condition with verdicts.")
    return rows
