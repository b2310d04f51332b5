"""The rounding-bias lab: the study's arithmetic facts and the fixes, judged on independent rows.

    from flashguard.experiments.lab import run_lab
    result = run_lab(quick=True)                 # dict: rows, verdicts, answers
    result = run_lab(quick=True, precision="fp32")  # the facts tested in fp32: "not held"

Every cell is an arithmetic on a problem family of independent rows (``problems.Problem``),
judged by the lean of its unit errors beyond its noise floor on the same problems
(``measure.Bench``; a lean counts at |z| >= 3.29 and |bias ratio| >= 0.02, see
attention.error_stats). Verdicts over a set of conditions: "held" where the claim holds in
every condition, "not held" where in none, "partly held" otherwise, with the conditions
listed; "inconclusive" only where no condition tests the claim (e.g. nothing to remove).

The answer per arithmetic ("biased under ties: yes/no; removed by: ...") checks each
candidate fix against four rules on every condition: where the arithmetic without a fix
leans beyond the floor (O or delta), the fix does not; where it does not lean, the fix adds
no lean; it is never less accurate than no fix by more than 1.25x in mean |O error| where
there was nothing to fix; and it never gives a non-finite or zeroed row.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from ...attention.trace import Arithmetic
from ...numerics import get_policy, round_to
from .candidates import (FORMAT_POLICIES, MAE_FACTOR, STABILIZER_SET, _delta, _leans, _o, fix_candidates,
                         judge_candidates, judge_fix, unrounded_output, verdict_over)
from .measure import Bench, Measurement
from .problems import Problem

__all__ = ["run_lab", "STABILIZER_SET", "FORMAT_POLICIES", "fix_candidates", "unrounded_output", "MAE_FACTOR",
           "DECOMPOSITION", "judge_fix", "judge_candidates", "verdict_over"]

# components raised to fp32 one at a time: where the bias enters
DECOMPOSITION = {
    "PV product": {"pv": "fp32"},
    "O accumulator": {"o_accum": "fp32"},
    "PV + O accumulator": {"pv": "fp32", "o_accum": "fp32"},
    "statistics m, l": {"stats": "fp32"},
    "PV + O acc. + statistics": {"pv": "fp32", "o_accum": "fp32", "stats": "fp32"},
    "row sum from rounded Pbar": {"row_sum_rounded": True},
    "delta product and sum": {"delta_product": "fp32", "delta": "fp32"},
    "O left unrounded (fp32 output; floor likewise)": {"output": "fp32"},
    "row sum from rounded Pbar, O unrounded": {"row_sum_rounded": True, "output": "fp32"},
}


def _conditions(quick: bool, seed: int, n: int) -> dict[str, list[Problem]]:
    base = Problem(n_rows=n, seed=seed)
    ties = [replace(base, ties=k, tail=tl) for k in (2, 3, 8) for tl in (0.25, 4.0)]
    ties.append(replace(base, ties=16, t=1024, tail=0.25))   # two 512-tiles: O accumulated across them
    if not quick:
        ties += [replace(base, ties=16, t=1024, tail=4.0), replace(base, ties=4, tail=1.0)]
    others = [replace(base, ties=2, v_mean=1.0, do_mean=0.5),      # V mostly positive: signs flip
              replace(base, ties=2, sink=True, rows=16),             # one sink per instance: unit = instance
              replace(base, ties=2, offset=100.0)]                 # large logits: coarse bf16 scores
    no_ties = [replace(base, ties=1, tail=tl) for tl in (0.25, 4.0)]
    return {"ties": ties, "others": others, "no_ties": no_ties}


class _Cells:
    """The lab's measurements in the order they are made: each cell measured on the shared bench
    and appended to ``rows`` under its experiment's name."""

    def __init__(self):
        self.bench, self.rows = Bench(), []

    def __call__(self, p: Problem, a, experiment: str) -> Measurement:
        m = self.bench.measure(p, a)
        self.rows.append({"experiment": experiment, **m.to_dict()})
        return m


