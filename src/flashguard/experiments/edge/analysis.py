"""The edge experiment's rules: each arm's divergences, and the claims judged on them.

Unit: one seed's run (the seeds are independent draws of initial weights, batch order and, in
the injected arms, the injection's signs). An arm at one lr is k of n runs diverged (the one
divergence rule, flashguard.train.divergence) and the steps at which they diverged; a run that
trained to the end is censored at its last step.

Rules, fixed before any run:

* A claim compares its arm with another on the same seeds. Only seeds finished in both arms
  count; a claim with a seed unfinished in either is ``unfinished``.
* The count test is Fisher's exact test, one-sided in the claim's direction ("fewer": the arm
  diverges less often than the other; "more": more often).
* E0 (paper diverges more often than fp32) is the precondition, judged at p < 0.05. Without it
  there is no divergence to attribute and every other claim is ``inconclusive``.
* The other claims are one family: their Fisher p-values are Holm-adjusted, and a claim is
  ``held`` when its adjusted p < 0.05, else ``not held``.
* The log-rank test on the steps of divergence is reported beside each count test (two-sided p,
  and which arm diverges earlier): an arm that diverges as often but later shows there, but the
  verdict is the count's.
"""
from __future__ import annotations

import statistics

from ...utils.stats import fisher_one_sided, holm, log_rank

__all__ = ["LEVEL", "arm_summary", "judge_claims", "rules_text"]

LEVEL = 0.05
FINISHED = ("done", "diverged")


def rules_text() -> str:
    return ("Unit: one seed's run. A claim compares two arms on the seeds finished in both: Fisher's exact test, "
            "one-sided in the claim's direction, on the counts of diverged runs; E0 (paper diverges more often than "
            f"fp32) is the precondition at p < {LEVEL:g}, without which the others are inconclusive; the other claims "
            f"are one family, Holm-adjusted, held when the adjusted p < {LEVEL:g}. The log-rank test on the steps of "
            "divergence (runs that trained censored at their last step) is reported beside each, not judged.")


def arm_summary(outcomes: dict) -> dict:
    """One arm at one lr. outcomes: {seed: run_outcome}. Returns counts, the diverged seeds and
    steps, the median step of divergence and the mean final loss of the runs that trained."""
    done = {s: o for s, o in outcomes.items() if o["status"] in FINISHED}
    div = {s: o["diverged_at"] for s, o in done.items() if o["status"] == "diverged"}
    finals = [o["final_loss"] for o in done.values() if o["status"] == "done" and o["final_loss"] is not None]
    return {"finished": len(done), "seeds": len(outcomes), "diverged": len(div),
            "diverged_seeds": sorted(div), "diverged_steps": [div[s] for s in sorted(div)],
            "median_step": statistics.median(div.values()) if div else None,
            "mean_final_loss": sum(finals) / len(finals) if finals else None,
            "unfinished_seeds": sorted(s for s in outcomes if s not in done)}


def _times(outcomes: dict, seeds) -> tuple[list, list]:
    t, e = [], []
    for s in seeds:
        o = outcomes[s]
        diverged = o["status"] == "diverged"
        t.append(o["diverged_at"] if diverged and o["diverged_at"] is not None else o["steps"])
        e.append(diverged)
    return t, e


def _compare(claim, runs: dict) -> dict:
    """Fisher and log-rank of one claim on the seeds finished in both arms. runs: {arm: {seed: outcome}}."""
    a, b = runs[claim.arm], runs[claim.against]
    seeds = sorted(s for s in a if s in b)
    unfinished = [s for s in seeds if a[s]["status"] not in FINISHED or b[s]["status"] not in FINISHED]
    if unfinished or not seeds:
        return {"status": "unfinished", "unfinished_seeds": unfinished, "seeds": seeds}
    ka = sum(a[s]["status"] == "diverged" for s in seeds)
    kb = sum(b[s]["status"] == "diverged" for s in seeds)
    n = len(seeds)
    p = fisher_one_sided(ka, n, kb, n) if claim.direction == "fewer" else fisher_one_sided(kb, n, ka, n)
    lr = log_rank(*_times(a, seeds), *_times(b, seeds))
    return {"status": "tested", "seeds": seeds, "n": n, "arm_diverged": ka, "against_diverged": kb, "fisher_p": p,
            "logrank_p": lr["p"], "logrank_chi2": lr["chi2"],
            "earlier": {1: claim.arm, 2: claim.against, None: None}[lr["earlier"]]}


def judge_claims(claims, runs: dict, labels: dict) -> list[dict]:
    """Every claim's verdict by the module's rules. runs: {arm: {seed: run_outcome}} at one lr."""
    tests = {c.id: _compare(c, runs) for c in claims}
    gate = tests.get("E0")
    gate_held = gate is not None and gate["status"] == "tested" and gate["fisher_p"] < LEVEL
    family = [c.id for c in claims if c.id != "E0" and tests[c.id]["status"] == "tested"]
    adjusted = dict(zip(family, holm([tests[i]["fisher_p"] for i in family]))) if family else {}
    out = []
    for c in claims:
        t = tests[c.id]
        row = {"id": c.id, "title": c.title, "arm": c.arm, "against": c.against, "direction": c.direction, **t}
        if t["status"] != "tested":
            row.update(verdict="unfinished", evidence=f"seeds unfinished: {t['unfinished_seeds'] or 'all'}")
            out.append(row)
            continue
        counts = (f"{labels[c.arm]} {t['arm_diverged']}/{t['n']} vs {labels[c.against]} "
                  f"{t['against_diverged']}/{t['n']} diverged; Fisher one-sided p = {t['fisher_p']:.3g}")
        later = (f"; log-rank p = {t['logrank_p']:.3g}"
                 + (f", {labels[t['earlier']]} diverges earlier" if t["earlier"] else ""))
        if c.id == "E0":
            row["adjusted_p"] = t["fisher_p"]
            row["verdict"] = "held" if gate_held else "not held"
        elif gate is not None and not gate_held:
            row["adjusted_p"] = adjusted[c.id]
            row["verdict"] = "inconclusive"
            later += "; E0 not held: no divergence to attribute"
        else:
            row["adjusted_p"] = adjusted[c.id]
            row["verdict"] = "held" if adjusted[c.id] < LEVEL else "not held"
            counts += f" (Holm-adjusted {adjusted[c.id]:.3g})"
        row["evidence"] = counts + later
        out.append(row)
    return out
