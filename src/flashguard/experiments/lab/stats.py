"""Statistics of rounding errors: means with confidence intervals, sign tests, bias ratios.

Errors inside one instance share its K and V and are not independent, so every statistic
treats an *instance* as the sampling unit: the per-instance mean errors are the samples.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["ErrorStats", "error_stats", "sign_test_p", "BIAS_RATIO_MIN", "P_MAX"]

BIAS_RATIO_MIN = 0.05   # |mean| / mean|err| below this is "no practical bias"
P_MAX = 0.01            # sign-test p-value below which a lean is significant
NOISE_FLOOR = 1e-9      # errors this small are the fp64 reference's own round-off (e.g. V = 1)


def sign_test_p(pos: int, neg: int) -> float:
    """Two-sided exact binomial sign test (ties excluded), in log space for large counts."""
    n = pos + neg
    if n == 0:
        return 1.0
    k = min(pos, neg)
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2) for i in range(k + 1)]
    top = max(logs)
    tail = math.exp(top) * sum(math.exp(x - top) for x in logs)
    return min(1.0, 2 * tail)


@dataclass
class ErrorStats:
    mean: float          # mean signed error (over all elements)
    ci95: float          # half-width of the 95% CI of the mean, from per-instance means
    mean_abs: float
    bias_ratio: float    # mean / mean|err|: 0 unbiased, +-1 every error one sign
    ratio_ci95: float    # half-width of the 95% CI of the bias ratio (per-instance ratios)
    pos_instances: int   # instances whose mean error is > 0
    neg_instances: int
    p_sign: float        # sign test over instances
    n_instances: int

    @property
    def biased(self) -> bool:
        return (self.p_sign < P_MAX and abs(self.bias_ratio) >= BIAS_RATIO_MIN and abs(self.mean) > self.ci95
                and self.mean_abs > NOISE_FLOOR)

    @property
    def verdict(self) -> str:
        if self.biased:
            return "biased +" if self.mean > 0 else "biased -"
        return "no bias"

    def to_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}


def error_stats(err: torch.Tensor) -> ErrorStats:
    """``err``: (n_instances, ...) signed errors."""
    err = err.double()
    n = err.shape[0]
    per = err.reshape(n, -1)
    inst_mean = per.mean(1)
    inst_abs = per.abs().mean(1)
    mean, mean_abs = per.mean().item(), per.abs().mean().item()
    sd = inst_mean.std().item() if n > 1 else float("inf")
    ci = 1.96 * sd / math.sqrt(n)
    ratios = inst_mean / inst_abs.clamp(min=1e-300)
    ratio_ci = 1.96 * (ratios.std().item() if n > 1 else float("inf")) / math.sqrt(n)
    pos, neg = int((inst_mean > 0).sum()), int((inst_mean < 0).sum())
    ratio = mean / mean_abs if mean_abs > 0 else 0.0
    return ErrorStats(mean, ci, mean_abs, ratio, ratio_ci, pos, neg, sign_test_p(pos, neg), n)