def run_lab(quick: bool = False, precision: str = "paper", seed: int = 0, progress=None,
            n_rows: int | None = None, captured=None) -> dict:
    """Run every experiment; ``precision`` is the arithmetic the study's facts (i)-(iii) are tested in;
    ``n_rows`` (default 1,024 quick, 3,072 full) the independent rows per condition; ``captured``
    (a list of ``captured.CapturedProblem``) adds the same measurement on real attention inputs."""
    n = n_rows or (1024 if quick else 3072)
    if n < 32:
        raise ValueError(f"run_lab: n_rows must be >= 32, got {n}")
    t0 = time.perf_counter()
    cell = _Cells()
    say = progress or (lambda msg: None)
    conds = _conditions(quick, seed, n)
    verdicts, details = {}, {}
    say("(i) tie bias")
    verdicts["i_tie_bias"], details["i_tie_bias"] = _fact_i_tie_bias(cell, precision, conds)
    say("(ii) no ties")
    verdicts["ii_no_ties_no_bias"], details["ii_no_ties_no_bias"] = _fact_ii_no_ties(cell, precision, conds)
    say("(iii) the study's fix")
    for key, (verdict, notes) in _fact_iii_study_fix(cell, precision, conds).items():
        verdicts[key], details[key] = verdict, notes
    verdicts["iv_worked_example"], details["iv_worked_example"] = _fact_iv_worked_example(precision)
    say("arithmetics and fixes")
    answers = _answers(cell, conds, say)
    say("decomposition")
    _decomposition(cell, conds)
    say("PR #2721")
    _pr2721(cell, n, seed)
    out_captured = None
    if captured:
        from .captured import run_captured
        say("captured problems")
        out_captured = run_captured(captured, FORMAT_POLICIES, bench=cell.bench, progress=say)

    return {"quick": quick, "policy": precision, "seed": seed, "n_rows": n, "captured": out_captured, "runtime_s": time.perf_counter() - t0,
            "versions": {"torch": torch.__version__}, "unit_note": "one value per independent row "
            "(per instance for sink problems); leans judged against the fp32 floor, paired",
            "rows": cell.rows, "verdicts": verdicts, "details": details, "answers": answers}


def _fact_i_tie_bias(cell: _Cells, precision: str, conds: dict) -> tuple[str, list[str]]:
    """(i) tied maxima + mostly negative V (every tied condition): O leans negative beyond the floor, delta positive."""
    flags, notes = {}, []
    for c in conds["ties"]:
        m = cell(c, Arithmetic.of(precision), "i")
        flags[c.label()] = (m.o_leans and m.o_vs_floor.mean < 0) and (m.delta_leans and m.delta_vs_floor.mean > 0)
        notes.append(f"{c.label()}: O {_o(m)}, delta {_delta(m)}"
                     f" [tail {m.tail_half_ulps:.2f} half-ulps]")
    return verdict_over(flags), notes


def _fact_ii_no_ties(cell: _Cells, precision: str, conds: dict) -> tuple[str, list[str]]:
    """(ii) without ties there is no lean."""
    flags, notes = {}, []
    for c in conds["no_ties"]:
        m = cell(c, Arithmetic.of(precision), "ii")
        flags[c.label()] = not _leans(m)
        notes.append(f"{c.label()}: O {_o(m)}, delta {_delta(m)}")
    return verdict_over(flags), notes


def _fact_iii_study_fix(cell: _Cells, precision: str, conds: dict) -> dict[str, tuple[str, list[str]]]:
    """(iii) the study's fix removes the lean where there is one (beta = 2 and 7): key -> (verdict, notes)."""
    out = {}
    for stab, key in (("paper", "iii_paper_fix_beta2"), ("paper:beta=7", "iii_paper_fix_beta7")):
        flags, notes = {}, []
        for c in conds["ties"] + conds["others"]:
            plain = cell(c, Arithmetic.of(precision), "iii")
            fixed = cell(c, Arithmetic.of(precision, stab), "iii")
            if _leans(plain):
                flags[c.label()] = not _leans(fixed) and not fixed.bad_rows
                notes.append(f"{c.label()}: none O {_o(plain)} -> {fixed.stabilizer} O {_o(fixed)}, "
                             f"delta {_delta(fixed)}"
                             + (f", {fixed.bad_rows} bad rows" if fixed.bad_rows else ""))
        out[key] = (verdict_over(flags), notes or ["no condition leans without the fix: nothing to remove"])
    return out


