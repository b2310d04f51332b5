"""A one-minute tour of the mechanism: tied maxima + same-sign V -> biased O in bf16.

Until `flashguard demo` (the full reproduction) exists, this is the main job of the README.
It builds sink-like attention problems whose rows have tied maxima and mostly negative V,
runs them through several precision policies and stabilizers, and measures the error of O
against fp64 on the same (rounded) inputs: its mean, its bias ratio mean(err) / mean(|err|)
(0 for unbiased rounding, +-1 for errors that all share a sign), a 95% confidence interval
of the mean and how often Pbar was exactly 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention import flash_forward, get_stabilizer, reference_attention
from ..numerics import BF16, get_policy, round_to
from ..numerics.arith import cast

__all__ = ["tied_problem", "measure", "run_showcase"]


def tied_problem(n: int = 32, t: int = 256, d: int = 64, ties: int = 2, gap: float = 8.0, seed: int = 0):
    """(q, k, v) of shape (n, 1, t, d), sink-like: in every row ``ties`` keys share the exact
    maximum score 1.0 and all others lie about ``gap`` below it, so the tied keys dominate the
    softmax; V is mostly negative (mean -1, sd 0.5). With scale 1/sqrt(d) = 1/8 and |q| = 8,
    a score is the projection of the key on the row's direction u."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(n, 1, 1, d, generator=g), dim=-1)
    q = 8.0 * u.expand(n, 1, t, d) + 0.05 * torch.randn(n, 1, t, d, generator=g)
    k = 0.3 * torch.randn(n, 1, t, d, generator=g) - gap * u
    idx = torch.stack([torch.randperm(t, generator=g)[:ties] for _ in range(n)])  # (n, ties)
    for j in range(ties):
        k[torch.arange(n), 0, idx[:, j]] = u[:, 0, 0]  # identical keys: exactly tied scores
    v = -1.0 + 0.5 * torch.randn(n, 1, t, d, generator=g)
    return q, k, v


@dataclass
class Measured:
    policy: str
    stabilizer: str
    mean_err: float
    ci95: float
    bias_ratio: float
    pbar_one: float

    @property
    def verdict(self) -> str:
        """'biased' when the 95% CI of the mean error excludes 0 and the errors lean clearly
        one way (|bias ratio| >= 0.05); otherwise 'no clear bias'."""
        return "biased" if abs(self.mean_err) > self.ci95 and abs(self.bias_ratio) >= 0.05 else "no clear bias"


def measure(q, k, v, precision: str, stabilizer: str) -> Measured:
    policy = get_policy(precision)
    qc, kc, vc = (cast(x, policy.inputs) for x in (q, k, v))
    ones = [0, 0]

    def observe(tile, pbar, hidden, **_):
        ones[0] += int((pbar == 1).sum())
        ones[1] += pbar.numel()

    o, _, _ = flash_forward(qc, kc, vc, keep=None, bias=None, causal=False, scale=1 / math.sqrt(q.shape[-1]),
                            policy=policy, stabilizer=get_stabilizer(stabilizer), block_q=512, block_k=512,
                            observe=observe)
    ref = reference_attention(qc.double(), kc.double(), vc.double())
    err = (o.double() - ref).flatten()
    mean = err.mean().item()
    ci = 1.96 * err.std().item() / math.sqrt(err.numel())
    ratio = mean / max(err.abs().mean().item(), 1e-300)
    return Measured(precision, stabilizer, mean, ci, ratio, ones[0] / max(ones[1], 1))


def run_showcase(print_fn=print) -> list[Measured]:
    x = torch.tensor([-4.703990459442139], dtype=torch.float64)
    print_fn("The study's worked example: the exact sum -4.703990459442139 rounds in bf16 to "
             f"{round_to(x, BF16).item()} (error {round_to(x, BF16).item() - x.item():+.4f}).\n")
    q, k, v = tied_problem()
    print_fn("Sink-like rows: 2 keys tie for the maximum score, the rest lie ~8 below; V mostly negative.")
    print_fn("Error of O against fp64 on the same inputs. bias ratio = mean(err)/mean(|err|): 0 is")
    print_fn("unbiased, -1 means every error is negative. 'biased': the 95% CI excludes 0 and |ratio| >= 0.05.\n")
    header = (f"{'policy':<8}{'stabilizer':<12}{'mean err':>11}{'+-95% CI':>10}{'bias ratio':>12}"
              f"{'Pbar == 1':>11}  verdict")
    print_fn(header)
    print_fn("-" * len(header))
    rows = []
    for precision in ("fp32", "paper", "fa2"):
        for stab in ("none", "paper", "safe"):
            r = measure(q, k, v, precision, stab)
            rows.append(r)
            print_fn(f"{r.policy:<8}{r.stabilizer:<12}{r.mean_err:>11.2e}{r.ci95:>10.1e}{r.bias_ratio:>12.3f}"
                     f"{r.pbar_one:>11.2%}  {r.verdict}")
    by = {(r.policy, r.stabilizer): r for r in rows}
    print_fn("")
    for precision, label in (("paper", "the study's reference arithmetic"), ("fa2", "production-kernel arithmetic")):
        plain = by[(precision, "none")]
        print_fn(f"{label} ({precision}): without a stabilizer {plain.verdict} (ratio {plain.bias_ratio:+.2f}); "
                 f"paper fix: {by[(precision, 'paper')].verdict} ({by[(precision, 'paper')].bias_ratio:+.2f}); "
                 f"safe: {by[(precision, 'safe')].verdict} ({by[(precision, 'safe')].bias_ratio:+.2f}).")
    print_fn("One problem, one seed: a demonstration, not a verdict on the stabilizers (that is the lab's job).")
    return rows
