"""Outcomes of the LR-sensitivity runs, each arithmetic's curve over the lr grid, and the verdicts.

Definitions, fixed before any result was seen (the unit is one seed's set of runs: a seed's
curve of an arithmetic is its runs at every lr of the grid, same weights and batches):

* **final loss** of a run that finished its steps: the mean training loss over the last 5% of
  its steps (at least one step), smoother than the last step's loss; the same batches at every
  lr and arithmetic of a seed, so curves are compared on identical data. The validation loss at
  the last step is reported next to it, not judged.
* **l0**, the loss at initialisation: the measured training loss at step 0 (before any update,
  so identical at every lr of a seed and arithmetic; the median over its runs is taken).
* a **diverged** run (the package's one rule, flashguard.train.divergence, via the shared run
  summary; the trainer stops it there) counts as l0; a finished run counts as min(final loss, l0).
* **l\\*** the best counted loss of the curve, at the **best lr** (the smaller lr on a tie).
* **LR sensitivity** (Wortsman et al. 2023): the mean over the lr grid of min(l(lr), l0) - l\\*.
* a run **trains** if it finished without diverging and its final loss is below l0 and at most
  l0 - 0.5 (l0 - l\\*): it got at least half of the way from initialisation to the curve's best.
  The **largest trainable lr** is the largest lr of the grid whose run trains (none: every run
  failed).
* a curve is **complete** when every run of it finished (done or diverged); the sensitivity, the
  best and the largest trainable lr are computed on complete curves only.

Comparing arithmetic A with the reference R at one seed: A is **worse** if its largest trainable
lr is below R's (none is below every lr) or its sensitivity exceeds R's by more than 5% of R's
range l0 - l\\* (smaller differences are read as equal); A **restores** R's behaviour if it is
not worse.

* L1 "bf16 flash (paper) lowers the largest trainable lr or raises the LR sensitivity relative
  to fp32": held if paper is worse than fp32 at every seed; not held if at no seed; else
  inconclusive (the seeds disagree), as it is while any curve it reads is incomplete.
* L2, L3, ... "FIX restores it" (each fix separately): inconclusive unless L1 held (nothing to
  restore); then held if the fix is not worse than fp32 at every seed, not held if it is worse
  at every seed, inconclusive if the seeds disagree or a curve is incomplete.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from ... import keys
from ...utils.jsonl import read_jsonl
from ..runs import summarize_run

__all__ = ["HELD", "NOT_HELD", "INCONCLUSIVE", "FINAL_WINDOW", "TRAINS_FRACTION", "SENSITIVITY_TOLERANCE",
           "HARM_CLAIM", "run_outcome", "final_loss", "curve", "mean_curve", "compare", "judge_harm",
           "judge_fix", "rules_text"]

HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"
FINAL_WINDOW = 0.05            # final loss: mean training loss over this fraction of the last steps
TRAINS_FRACTION = 0.5          # a run trains when it gets this far from l0 towards l*
SENSITIVITY_TOLERANCE = 0.05   # sensitivity differences below this fraction of the reference's l0 - l* are equal
HARM_CLAIM = ("L1", "bf16 flash (paper) lowers the largest trainable lr or raises the LR sensitivity relative to fp32")
FINISHED = ("done", "diverged")


def final_loss(records, steps: int) -> float | None:
    """The mean training loss over the last ceil(FINAL_WINDOW x steps) steps (at least one) of a
    run's metrics records; None when none of those steps is logged or one is non-finite."""
    window = max(1, math.ceil(FINAL_WINDOW * steps))
    losses = [r[keys.LOSS_TRAIN] for r in records
              if keys.LOSS_TRAIN in r and r.get(keys.STEP) is not None and r[keys.STEP] >= steps - window]
    if not losses or not all(math.isfinite(x) for x in losses):
        return None
    return sum(losses) / len(losses)


def run_outcome(run_dir: str | Path, steps: int) -> dict:
    """One run: status (done | diverged | partial | missing, summarize_run's), diverged_at and its
    reason, initial_loss (step 0), final_loss (done runs only), last_val, steps done, wall_s."""
    s = summarize_run(run_dir, steps)
    recs = read_jsonl(Path(run_dir) / "metrics.jsonl")
    first = next((r[keys.LOSS_TRAIN] for r in recs if r.get(keys.STEP) == 0 and keys.LOSS_TRAIN in r), None)
    return {"status": s["status"], "steps": s["steps"], "diverged_at": s["diverged_at"],
            "divergence": s["divergence"],
            "initial_loss": first if first is not None and math.isfinite(first) else None,
            "final_loss": final_loss(recs, steps) if s["status"] == "done" else None,
            "last_val": s["last_val"], "wall_s": s["wall_s"]}


