"""The rounding-bias lab: the study's arithmetic facts as experiments with verdicts, and the
open questions as tables. Every verdict is computed from the measurements of the run.

    from flashguard.experiments.lab import run_lab
    result = run_lab(quick=True)                 # dict: rows, verdicts, tables
    result = run_lab(quick=True, policy="fp32")  # the same experiments in fp32: "not held"

Verdicts: "held" when the claim holds in every condition of the experiment, "not held" when
it holds in none, "inconclusive" otherwise (the breakdown says where). A condition is
"biased +/-" when the sign test over instances gives p < 0.01, |bias ratio| >= 0.05 and the
95% CI of the mean error excludes 0 (stats.ErrorStats).
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch

from ...numerics import BF16, get_policy, round_to
from .measure import Measurement, measure
from .problems import Problem

__all__ = ["run_lab", "STABILIZER_SET", "FORMAT_POLICIES"]

STABILIZER_SET = ["none", "paper", "paper:beta=7", "safe"]
FORMAT_POLICIES = ["paper", "fa2", "fa2-fp16", "fa2-e4m3", "fa2-e5m2"]


def _verdict(flags: list[bool]) -> str:
    if flags and all(flags):
        return "held"
    if not any(flags):
        return "not held"
    return "inconclusive"


class _Lab:
    def __init__(self, quick: bool, seed: int, instances: int | None = None):
        self.base = Problem(n=instances or (32 if quick else 128), t=128 if quick else 256, seed=seed)
        self.rows: list[dict] = []
        self._cache: dict = {}

    def run(self, problem: Problem, policy: str, stabilizer: str, experiment: str) -> Measurement:
        key = (problem, policy, stabilizer)
        if key not in self._cache:
            self._cache[key] = measure(problem, policy, stabilizer)
        m = self._cache[key]
        self.rows.append({"experiment": experiment, **m.to_dict()})
        return m

    def cond(self, **kw) -> Problem:
        return replace(self.base, **kw)


def run_lab(quick: bool = False, policy: str = "paper", seed: int = 0, progress=None,
            instances: int | None = None) -> dict:
    """Run every experiment; ``policy`` is the arithmetic the study's facts are tested in;
    ``instances`` overrides the number of independent problem instances per condition."""
    t0 = time.perf_counter()
    lab = _Lab(quick, seed, instances)
    say = progress or (lambda msg: None)
    verdicts, details = {}, {}
    ks = [2, 3, 4, 8]
    gaps = [8.0] if quick else [4.0, 8.0, 12.0]
    tie_conditions = [lab.cond(ties=k, gap=g) for k in ks for g in gaps]

    # (i) tied maxima + mostly negative V: O biased negative, delta error biased positive
    say("(i) tie bias")
    flags, notes = [], []
    for c in tie_conditions:
        m = lab.run(c, policy, "none", "i")
        ok = m.o.verdict == "biased -" and m.delta.verdict == "biased +"
        flags.append(ok)
        notes.append(f"{c.label()}: O {m.o.verdict} ({m.o.bias_ratio:+.2f}), delta {m.delta.verdict} "
                     f"({m.delta.bias_ratio:+.2f})")
    verdicts["i_tie_bias"], details["i_tie_bias"] = _verdict(flags), notes

    # (ii) without ties the bias vanishes
    say("(ii) no ties")
    flags, notes = [], []
    for g in gaps:
        c = lab.cond(ties=1, gap=g)
        m = lab.run(c, policy, "none", "ii")
        flags.append(m.o.verdict == "no bias" and m.delta.verdict == "no bias")
        notes.append(f"{c.label()}: O {m.o.verdict} ({m.o.bias_ratio:+.2f}), delta {m.delta.verdict}")
    verdicts["ii_no_ties_no_bias"], details["ii_no_ties_no_bias"] = _verdict(flags), notes

    # (iii) the paper's stabilizer removes it, beta = 2 and beta = 7, across k and max-logit size;
    # judged where the unstabilized run is biased (elsewhere there is nothing to remove)
    say("(iii) paper stabilizer")
    logit_sizes = [1.0, 8.0] if quick else [1.0, 8.0, 32.0]
    conds = tie_conditions + [lab.cond(ties=2, gap=8.0, max_logit=x) for x in logit_sizes if x != 1.0]
    for beta, key in (("paper", "iii_paper_fix_beta2"), ("paper:beta=7", "iii_paper_fix_beta7")):
        flags, notes = [], []
        for c in conds:
            plain = lab.run(c, policy, "none", "iii")
            fixed = lab.run(c, policy, beta, "iii")
            if plain.o.biased or plain.delta.biased:
                flags.append(not fixed.o.biased and not fixed.delta.biased)
                notes.append(f"{c.label()}: none {plain.o.verdict} ({plain.o.bias_ratio:+.2f}) -> {beta} "
                             f"{fixed.o.verdict} ({fixed.o.bias_ratio:+.2f}), delta {fixed.delta.verdict}")
        verdicts[key] = _verdict(flags) if flags else "inconclusive"
        details[key] = notes or ["no condition was biased without the stabilizer"]

    # (iv) the worked example: the exact sum -4.703990459442139 rounds to -4.71875 in bf16;
    # evaluated in the format the policy stores the PV sum in
    fmt = get_policy(policy).pv
    x = torch.tensor([-4.703990459442139], dtype=torch.float64)
    r = round_to(x, fmt).item()
    verdicts["iv_worked_example"] = "held" if r == -4.71875 else "not held"
    details["iv_worked_example"] = [f"-4.703990459442139 rounds to {r!r} in {fmt} (study: -4.71875 in bf16; "
                                    f"error {r - x.item():+.6f})"]

    # open question: bias by format (production structure), with and without safe
    say("formats")
    fmt_table = []
    for c in [lab.cond(ties=k, gap=8.0) for k in (1, 2, 4)]:
        for pol in FORMAT_POLICIES:
            for stab in ("none", "safe"):
                m = lab.run(c, pol, stab, "formats")
                fmt_table.append(m)

    # open question: which stabilizer removes it where (reference vs production arithmetic)
    say("stabilizers")
    stab_conds = [lab.cond(ties=k, gap=g) for k in (1, 2, 4, 8) for g in ((4.0, 8.0) if quick else (2.0, 4.0, 8.0, 12.0))]
    stab_conds += [lab.cond(ties=2, gap=8.0, max_logit=x) for x in logit_sizes if x != 1.0]
    stab_conds += [lab.cond(ties=2, gap=8.0, sink=True), lab.cond(ties=2, gap=8.0, max_spread=2.0),
                   lab.cond(ties=4, gap=8.0, max_spread=2.0)]
    for pol in ("paper", "fa2"):
        for c in stab_conds:
            for stab in STABILIZER_SET:
                lab.run(c, pol, stab, "stabilizers")

    # criterion for safe: within noise wherever paper beta=2 is, and no bias where none had none
    crit_flags, crit_notes = [], []
    for pol in ("paper", "fa2"):
        for c in stab_conds:
            none_, p2, safe = (lab._cache[(c, pol, s)] for s in ("none", "paper", "safe"))
            ok = True
            if not p2.o.biased and safe.o.biased:
                ok = False
                crit_notes.append(f"{pol} {c.label()}: paper beta=2 {p2.o.verdict}, safe {safe.o.verdict} "
                                  f"({safe.o.bias_ratio:+.2f})")
            if not none_.o.biased and safe.o.biased:
                ok = False
                crit_notes.append(f"{pol} {c.label()}: none unbiased, safe {safe.o.verdict} ({safe.o.bias_ratio:+.2f})")
            crit_flags.append(ok)
    verdicts["safe_criterion"] = _verdict(crit_flags)
    details["safe_criterion"] = crit_notes or ["safe is unbiased wherever paper beta=2 or no stabilizer is"]

    # open question: FlashAttention PR #2721 - l sums the unrounded Pbar, the numerator the rounded
    say("PR #2721")
    pr_rows = []
    for c in [lab.cond(ties=1, gap=2.0, v_mean=1.0, v_sd=0.0, do_corr=0.0),
              lab.cond(ties=1, gap=2.0, v_mean=-1.0, v_sd=0.5)]:
        for pol in ("fa2", "fa2[row_sum_rounded=true]", "fa2-e4m3", "fa2-e4m3[row_sum_rounded=true]"):
            pr_rows.append(lab.run(c, pol, "none", "pr2721"))

    return {"quick": quick, "policy": policy, "seed": seed, "runtime_s": time.perf_counter() - t0,
            "versions": {"torch": torch.__version__}, "rows": lab.rows, "verdicts": verdicts, "details": details}
