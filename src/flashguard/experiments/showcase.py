"""A one-minute tour of the mechanism: tied maxima + same-sign V -> biased O in bf16.

`flashguard demo` is the README's main job; this one-minute tour stays for a first look.
It runs one sink-like lab problem (rows whose maximum repeats and dominates, mostly negative
V) through the reference-code arithmetic (`paper`), production-kernel arithmetic (`fa2`) and
fp32, each with no stabilizer, the study's fix and ours, and prints the lab's measurements.
"""
from __future__ import annotations

import torch

from ..numerics import BF16, round_to
from .lab import Measurement, Problem, measure

__all__ = ["SHOWCASE_PROBLEM", "run_showcase"]

# the lab condition where the study's signs show in the reference arithmetic (docs/lab/lab.md)
SHOWCASE_PROBLEM = Problem(ties=4, gap=8.0, t=128, n=32)


def run_showcase(print_fn=print) -> list[Measurement]:
    x = torch.tensor([-4.703990459442139], dtype=torch.float64)
    r = round_to(x, BF16).item()
    print_fn(f"The study's worked example: the exact sum -4.703990459442139 rounds in bf16 to {r} "
             f"(error {r - x.item():+.4f}).\n")
    p = SHOWCASE_PROBLEM
    print_fn(f"Rows where {p.ties} keys tie for the maximum and the rest lie ~{p.gap:g} below; V mostly negative;")
    print_fn("dO leans like V. Errors of O and of delta = rowsum(dO * O) against fp64 on the same inputs.")
    print_fn("bias ratio = mean(err)/mean(|err|): 0 unbiased, +-1 every error one sign. 'biased': sign test over")
    print_fn(f"{p.n} independent instances p < 0.01, |ratio| >= 0.05, 95% CI of the mean excluding 0.\n")
    header = f"{'policy':<8}{'stabilizer':<26}{'O ratio':>9}{'O verdict':>11}{'delta ratio':>13}{'delta verdict':>15}{'Pbar==1':>9}"
    print_fn(header)
    print_fn("-" * len(header))
    rows = []
    for precision in ("fp32", "paper", "fa2"):
        for stab in ("none", "paper", "safe"):
            m = measure(p, precision, stab)
            rows.append(m)
            print_fn(f"{m.policy:<8}{m.stabilizer:<26}{m.o.bias_ratio:>+9.2f}{m.o.verdict:>11}"
                     f"{m.delta.bias_ratio:>+13.2f}{m.delta.verdict:>15}{m.pbar_one:>9.2%}")
    print_fn("\nOne condition, one seed: a demonstration. `flashguard lab` measures every condition with verdicts.")
    return rows