def curve(outcomes: dict, lrs) -> dict:
    """One seed's curve of one arithmetic. outcomes: {lr: run_outcome}. Returns {"complete", "l0",
    "points": [{"lr", "status", "final_loss", "counted", "trains", "diverged_at"}], "best_lr",
    "best_loss", "sensitivity", "threshold" (the trains rule's loss bound), "largest_trainable_lr",
    "missing": [lrs not finished]}."""
    lrs = sorted(float(x) for x in lrs)
    missing_run = {"status": "missing", "final_loss": None, "initial_loss": None, "diverged_at": None}
    runs = {lr: outcomes.get(lr, missing_run) for lr in lrs}
    firsts = [o["initial_loss"] for o in runs.values() if o.get("initial_loss") is not None]
    l0 = statistics.median(firsts) if firsts else None
    missing = [lr for lr, o in runs.items() if o["status"] not in FINISHED]
    complete = not missing and l0 is not None
    points = []
    for lr, o in runs.items():
        if o["status"] == "diverged":
            counted = l0
        elif o["status"] == "done" and o["final_loss"] is not None and l0 is not None:
            counted = min(o["final_loss"], l0)
        elif o["status"] == "done" and l0 is not None:  # finished but no finite final loss: a failed run
            counted = l0
        else:
            counted = None
        points.append({"lr": lr, "status": o["status"], "final_loss": o["final_loss"], "counted": counted,
                       "diverged_at": o["diverged_at"], "trains": None})
    out = {"complete": complete, "l0": l0, "points": points, "best_lr": None, "best_loss": None,
           "sensitivity": None, "threshold": None, "largest_trainable_lr": None, "missing": missing}
    if not complete:
        return out
    best = min(points, key=lambda p: (p["counted"], p["lr"]))
    star = best["counted"]
    threshold = l0 - TRAINS_FRACTION * (l0 - star)
    for p in points:
        p["trains"] = (p["status"] == "done" and p["final_loss"] is not None and p["final_loss"] < l0
                       and p["final_loss"] <= threshold)
    out.update(best_lr=best["lr"], best_loss=star, threshold=threshold,
               sensitivity=sum(p["counted"] - star for p in points) / len(points),
               largest_trainable_lr=max((p["lr"] for p in points if p["trains"]), default=None))
    return out


def mean_curve(curves: list[dict]) -> dict:
    """The mean over seeds of one arithmetic's curves: per-lr mean counted loss (None where a seed's
    run is unfinished), mean l0, l*, sensitivity (None unless every curve is complete), and the
    per-seed largest trainable lrs."""
    lrs = [p["lr"] for p in curves[0]["points"]] if curves else []

    def mean(xs):
        return None if not xs or any(x is None for x in xs) else sum(xs) / len(xs)

    return {"complete": bool(curves) and all(c["complete"] for c in curves),
            "counted": [mean([c["points"][i]["counted"] for c in curves]) for i in range(len(lrs))],
            "diverged": [sum(c["points"][i]["status"] == "diverged" for c in curves) for i in range(len(lrs))],
            "lrs": lrs, "seeds": len(curves),
            "l0": mean([c["l0"] for c in curves]), "best_loss": mean([c["best_loss"] for c in curves]),
            "sensitivity": mean([c["sensitivity"] for c in curves]),
            "largest_trainable_lr": [c["largest_trainable_lr"] for c in curves]}


def _below(a: float | None, b: float | None) -> bool:
    """a < b for largest trainable lrs, where None (nothing trains) is below every lr."""
    if a is None:
        return b is not None
    return b is not None and a < b


def compare(c: dict, ref: dict) -> dict:
    """Arithmetic curve ``c`` against the reference curve ``ref`` at one seed (both complete):
    lower_lr, sens_diff (c - ref), tolerance, higher_sens, worse."""
    tol = SENSITIVITY_TOLERANCE * (ref["l0"] - ref["best_loss"])
    diff = c["sensitivity"] - ref["sensitivity"]
    lower = _below(c["largest_trainable_lr"], ref["largest_trainable_lr"])
    return {"largest": c["largest_trainable_lr"], "largest_ref": ref["largest_trainable_lr"], "lower_lr": lower,
            "sensitivity": c["sensitivity"], "sensitivity_ref": ref["sensitivity"], "sens_diff": diff,
            "tolerance": tol, "higher_sens": diff > tol, "worse": lower or diff > tol}


def _lr(x) -> str:
    return "none" if x is None else f"{x:.3g}"


def _seed_text(seed, name, ref, cmp) -> str:
    return (f"seed {seed}: {name} largest trainable lr {_lr(cmp['largest'])} vs {ref} {_lr(cmp['largest_ref'])}, "
            f"sensitivity {cmp['sensitivity']:.3f} vs {cmp['sensitivity_ref']:.3f} "
            f"(diff {cmp['sens_diff']:+.3f}, tolerance {cmp['tolerance']:.3f})")


