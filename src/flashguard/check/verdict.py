"""The check's verdict rule, in one place (fixed before any result was looked at).

Per layer, from the measurement of the kernel that ran (``Measurement`` of the lab's Bench on
the layer's captured problem: O and delta = rowsum(dO * O) against fp64, paired against the
fp32 noise floor on the same units; ``leans_beyond_floor`` is the one rule of a lean):

* ``high``: O or delta leans beyond the floor and that lean is large: |bias ratio| of the paired
  lean >= HIGH_BIAS_RATIO (0.1: a tenth of the kernel's mean unit error is one-signed lean
  beyond the floor; torch's CPU flash kernel under planted ties sits at 0.13-0.5, the study's
  reference arithmetic at 0.5-1.3, docs/audit/audit.md); also a kernel that returns non-finite
  or zeroed rows where the exact O is not zero;
* ``low``: a lean below that size, or no lean but the mechanism's precondition present: the
  layer's rows tie at their maximum score (bit for bit, in the production arithmetic of the
  dtype) in at least TIE_RATE_LOW of its (row, key tile) pairs;
* ``none``: no lean beyond the floor and (almost) no ties;
* ``unmeasured``: the layer's call could not be measured (no gradient reached it).

Overall: the highest layer risk (unmeasured counts only when nothing was measured). The fix
recommended: the cheapest candidate (measured time ratio) that leans on no layer.
"""
from __future__ import annotations

import math

__all__ = ["HIGH_BIAS_RATIO", "TIE_RATE_LOW", "RISKS", "layer_verdict", "overall_verdict", "choose_fix", "QUANTITY_NAMES"]

HIGH_BIAS_RATIO = 0.1
TIE_RATE_LOW = 1e-3
RISKS = ("none", "low", "high")            # in increasing order
QUANTITY_NAMES = {"o": "O", "delta": "delta = rowsum(dO*O)"}


def _lean_text(m, q: str) -> str:
    v = getattr(m, f"{q}_vs_floor")
    return (f"{QUANTITY_NAMES[q]} leans {v.mean:+.1e} beyond the fp32 floor "
            f"(z {v.z:+.1f}, bias ratio {v.bias_ratio:+.2f})")


def layer_verdict(kernel, tie_rate: float | None) -> tuple[str, str]:
    """(risk, one-line reason) of one layer: ``kernel`` is its Measurement (None: not measured),
    ``tie_rate`` the census' exact tie rate (None: not counted)."""
    if kernel is None:
        return "unmeasured", "no gradient reached this call's output: its dO, and so delta, was not captured"
    if kernel.bad_rows:
        return "high", f"{kernel.bad_rows} rows of O are non-finite, or zero where the exact O is not"
    leaning = [q for q in ("o", "delta") if getattr(kernel, f"{q}_leans")]
    big = [q for q in leaning if abs(getattr(kernel, f"{q}_vs_floor").bias_ratio) >= HIGH_BIAS_RATIO]
    if big:
        return "high", "; ".join(_lean_text(kernel, q) for q in big)
    if leaning:
        return "low", "; ".join(_lean_text(kernel, q) for q in leaning) + f", below bias ratio {HIGH_BIAS_RATIO}"
    ties = tie_rate if tie_rate is not None and math.isfinite(tie_rate) else 0.0
    if ties >= TIE_RATE_LOW:
        return "low", (f"no lean beyond the floor, but {ties:.2%} of (row, key tile) pairs tie at their maximum "
                       "score: the mechanism's precondition")
    return "none", "no lean beyond the fp32 noise floor in O or delta, and no tied maxima to speak of"


def overall_verdict(risks: list[str]) -> str:
    measured = [r for r in risks if r in RISKS]
    if not measured:
        return "unmeasured"
    return max(measured, key=RISKS.index)


def choose_fix(fixes: dict) -> tuple[str | None, str | None]:
    """(recommended, alternative) among ``fixes`` (name -> {"leans_on": [...], "measured_on": int,
    "ratio": cost, "switch": {...}}): the cheapest fix that leans on no layer and was measured on
    every measured layer, among those flashguard can switch on; and a cheaper one without a
    flashguard switch (torch's fp32 SDPA), if any."""
    def ok(f):
        return not f["leans_on"] and f["measured_on"] > 0 and not f["refused_on"]

    def cost(name):
        r = fixes[name].get("ratio")
        return r if r is not None and math.isfinite(r) else math.inf
    usable = sorted((n for n, f in fixes.items() if ok(f)), key=cost)
    switchable = [n for n in usable if fixes[n]["switch"]["plain"]]
    best = switchable[0] if switchable else None
    other = next((n for n in usable if not fixes[n]["switch"]["plain"]
                  and (best is None or cost(n) < cost(best))), None)
    return best, other
