"""The lab's attention problems: rows drawn independently, ties planted where asked.

A bias is a consistent sign over a distribution of inputs, so every row of a problem is a
problem of its own: its own query, its own maximum, its own tail of other scores. One
instance (a batch entry, one head) holds ``rows`` queries and ``t`` keys; each query owns
``ties`` of the keys, placed at random positions, which are copies of one vector scaled so
that the query scores exactly ``max_logit`` with each of them (identical keys give
bit-identical scores in any arithmetic: a planted tie is exact). The row's other keys are the
rest: random keys, with scores ~ N(0, sigma^2), and the other queries' tied keys, whose
scores with this query are random too. So the tail mass tau = sum of exp(s - max) over the
other keys is set by ``max_logit``: ``tail`` chooses it as a multiple of half an ulp of
``ties`` in bf16 (the row sum l is about ties + tau; below half an ulp, a bf16 row sum
rounds tau away), and ``max_logit`` follows. ``offset`` adds a constant to every score
(a channel every query and key shares), to reach large logits without changing softmax.

``sink=True`` instead puts one key vector at positions 0..ties-1 that every query of the
instance scores at the maximum (an attention sink): rows then share their tied V rows and
are not independent, so the unit of a sink problem is the instance (``Problem.unit``).

V ~ N(v_mean, v_sd^2) per entry ("mostly negative V" for v_mean < 0); dO ~ N(do_mean, 1).
With do_mean of V's sign, delta's error rowsum(dO * O_err) has the sign of -O_err: a
negative O bias shows as a positive delta bias (Qiu & Yao 2025, arXiv 2510.04212: the mechanism).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["Problem", "make_problem", "half_ulp_bf16", "tail_mass"]


def half_ulp_bf16(x: float) -> float:
    """Half the bf16 spacing at x > 0 (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(x)) - 8)