def _incomplete(curves: dict, seeds, names) -> list[str]:
    return [f"seed {s} {n}: runs at lr {', '.join(_lr(x) for x in curves[(s, n)]['missing']) or '(l0 unknown)'} "
            f"unfinished" for s in seeds for n in names if not curves[(s, n)]["complete"]]


def _per_seed(curves, seeds, name, ref) -> dict:
    return {s: compare(curves[(s, name)], curves[(s, ref)]) for s in seeds}


def _claim_result(claim_id: str, title: str, reference: str, arithmetic: str):
    """The verdict record of one claim comparing ``arithmetic`` with ``reference``."""
    def result(verdict, evidence, per_seed=None):
        return {"id": claim_id, "title": title, "verdict": verdict, "evidence": evidence,
                "numbers": {"reference": reference, "arithmetic": arithmetic,
                            "per_seed": {str(s): c for s, c in (per_seed or {}).items()}}}
    return result


def judge_harm(curves: dict, seeds, *, reference: str = "fp32", harmed: str = "paper") -> dict:
    """L1 from the curves {(seed, arithmetic name): curve}."""
    result = _claim_result(HARM_CLAIM[0], HARM_CLAIM[1], reference, harmed)

    open_ = _incomplete(curves, seeds, (reference, harmed))
    if open_:
        return result(INCONCLUSIVE, "; ".join(open_))
    per = _per_seed(curves, seeds, harmed, reference)
    text = "; ".join(_seed_text(s, harmed, reference, c) for s, c in per.items())
    worse = [s for s, c in per.items() if c["worse"]]
    if len(worse) == len(per):
        return result(HELD, f"{harmed} worse than {reference} at every seed: {text}", per)
    if not worse:
        return result(NOT_HELD, f"{harmed} not worse than {reference} at any seed: {text}", per)
    return result(INCONCLUSIVE, f"seeds disagree ({harmed} worse at seed {', '.join(map(str, worse))} only): {text}",
                  per)


def judge_fix(curves: dict, seeds, harm: dict, *, fix: str, label: str, claim_id: str,
              reference: str = "fp32") -> dict:
    """L2, L3, ...: does ``fix`` restore the reference's behaviour? ``harm``: L1's verdict."""
    result = _claim_result(claim_id, f"{label} restores it (not worse than {reference})", reference, fix)

    open_ = _incomplete(curves, seeds, (reference, fix))
    if open_:
        return result(INCONCLUSIVE, "; ".join(open_))
    per = _per_seed(curves, seeds, fix, reference)
    text = "; ".join(_seed_text(s, fix, reference, c) for s, c in per.items())
    if harm["verdict"] != HELD:
        return result(INCONCLUSIVE, f"nothing to restore: {harm['id']} is {harm['verdict']}; {text}", per)
    worse = [s for s, c in per.items() if c["worse"]]
    if not worse:
        return result(HELD, f"{fix} not worse than {reference} at any seed: {text}", per)
    if len(worse) == len(per):
        return result(NOT_HELD, f"{fix} worse than {reference} at every seed: {text}", per)
    return result(INCONCLUSIVE, f"seeds disagree ({fix} worse at seed {', '.join(map(str, worse))} only): {text}",
                  per)


def rules_text() -> str:
    """The definitions and verdict rules, as the Markdown states them."""
    return (f"Final loss: mean training loss over the last {FINAL_WINDOW:.0%} of the steps (same batches at every "
            "lr and arithmetic of a seed). l0: the measured training loss at step 0 (before any update). "
            "A diverged run (the package's divergence rule) counts as l0, a finished one as min(final loss, l0). "
            "l*: the curve's best counted loss. LR sensitivity (Wortsman et al. 2023): mean over the lr grid of "
            "min(l(lr), l0) - l*. A run trains if it finished without diverging and its final loss is below l0 and "
            f"at most l0 - {TRAINS_FRACTION:g} (l0 - l*); the largest trainable lr is the largest lr whose run "
            "trains. The unit is one seed's curve. An arithmetic is worse than fp32 at a seed if its largest "
            "trainable lr is lower or its sensitivity is higher by more than "
            f"{SENSITIVITY_TOLERANCE:.0%} of fp32's l0 - l*. L1 held: paper worse at every seed; not held: at no "
            "seed; else inconclusive (seeds disagree, or a curve is unfinished). Each fix (L2, L3): inconclusive "
            "unless L1 held; held: not worse than fp32 at every seed; not held: worse at every seed; else "
            "inconclusive.")
