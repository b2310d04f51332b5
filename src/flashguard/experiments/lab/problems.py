"""Attention problems whose structure is chosen: the lab's controlled inputs.

A problem is a batch of independent instances (n, 1 head, T queries, T keys, D). In every
row of an instance, ``ties`` keys share the exact maximum score ``max_logit`` (identical keys
give bit-identical scores in any arithmetic), and the other keys' scores lie ``gap`` +- a
uniform spread of 1 below it. V is drawn per feature with mean ``v_mean`` and sd ``v_sd``
(mostly negative when v_mean < 0), dO = do_corr * V / v_sd + noise. A ``sink`` problem
puts the tied keys at positions 0..ties-1 (attention sinks sit on the first tokens);
otherwise they are placed at random.

Scores are constructed exactly: with head dim D and scale 1/sqrt(D), q_i = sqrt(D) * e_0
and k_j = s_j * e_0 + (orthogonal noise that q does not see), so the score of key j is s_j
up to the rounding of s_j to the input format. Ties are exact because tied keys are copies.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["Problem", "make_problem"]


@dataclass(frozen=True)
class Problem:
    ties: int = 2              # keys sharing the row maximum (1 = no tie)
    gap: float = 8.0           # distance of the other scores below the maximum
    max_logit: float = 1.0     # the row maximum's score
    max_spread: float = 0.0    # per-instance max drawn from max_logit +- max_spread / 2
    t: int = 128               # sequence length (queries = keys)
    d: int = 64                # head dim
    v_mean: float = -1.0       # V's mean per feature (negative: "mostly negative V")
    v_sd: float = 0.5
    do_corr: float = 0.5       # correlation of dO with V's row mean
    sink: bool = False         # tied keys at the first positions
    n: int = 64                # independent instances
    seed: int = 0

    def label(self) -> str:
        extra = (",sink" if self.sink else "") + (f",spread={self.max_spread:g}" if self.max_spread else "")
        return (f"k={self.ties},gap={self.gap:g},max={self.max_logit:g},T={self.t},D={self.d},"
                f"v={self.v_mean:g}+-{self.v_sd:g},dO~{self.do_corr:g}{extra}")

    def to_dict(self) -> dict:
        return asdict(self)


def make_problem(p: Problem):
    """(q, k, v, do) float32 tensors of shape (n, 1, t, d) for non-causal attention."""
    if p.ties < 1 or p.ties > p.t:
        raise ValueError(f"ties must lie in [1, t], got {p.ties}")
    g = torch.Generator().manual_seed(p.seed)
    n, t, d = p.n, p.t, p.d
    e0 = torch.zeros(d)
    e0[0] = 1.0
    q = math.sqrt(d) * e0.expand(n, 1, t, d).clone()
    top = p.max_logit + p.max_spread * (torch.rand(n, 1, 1, generator=g) - 0.5)  # (n, 1, 1) per instance
    scores = top - p.gap - (torch.rand(n, 1, t, generator=g) - 0.5)            # (n, 1, t) others
    if p.sink:
        tied = torch.arange(p.ties).expand(n, p.ties)
    else:
        tied = torch.stack([torch.randperm(t, generator=g)[:p.ties] for _ in range(n)])  # (n, ties)
    scores[torch.arange(n)[:, None], 0, tied] = top[:, 0, :].expand(n, p.ties)
    noise = torch.randn(n, 1, t, d, generator=g) * 0.3
    noise[..., 0] = 0.0
    k = scores[..., None] * e0 + noise                                     # (n, 1, t, d)
    k[torch.arange(n)[:, None], 0, tied] = k[torch.arange(n)[:, None], 0, tied[:, :1]]  # exact copies
    v = p.v_mean + p.v_sd * torch.randn(n, 1, t, d, generator=g)
    # dO = do_corr * V / sd + noise: with do_corr > 0, dO leans the way V leans (negative for
    # mostly negative V), as O does; delta_err = rowsum(dO * O_err) then has the sign of
    # -O_err, so a negative O bias shows up as a positive delta bias (paper-notes §3)
    base = torch.randn(n, 1, t, d, generator=g)
    do = p.do_corr * v / max(p.v_sd, 1e-12) + math.sqrt(max(0.0, 1 - p.do_corr ** 2)) * base
    return q, k, v, do
