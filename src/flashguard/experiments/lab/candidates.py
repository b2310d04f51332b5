"""The lab's fix candidates and how a candidate is judged: what a user could change in an
arithmetic (``fix_candidates``: each stabilizer, fp32 forward accumulators, the consistent row
sum, fp8's scaled Pbar) and the rule a fix must pass on every problem (``judge_fix``: no lean
left beyond the floor, at most MAE_FACTOR x the accuracy cost where there is nothing to fix).
Used by the lab's experiments and by the captured-problem lab alike."""
from __future__ import annotations

import warnings

from ...attention.options import RetiredStabilizerWarning
from ...attention.trace import Arithmetic
from ...numerics import get_format, get_policy
from ...numerics.policy import POLICIES, PrecisionPolicy, largest_pbar_scale
from .measure import Measurement

__all__ = ["STABILIZER_SET", "FORMAT_POLICIES", "MAE_FACTOR", "fix_candidates", "fix_family", "unrounded_output",
           "verdict_over", "judge_fix", "judge_candidates"]

STABILIZER_SET = ["none", "paper", "paper:beta=7", "safe"]
FORMAT_POLICIES = ["paper", "fa2", "fa2-fp16", "fa2-e4m3", "fa2-e5m2"]
MAE_FACTOR = 1.25  # a fix may cost at most this much accuracy where there is nothing to fix

def fix_candidates(precision) -> list[Arithmetic]:
    """What a user could change in ``precision`` (a name or a PrecisionPolicy): each stabilizer, and
    the arithmetic changes the lab measures (the fp32 forward accumulators of ``paper-fp32fwd``,
    for ``paper`` with any output format; the consistent row sum of FA PR #2721; for an fp8 Pbar,
    that row sum with Pbar in e4m3 scaled into its range, as ``fa2-e4m3-pscaled``)."""
    p = get_policy(precision)
    with warnings.catch_warnings():  # the lab measures the retired 'safe' on purpose: that is its record
        warnings.simplefilter("ignore", RetiredStabilizerWarning)
        out = [Arithmetic.of(p, s) for s in STABILIZER_SET if s != "none"]
    paper = get_policy("paper")
    if p.replace(name="paper", output=paper.output) == paper:
        fp32fwd = get_policy("paper-fp32fwd")
        out.append(Arithmetic.of(fp32fwd if p.output == paper.output else fp32fwd.replace(output=p.output)))
    if p.pbar.total_bits <= 8 and not p.pbar_scale:
        # fp8: Pbar in e4m3 scaled into its range, with the consistent row sum (fa2-e4m3-pscaled). Before
        # the row sum alone, which the first remover an answer names would otherwise be where a problem
        # set lacks the conditions that tell them apart: on real inputs the row sum alone still leans
        # (docs/lab/captured.md)
        e4m3 = get_format("e4m3")
        out.append(Arithmetic.of(_as_preset(p.replace(pbar=e4m3, row_sum_rounded=True,
                                                      pbar_scale=largest_pbar_scale(e4m3)))))
    if not p.row_sum_rounded:
        out.append(Arithmetic.of(p.replace(row_sum_rounded=True)))
    return out


def fix_family(precision: str) -> set[str]:
    """The preset names a row of ``precision`` or of one of its fixes carries (``short_str`` before
    any ``[``): ``paper`` and ``paper-fp32fwd``; ``fa2-e4m3`` and ``fa2-e4m3-pscaled``."""
    return {precision} | {a.precision.short_str().split("[")[0] for a in fix_candidates(precision)}


def _as_preset(policy: "PrecisionPolicy") -> "PrecisionPolicy":
    """The preset ``policy`` equals field for field, if any (so that it is reported by its name)."""
    for preset in POLICIES.values():
        if preset == policy.replace(name=preset.name):
            return preset
    return policy


def unrounded_output(precision) -> "PrecisionPolicy":
    """``precision`` with O left in fp32 (its floor too: floor_arithmetic keeps the output format):
    the arithmetic's own error before O's one rounding to the output format."""
    return get_policy(precision).replace(output="fp32")


def verdict_over(flags: dict[str, bool]) -> str:
    """held / partly held / not held over conditions; inconclusive with none."""
    if not flags:
        return "inconclusive"
    if all(flags.values()):
        return "held"
    if not any(flags.values()):
        return "not held"
    return "partly held"


def _leans(m: Measurement) -> bool:
    return m.leans


def _o(m: Measurement) -> str:
    """O beyond the floor, bold when it leans, with its own error against fp64."""
    return f"{m.o_vs_floor.cell(marked=m.o_leans)} [against fp64 {m.o.cell()}]"


def _delta(m: Measurement) -> str:
    return f"{m.delta_vs_floor.cell(1e-6, marked=m.delta_leans)}"


def judge_fix(plain: Measurement, fixed: Measurement) -> tuple[bool, str]:
    """The four rules of the module docstring for one condition: (ok, reason if not)."""
    if fixed.bad_rows:
        return False, f"{fixed.bad_rows} non-finite or zeroed rows"
    if _leans(plain):
        if _leans(fixed):
            return False, f"still leans: O {_o(fixed)}, delta {_delta(fixed)} (none: O {_o(plain)})"
        return True, ""
    if _leans(fixed):
        return False, f"adds a lean: O {_o(fixed)}, delta {_delta(fixed)}"
    if fixed.o_mae > MAE_FACTOR * plain.o_mae:
        return False, f"less accurate: mean |O error| {fixed.o_mae / plain.o_mae:.2f}x that of no fix"
    return True, ""


def judge_candidates(precision, problems, measure) -> tuple[dict, list[str], dict]:
    """Every fix candidate of ``precision`` against no fix on ``problems`` (``judge_fix`` on each):
    (plain {problem: Measurement}, labels of the candidates that pass everywhere, {label: the
    reasons it failed}). ``measure(problem, arithmetic)`` returns (and may record) a Measurement."""
    plain = {p: measure(p, Arithmetic.of(precision)) for p in problems}
    removed_by, failures = [], {}
    for cand in fix_candidates(precision):
        reasons = []
        for p in problems:
            ok, why = judge_fix(plain[p], measure(p, cand))
            if not ok:
                reasons.append(f"{p.label()}: {why}")
        if reasons:
            failures[cand.label()] = reasons
        else:
            removed_by.append(cand.label())
    return plain, removed_by, failures