@dataclass(frozen=True)
class Problem:
    ties: int = 2              # keys at each row's maximum (1 = no tie)
    t: int = 512               # keys per instance (T_k)
    rows: int = 32             # queries per instance (T_q); rows * ties <= t
    d: int = 64                # head dim
    tail: float = 0.25         # tail mass / half a bf16 ulp of ``ties`` (sets max_logit)
    sigma: float = 1.0         # sd of the random keys' scores
    offset: float = 0.0        # added to every score (large logits)
    v_mean: float = -1.0
    v_sd: float = 0.5
    do_mean: float = -0.5
    sink: bool = False
    n_rows: int = 3072         # rows in all (instances = n_rows / rows, rounded up)
    seed: int = 0

    def __post_init__(self):
        if self.ties < 1:
            raise ValueError(f"Problem.ties must be >= 1, got {self.ties}")
        if not self.sink and self.rows * self.ties > self.t:
            raise ValueError(f"Problem: rows * ties = {self.rows * self.ties} keys exceed t = {self.t}")
        if self.sink and self.ties > self.t:
            raise ValueError(f"Problem: ties = {self.ties} exceed t = {self.t}")
        for name in ("t", "rows", "d", "n_rows"):
            if getattr(self, name) < 1:
                raise ValueError(f"Problem.{name} must be >= 1, got {getattr(self, name)}")
        if not self.tail > 0 or not self.sigma >= 0 or not self.v_sd >= 0:
            raise ValueError("Problem: tail must be > 0, sigma and v_sd >= 0")

    @property
    def unit(self) -> str:
        """The independent unit of this problem's errors (see attention.error_stats)."""
        return "sequence" if self.sink else "row"

    @property
    def instances(self) -> int:
        return -(-self.n_rows // self.rows)

    @property
    def max_logit(self) -> float:
        """The planted maximum (before ``offset``), chosen so that the row's expected tail mass
        is ``tail`` half-ulps: the random keys contribute (t - rows * ties) exp(sigma^2/2 - m),
        the other rows' tied keys (rows - 1) ties exp(m^2 / (2 (d - 1)) - m) (their score with
        this query is m q.q' / |q'|^2 ~ N(0, m^2 / (d - 1))). Solved by bisection."""
        target = self.tail * half_ulp_bf16(self.ties)
        rnd = max(self.t - (self.ties if self.sink else self.rows * self.ties), 0)
        copies = 0 if self.sink else (self.rows - 1) * self.ties
        dm1 = max(self.d - 1, 1)

        def log_mass(m):
            terms = []
            if rnd:
                terms.append(math.log(rnd) + self.sigma ** 2 / 2 - m)
            if copies:
                terms.append(math.log(copies) + m * m / (2 * dm1) - m)
            top = max(terms)
            return top + math.log(sum(math.exp(x - top) for x in terms))

        lo, hi = 0.0, (float(dm1) if copies else 200.0)  # the copies' term is smallest at m = d - 1
        if log_mass(hi) > math.log(target):
            raise ValueError(f"Problem: no maximum gives tail={self.tail} with {self.rows} rows of "
                             f"{self.ties} ties in d={self.d}; use fewer rows per instance")
        for _ in range(100):  # log_mass decreases on [lo, hi]
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if log_mass(mid) > math.log(target) else (lo, mid)
        return (lo + hi) / 2

    def label(self) -> str:
        extra = (",sink" if self.sink else "") + (f",offset={self.offset:g}" if self.offset else "")
        return (f"k={self.ties},T={self.t},tail={self.tail:g},v={self.v_mean:g}+-{self.v_sd:g}{extra}")

    def to_dict(self) -> dict:
        return {**asdict(self), "max_logit": self.max_logit, "unit": self.unit}


def make_problem(p: Problem):
    """(q, k, v, do) fp32 tensors: q, do (n, 1, rows, d), k, v (n, 1, t, d); non-causal."""
    g = torch.Generator().manual_seed(p.seed)
    n, t, d, r = p.instances, p.t, p.d, p.rows
    scale = 1.0 / math.sqrt(d)
    top = p.max_logit
    # channel 0 carries the offset: q[0] = sqrt(d), k[0] = offset, adding offset to every score
    q = torch.randn(n, 1, r, d, generator=g)
    q[..., 0] = math.sqrt(d)
    k = p.sigma * torch.randn(n, 1, t, d, generator=g)  # random keys: score ~ N(0, sigma^2 |q'|^2 / d)
    if p.sink:
        # one sink vector along channel 1: every query has q[1] = b, the sink key scores top with all
        b = math.sqrt(d)
        q[..., 1] = b
        k[..., 1] = 0.0
        k[:, :, :p.ties, :] = 0.0
        k[:, :, :p.ties, 1] = top / (scale * b)
    else:
        # row i owns keys perm[i * ties : (i + 1) * ties]: copies of q_i' scaled to score top
        qn = q[..., 1:]                                                   # (n, 1, r, d - 1)
        copies = qn * (top / (scale * (qn * qn).sum(-1, keepdim=True)))   # (n, 1, r, d - 1)
        for inst in range(n):
            slots = torch.randperm(t, generator=g)[: r * p.ties].view(r, p.ties)
            k[inst, 0, slots.reshape(-1), 1:] = copies[inst, 0].repeat_interleave(p.ties, dim=0)
    k[..., 0] = p.offset
    v = p.v_mean + p.v_sd * torch.randn(n, 1, t, d, generator=g)
    do = p.do_mean + torch.randn(n, 1, r, d, generator=g)
    return q, k, v, do


def tail_mass(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row (n, 1, rows): sum of exp(s - max) over the keys below the row's maximum, in fp64
    from the given (rounded) inputs: what the row sum carries beyond its tied keys."""
    s = (q.double() @ k.double().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    top = s.amax(-1, keepdim=True)
    w = torch.exp(s - top)
    return w.masked_fill(s == top, 0.0).sum(-1)