def _fact_iv_worked_example(precision: str) -> tuple[str, list[str]]:
    """(iv) the worked example, in the format the policy stores the PV sum in."""
    fmt = get_policy(precision).pv
    x = torch.tensor([-4.703990459442139], dtype=torch.float64)
    r = round_to(x, fmt).item()
    return ("held" if r == -4.71875 else "not held",
            [f"-4.703990459442139 rounds to {r!r} in {fmt} (study: -4.71875 in bf16; error {r - x.item():+.6f})"])


def _answers(cell: _Cells, conds: dict, say) -> dict:
    """Every shipped arithmetic: is it biased under ties, and what removes it."""
    answers = {}
    leaning = conds["ties"] + conds["others"]
    all_conds = leaning + conds["no_ties"]
    for pol in FORMAT_POLICIES:
        say(f"  {pol}")
        plain, removed_by, failures = judge_candidates(pol, all_conds, lambda c, a: cell(c, a, "fixes"))
        biased = [c.label() for c in leaning if _leans(plain[c])]
        if biased:
            line = (f"biased under ties: yes ({len(biased)} of {len(leaning)} conditions); "
                    f"removed by: {', '.join(removed_by) if removed_by else 'nothing the lab tried'}")
        else:
            line = ("biased under ties: no; nothing to fix (no stabilizer needed); harmless candidates: "
                    + (", ".join(removed_by) if removed_by else "none"))
        answers[pol] = {"line": line, "biased_conditions": biased, "removed_by": removed_by, "failures": failures}
        if biased and not removed_by:
            say(f"  {pol}, O unrounded")
            _answer_unrounded(cell, pol, answers[pol], leaning, all_conds)
    return answers


def _answer_unrounded(cell: _Cells, pol: str, answer: dict, leaning: list, all_conds: list) -> None:
    """Nothing removes ``pol``'s lean at the output format: judge the arithmetic's own error before
    O's one rounding (output fp32, floor likewise), to tell a lean of the arithmetic from one of the
    output rounding of a perturbed O (e.g. O near the binade edges of a coarse V grid)."""
    plain_u, removed_u, failures_u = judge_candidates(unrounded_output(pol), all_conds,
                                                      lambda c, a: cell(c, a, "fixes-unrounded"))
    biased_u = [c.label() for c in leaning if _leans(plain_u[c])]
    answer["unrounded"] = {"biased_conditions": biased_u, "removed_by": removed_u, "failures": failures_u}
    answer["line"] += (f"; before O's one rounding to {get_policy(pol).output}: biased "
                       + (f"yes ({len(biased_u)} of {len(leaning)}), removed by: "
                          f"{', '.join(removed_u) if removed_u else 'nothing the lab tried'}"
                          if biased_u else "no"))


def _decomposition(cell: _Cells, conds: dict) -> None:
    """Where the bias enters: one component at a time raised to fp32 (DECOMPOSITION), in paper and fa2-e4m3."""
    decomp_conds = [c for c in conds["ties"] if c.ties in (2, 8)][:4]
    for pol in ("paper", "fa2-e4m3"):
        for c in decomp_conds:
            cell(c, Arithmetic.of(pol), "decomposition")
            for changes in DECOMPOSITION.values():
                base = get_policy(pol)
                if all(getattr(base, f) == v or str(getattr(base, f)) == v for f, v in changes.items()):
                    continue  # already so in this arithmetic
                cell(c, Arithmetic.of(base.replace(**changes)), "decomposition")


def _pr2721(cell: _Cells, n: int, seed: int) -> None:
    """FlashAttention PR #2721: the row sum l from the unrounded Pbar vs from the rounded one."""
    base = Problem(n_rows=n, seed=seed)
    for c in (replace(base, ties=1, tail=4.0, v_mean=1.0, v_sd=0.0, do_mean=0.5), replace(base, ties=1, tail=4.0)):
        for pol in ("fa2", "fa2[row_sum_rounded=true]", "fa2-e4m3", "fa2-e4m3[row_sum_rounded=true]"):
            cell(c, Arithmetic.of(pol), "pr2721")
