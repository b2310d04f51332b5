"""Is a rounding error biased? One value per independent unit, then a test across units.

The features of one attention row share that row's rounding of the statistics m and l, and
the rows of one sequence share its keys and values: counting every element as a sample
makes a test several times too confident. So an error tensor is first averaged within its
independent unit, and every statistic is computed over those unit means:

* ``"row"``: one value per (batch, head, query) row, the error averaged over the row's
  features. Right for problems whose rows are drawn independently (the lab's).
* ``"sequence"``: one value per (batch, head), averaged over its rows and features. Right
  where the rows of a sequence are not independent (captured activations, sink problems).

A bias is reported with its size (the bias ratio mean / mean |unit error|: 0 for an unbiased
error, +-1 when every unit errs the same way) next to its significance (z of the mean over
units, and the exact sign test). A lean counts as a bias when |z| >= Z_CRIT (two-sided
p < ALPHA) and |bias ratio| >= BIAS_RATIO_MIN. Against the noise floor (the fp32 arithmetic
on the same problems) the comparison is paired: the unit errors of the two arithmetics are
subtracted unit by unit, so the problems' own variation cancels.

A lean *beyond the floor* (``leans_beyond_floor``, the one rule every judge uses) needs both:
the arithmetic's own error against fp64 is a bias, and the paired difference from the floor is a
bias of the same sign, i.e. the arithmetic errs further in its own direction than the ideal
arithmetic with the same output rounding does. A paired difference alone is not a lean: the
floor has leans of its own (its one rounding of O, e.g. +362e-6 at z +86 with two tied keys in
bf16), and an arithmetic whose O lands elsewhere on the output grid can differ from the floor
significantly while its error against fp64 has no lean at all (fp8 with a consistent row sum:
O -1e-6 at z -0.8 against the floor's -74e-6 at z -64; docs/lab/lab.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["UNITS", "ALPHA", "Z_CRIT", "BIAS_RATIO_MIN", "BiasStats", "unit_means", "bias_stats",
           "paired_bias", "sign_test_p", "leans_beyond_floor"]

UNITS = ("row", "sequence")
ALPHA = 1e-3            # two-sided: a lab run tests dozens of cells, so one false alarm in a
Z_CRIT = 3.2905         # thousand cells, not one in a hundred (the normal quantile of 1 - ALPHA/2)
BIAS_RATIO_MIN = 0.02   # below this a significant lean is too small to matter (huge samples)


def sign_test_p(pos: int, neg: int) -> float:
    """Two-sided exact binomial sign test (zeros excluded), summed in log space."""
    n = pos + neg
    if n == 0:
        return 1.0
    k = min(pos, neg)
    # the binomial tail in log space, vectorised (a probe tests ~16k rows: a Python loop cost ~0.1 s)
    i = torch.arange(k + 1, dtype=torch.float64)
    logs = math.lgamma(n + 1) - torch.lgamma(i + 1) - torch.lgamma(n - i + 1) - n * math.log(2)
    return min(1.0, 2 * math.exp(float(torch.logsumexp(logs, 0))))


def unit_means(err: torch.Tensor, unit: str, *, feature_dim: bool = True) -> torch.Tensor:
    """Flat fp64 tensor of one mean error per unit. ``err`` is (B, H, T, D) with
    ``feature_dim`` (O, dQ, ...), or (B, H, T) without (delta, lse). Non-finite errors are kept:
    a NaN unit makes the statistics NaN instead of being dropped silently."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {unit!r}")
    want = 4 if feature_dim else 3
    if err.dim() != want:
        raise ValueError(f"error tensor must be {'(B, H, T, D)' if feature_dim else '(B, H, T)'}, "
                         f"got shape {tuple(err.shape)}")
    e = err.to(torch.float64)
    if feature_dim:
        e = e.mean(-1)
    if unit == "sequence":
        e = e.mean(-1)
    return e.reshape(-1)


@dataclass
class BiasStats:
    unit: str
    n: int               # independent units
    mean: float          # mean unit error
    se: float            # its standard error
    z: float
    mean_abs: float      # mean |unit error|
    bias_ratio: float    # mean / mean_abs
    pos: int             # units with a positive mean error
    neg: int
    p_sign: float        # exact sign test over units

    @property
    def ci95(self) -> float:
        return 1.96 * self.se

    @property
    def biased(self) -> bool:
        return (self.n >= 2 and math.isfinite(self.z) and abs(self.z) >= Z_CRIT
                and abs(self.bias_ratio) >= BIAS_RATIO_MIN)

    @property
    def verdict(self) -> str:
        if not math.isfinite(self.mean):
            return "non-finite"
        if self.biased:
            return "biased +" if self.mean > 0 else "biased -"
        return "no bias"

    def to_dict(self) -> dict:
        return {**asdict(self), "ci95": self.ci95, "verdict": self.verdict}

    def cell(self, scale: float = 1e-6, *, marked: bool | None = None) -> str:
        """``-222 (z -5.6)``: the mean in units of ``scale`` with its z, marked (bold) when
        ``marked`` - by default when biased; a lean beyond the floor passes its own rule."""
        mark = "**" if (self.biased if marked is None else marked) else ""
        return f"{mark}{self.mean / scale:+.0f}{mark} (z {self.z:+.1f})"


def bias_stats(samples: torch.Tensor, unit: str, *, mean_abs: float | None = None) -> BiasStats:
    """Statistics of one value per independent unit (``samples``, any shape, flattened).
    ``mean_abs`` overrides the denominator of the bias ratio (paired comparisons)."""
    x = samples.detach().to(torch.float64).reshape(-1)
    n = x.numel()
    if n == 0:
        raise ValueError("bias_stats needs at least one unit")
    mean = float(x.mean())
    sd = float(x.std()) if n > 1 else float("inf")
    se = sd / math.sqrt(n)
    if se > 0:
        z = mean / se
    else:
        z = 0.0 if mean == 0 else math.copysign(float("inf"), mean)
    ma = float(x.abs().mean()) if mean_abs is None else float(mean_abs)
    ratio = mean / ma if ma > 0 else 0.0
    pos, neg = int((x > 0).sum()), int((x < 0).sum())
    return BiasStats(unit, n, mean, se, z, ma, ratio, pos, neg, sign_test_p(pos, neg))


def paired_bias(a: torch.Tensor, b: torch.Tensor, unit: str) -> BiasStats:
    """The lean of unit errors ``a`` beyond ``b`` (same units, same problems): statistics of
    a - b, with the bias ratio taken against mean |a| (the size of the error judged)."""
    if a.shape != b.shape:
        raise ValueError(f"paired_bias: unit tensors differ in shape, {tuple(a.shape)} vs {tuple(b.shape)}")
    return bias_stats(a - b, unit, mean_abs=float(a.to(torch.float64).abs().mean()))


def leans_beyond_floor(own: BiasStats, vs_floor: BiasStats) -> bool:
    """The arithmetic leans beyond its noise floor: its own error (``own``, against fp64) is a
    bias and its paired lean beyond the floor (``vs_floor``) is a bias of the same sign (module
    docstring). An arithmetic between the floor and the truth, or indistinguishable from the
    truth, does not lean, however much it differs from the floor."""
    return own.biased and vs_floor.biased and (own.mean > 0) == (vs_floor.mean > 0)
