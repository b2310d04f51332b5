"""Exact and classical tests for stochastic outcomes: does a run diverge, and when.

A run at the edge of stability diverges at some seeds and not at others, so an arm is a count
(k of n seeds diverged) and a set of times (the step of divergence, or the last step for a run
that trained: censored). Two arms are compared by

* ``fisher_one_sided(k1, n1, k2, n2)``: P(an arm-1 count this small or smaller | the margins),
  the exact (hypergeometric) test that arm 1 diverges *less often* than arm 2;
* ``log_rank(t1, e1, t2, e2)``: the log-rank statistic on the times of divergence (Mantel's
  form: observed minus expected events of arm 1 over the pooled risk sets), with its two-sided
  p from the chi-square distribution with one degree of freedom, and the sign that says which
  arm diverges earlier;
* ``holm(pvalues)``: Holm's step-down adjustment of a family of p-values (the family-wise error
  rate at any level), so that a table of claims each tested at 0.05 is not ten chances at one.

No scipy: the distributions needed are the hypergeometric (exact, by binomial coefficients) and
the chi-square with one degree of freedom (erfc).
"""
from __future__ import annotations

import math

__all__ = ["fisher_one_sided", "log_rank", "holm"]


def _check_count(k, n, name):
    if not (isinstance(k, int) and isinstance(n, int)) or isinstance(k, bool) or isinstance(n, bool) \
            or n < 1 or not 0 <= k <= n:
        raise ValueError(f"{name}: need integers 0 <= k <= n, n >= 1, got k={k!r}, n={n!r}")


def fisher_one_sided(k1: int, n1: int, k2: int, n2: int) -> float:
    """One-sided Fisher exact p that arm 1 (k1 events of n1) has a *lower* event rate than arm 2
    (k2 of n2): the hypergeometric probability, given the margins, of k1 or fewer events in arm 1."""
    _check_count(k1, n1, "arm 1")
    _check_count(k2, n2, "arm 2")
    total, events = n1 + n2, k1 + k2
    denom = math.comb(total, n1)
    lo = max(0, events - n2)
    return min(1.0, sum(math.comb(events, x) * math.comb(total - events, n1 - x) for x in range(lo, k1 + 1)) / denom)


def log_rank(t1, e1, t2, e2) -> dict:
    """The log-rank test of two arms' event times. ``t*``: the step each run ended (diverged or
    reached the end), ``e*``: whether it ended by an event (diverged: True) or was censored.
    Returns {"observed1", "expected1", "variance", "chi2", "p" (two-sided), "earlier"}:
    ``earlier`` is 1 when arm 1 has more events than expected (it diverges earlier or more often),
    2 when fewer, None when equal or no events at all (then chi2 = 0, p = 1)."""
    for name, t, e in (("arm 1", t1, e1), ("arm 2", t2, e2)):
        if len(t) != len(e) or not t:
            raise ValueError(f"log_rank {name}: need equal, non-empty lists of times and events, got "
                             f"{len(t)} times and {len(e)} events")
        if any(not math.isfinite(float(x)) or float(x) < 0 for x in t):
            raise ValueError(f"log_rank {name}: times must be finite and >= 0, got {list(t)}")
    runs = [(float(t), bool(e), 1) for t, e in zip(t1, e1)] + [(float(t), bool(e), 2) for t, e in zip(t2, e2)]
    event_times = sorted({t for t, e, _ in runs if e})
    obs = exp = var = 0.0
    for t in event_times:
        # at risk: runs that had not ended before t (a run censored at t is still at risk at t)
        n1 = sum(1 for s, _, a in runs if a == 1 and s >= t)
        n = sum(1 for s, _, _ in runs if s >= t)
        d1 = sum(1 for s, e, a in runs if a == 1 and e and s == t)
        d = sum(1 for s, e, _ in runs if e and s == t)
        obs += d1
        exp += d * n1 / n
        if n > 1:
            var += d * (n1 / n) * (1 - n1 / n) * (n - d) / (n - 1)
    if var <= 0:
        return {"observed1": obs, "expected1": exp, "variance": var, "chi2": 0.0, "p": 1.0, "earlier": None}
    chi2 = (obs - exp) ** 2 / var
    p = math.erfc(math.sqrt(chi2 / 2))  # chi-square, 1 degree of freedom: P(|Z| >= sqrt(chi2))
    earlier = None if obs == exp else (1 if obs > exp else 2)
    return {"observed1": obs, "expected1": exp, "variance": var, "chi2": chi2, "p": p, "earlier": earlier}


def holm(pvalues) -> list[float]:
    """Holm-adjusted p-values, in the input order: the i-th smallest p times (m - i), made
    monotone and capped at 1. A claim whose adjusted p is below a level is rejected at that
    family-wise level."""
    ps = [float(p) for p in pvalues]
    if any(not 0.0 <= p <= 1.0 for p in ps):
        raise ValueError(f"holm: p-values must lie in [0, 1], got {ps}")
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    out, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        out[i] = running
    return out
