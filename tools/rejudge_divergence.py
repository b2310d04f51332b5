"""Re-judge the committed experiment documents with the divergence rule of issue 23, as far as the
committed data allows, without training anything.

    PYTHONPATH=src python tools/rejudge_divergence.py [--docs docs]

The rule (flashguard.train.divergence) gained two tests: a loss at or above the run's initial loss
once the warm-up (at least 20 steps) is over, and a gradient norm >= 10^3 x the median of the
warm-up's. The old tests are unchanged, so a run diverged before is diverged now (at the same step
or earlier) and only an undiverged run can change. What each test needs from a run, per step:

* initial loss: the losses at the steps after the warm-up, and the loss at step 0;
* gradient norm: the gradient norms of every step (the warm-up's median, and the later peaks).

The committed documents hold per-step losses only for docs/injection/tiny-cpu-decisive and no
per-step gradient norms anywhere (the runs' metrics.jsonl are not in the repository). So this
prints, per experiment, what is decided (exactly) and what is only bounded: a run whose peak
gradient norm is P can fire the gradient test only if its warm-up median is at most P / 1000.
Where the committed data cannot settle a verdict, it says on which runs the verdict rests. The
exact re-judgement is the experiment's own command rerun over its run folders: finished runs are
not trained again, only re-read with the rule.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flashguard.train.divergence import BASELINE_STEPS, GRAD_FACTOR  # noqa: E402


def _g(x) -> str:
    return "-" if x is None else f"{x:.3g}"


# ---- lr-sensitivity --------------------------------------------------------------------------

def _lr_claims(doc: dict, flip=()) -> dict:
    """The claims recomputed from the committed run outcomes; ``flip``: (seed, arithmetic, lr) of
    finished runs counted as diverged instead."""
    from flashguard.experiments.lr_sensitivity.analysis import curve, judge_fix, judge_harm
    lrs = doc["lrs"]
    names = [a["name"] for a in doc["arithmetics"]]
    labels = {a["name"]: a["label"] for a in doc["arithmetics"]}
    curves = {}
    for seed in doc["seeds"]:
        for n in names:
            outs = {}
            for r in doc["runs"]:
                if r["seed"] == seed and r["arithmetic"] == n:
                    o = {k: r[k] for k in ("status", "final_loss", "initial_loss", "diverged_at")}
                    if (seed, n, r["lr"]) in flip:
                        o.update(status="diverged", final_loss=None)
                    outs[r["lr"]] = o
            curves[(seed, n)] = curve(outs, lrs)
    harm = judge_harm(curves, doc["seeds"], reference=doc["reference"], harmed=doc["harmed"])
    claims = [harm] + [judge_fix(curves, doc["seeds"], harm, fix=f, label=labels[f], claim_id=f"L{k}",
                                 reference=doc["reference"]) for k, f in enumerate(doc["fixes"], 2)]
    return {c["id"]: c["verdict"] for c in claims}


def lr_sensitivity(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    committed = {c["id"]: c["verdict"] for c in doc["claims"]}
    again = _lr_claims(doc)
    assert again == committed, (path, again, committed)
    done = [r for r in doc["runs"] if r["status"] == "done"]
    above = [r for r in done if r["final_loss"] is not None and r["initial_loss"] is not None
             and r["final_loss"] >= r["initial_loss"]]
    worst = max(done, key=lambda r: r["final_loss"] - r["initial_loss"])
    out = [f"### {doc['preset']} ({path.parent.name}/{path.name})", "",
           f"Recomputed from the committed outcomes: {', '.join(f'{k} {v}' for k, v in again.items())} "
           "(as committed). "
           f"{sum(r['status'] == 'diverged' for r in doc['runs'])} runs diverged by the old rule stay diverged "
           "(counted as l0 whatever their step, so nothing computed from them changes). "
           f"Of the {len(done)} finished runs, {len(above)} ended (mean loss of the last 5 %) at or above "
           f"its initial loss; the closest: {worst['arithmetic']} seed {worst['seed']} lr {worst['lr']:g}, "
           f"{worst['final_loss']:.3f} against {worst['initial_loss']:.3f}. No gradient norm is committed, and "
           "no loss between step 0 and the last 5 %, so a finished run that rose above its initial loss on the "
           "way, or whose gradient norm exploded, cannot be excluded.", ""]
    pivotal = {}   # claim -> new verdict -> arithmetic -> [(seed, lr)]
    for r in done:
        v = _lr_claims(doc, flip={(r["seed"], r["arithmetic"], r["lr"])})
        for k in v:
            if v[k] != again[k]:
                pivotal.setdefault(k, {}).setdefault(v[k], {}).setdefault(r["arithmetic"], []).append(
                    (r["seed"], r["lr"]))
    if pivotal:
        out.append("The verdicts that rest on finished runs, and which: the verdict changes if any one of these "
                   "runs alone diverged by a new test.")
        for k, by_verdict in sorted(pivotal.items()):
            parts = []
            for verdict, by_arith in by_verdict.items():
                for arith, runs in by_arith.items():
                    seeds = sorted({s for s, _ in runs})
                    lrs = sorted({lr for _, lr in runs})
                    parts.append(f"{arith} ({len(runs)} run{'s' if len(runs) != 1 else ''}: seed "
                                 f"{', '.join(map(str, seeds))} at lr {', '.join(f'{x:g}' for x in lrs)}) -> {verdict}")
            out.append(f"- {k} {again[k]}: " + "; ".join(parts))
    else:
        out.append("No single finished run changes a verdict by diverging.")
    return out + [""]


# ---- injection ---------------------------------------------------------------------------------

def _injection_i1(doc: dict, diverged: set) -> str:
    """I1 recomputed with the runs named in ``diverged`` (seed, name) counted as diverged (step
    unknown: reported as -1)."""
    from flashguard.experiments.injection.analysis import cell_outcomes, judge_coherence
    summaries = {}
    for r in doc["runs"]:
        s = dict(r["summary"])
        if (r["seed"], r["name"]) in diverged and s["status"] != "diverged":
            s.update(status="diverged", diverged_at=-1)
        summaries.setdefault((r["column"], float(r["alpha"])), {})[r["seed"]] = s
    cells = cell_outcomes(summaries)
    cols = [c for c in doc["columns"] if c.startswith("coherent")]
    coherent = max(cols, key=lambda c: float(c.split("-p")[1]) if "-p" in c else 0.0)
    claim = judge_coherence(cells, doc["alphas"], coherent=coherent)
    text = f"{claim['verdict']} ({claim['evidence']})"
    return re.sub(r"diverged \(step [^,]+, ", "diverged (", text) if diverged else text


def injection(path: Path, warmup: int) -> tuple[list[str], dict]:
    doc = json.loads(path.read_text())
    committed = next(c for c in doc["claims"] if c["id"] == "I1")
    again = _injection_i1(doc, set())
    assert again.startswith(committed["verdict"]), (again, committed["verdict"])
    window = max(warmup, BASELINE_STEPS)
    out = [f"### {doc['preset']} ({path.parent.name}/{path.name}; warm-up {warmup} steps)", "",
           f"I1 as committed: {committed['verdict']}. Old-rule divergences: "
           f"{sum(r['summary']['status'] == 'diverged' for r in doc['runs'])} of {len(doc['runs'])} runs, unchanged.",
           ""]
    undiv = [r for r in doc["runs"] if r["summary"]["status"] == "done"]
    # initial-loss test, exactly, where the per-step losses are committed
    with_loss = [r for r in undiv if r.get("loss")]
    if with_loss:
        rows = []
        for r in with_loss:
            pts = sorted((int(s), float(x)) for s, x in r["loss"])
            l0 = pts[0][1]
            late = [(s, x) for s, x in pts if s >= window]
            hit = next((s for s, x in late if x >= l0), None)
            rows.append(f"{r['name']} (initial {l0:.3f}, highest from step {window} {max(x for _, x in late):.3f}: "
                        + (f"diverged at step {hit})" if hit is not None else "not fired)"))
        out.append(f"Initial-loss test, exact (per-step losses committed): " + "; ".join(rows) + ".")
    else:
        finals = [r["summary"]["final_loss"] for r in undiv if r["summary"]["final_loss"] is not None]
        out.append(f"Initial-loss test: no per-step losses committed; the finished runs' last losses are "
                   f"{min(finals):.2f}-{max(finals):.2f}, below the initial loss (not committed here; the micro "
                   "model's step-0 loss is 5.44 at seeds 1-2 in docs/lr-sensitivity, log 256 = 5.55), so it did not "
                   "fire at their last step. Before it: once a run's running minimum is below half its initial loss, "
                   "a loss at the initial loss would have fired the old test, so the new one can only have fired "
                   "earlier, between the end of the window and that point; those steps are not committed.")
    # gradient test, bounded by the peaks
    by_col = {}
    for r in undiv:
        by_col.setdefault(r["column"], []).append(r)
    rows = []
    for col, rs in sorted(by_col.items()):
        peaks = [r["summary"]["max_grad_norm"] for r in rs]
        rows.append(f"| {col} | {len(rs)} | {_g(min(peaks))} | {_g(max(peaks))} | {_g(min(peaks) / GRAD_FACTOR)} | "
                    f"{_g(max(peaks) / GRAD_FACTOR)} |")
    out += ["", "Gradient test, bounded: a finished, undiverged run can fire it only if its warm-up median "
            f"gradient norm (not committed) is at most its peak / {GRAD_FACTOR:g}, and only if that peak came at "
            f"step {BASELINE_STEPS} or later.", "",
            "| column | finished undiverged runs | smallest peak | largest peak | all can fire if each median <= "
            "| none fires if each median > |",
            "|---|---|---|---|---|---|", *rows, ""]
    return out, doc


def i1_scenario(doc: dict, warmup: int) -> list[str]:
    """I1 if the gradient test fired in the finished coherent runs of the I1 column at the smallest
    alpha where that makes a difference, and in no zero-mean or baseline run (what their peaks
    allow), computed by the injection analysis; with the runs it rests on and their bounds."""
    cols = [c for c in doc["columns"] if c.startswith("coherent")]
    col = max(cols, key=lambda c: float(c.split("-p")[1]))
    undiv = [r for r in doc["runs"] if r["summary"]["status"] == "done"]
    twins = [r for r in undiv if r["column"] == "zero-mean" or (r["column"] == "real" and r["alpha"] == 1.0)]
    p_tw = max(r["summary"]["max_grad_norm"] for r in twins)
    committed = _injection_i1(doc, set())
    base = {r["seed"]: r for r in doc["runs"] if r["name"] == "real-a1"}
    for alpha in sorted(doc["alphas"]):
        flip = [r for r in undiv if r["column"] == col and r["alpha"] == alpha]
        verdict = _injection_i1(doc, {(r["seed"], r["name"]) for r in flip})
        if flip and verdict.split(" ")[0] != committed.split(" ")[0]:
            break
    else:
        return [f"No set of {col} runs at one alpha changes I1 by diverging.", ""]
    rows = []
    for r in flip:
        pk = r["summary"]["max_grad_norm"]
        b = base.get(r["seed"])
        ratio = ""
        if b is not None and r.get("wq_norm"):
            at = {L: dict((int(st), v) for st, v in pts) for L, pts in r["wq_norm"].items()}
            ab = {L: dict((int(st), v) for st, v in pts) for L, pts in b["wq_norm"].items()}
            step = min(st for st in at[next(iter(at))] if st >= max(warmup, BASELINE_STEPS))
            worst = max(at[L][step] / ab[L][step] for L in at if step in ab.get(L, {}))
            ratio = f", W_Q at step {step} {worst:.3g}x the baseline's"
        rows.append(f"seed {r['seed']} (peak {pk:.3g}: median <= {pk / GRAD_FACTOR:.3g}{ratio})")
    return [f"What I1 rests on: if the gradient test fired in the finished {col} runs at alpha {alpha:g} -- "
            + "; ".join(rows) + " (W_Q at the first probe after the warm-up: how far the runaway had gone in "
            f"it) -- each needing its warm-up median at most its peak / {GRAD_FACTOR:g} and its "
            f"peak at step {BASELINE_STEPS} or later, and in no zero-mean or baseline run (their largest peak "
            f"{p_tw:.3g}: none can fire unless its warm-up median is below {p_tw / GRAD_FACTOR:.3g}), I1 would read: "
            f"{verdict}. Neither condition can be checked without the runs' gradient norms.", ""]


# ---- early warning -----------------------------------------------------------------------------

def early_warning(path: Path, grid: dict) -> list[str]:
    """The early-warning runs are the micro grid's: their peaks bound which could change class."""
    doc = json.loads(path.read_text())
    peak = {(r["seed"], r["name"]): r["summary"]["max_grad_norm"] for r in grid["runs"]}
    runs = doc["runs"]
    stable = [r for r in runs if not r["diverged"] and (r["arm"].startswith("zero-mean") or r["arm"] == "real-a1")]
    other = [r for r in runs if not r["diverged"] and r not in stable]
    p_st = max(peak[(r["seed"], r["arm"])] for r in stable)
    bands = [(10.0, None), (1.0, 10.0), (0.1, 1.0), (None, 0.1)]
    counts = []
    for lo, hi in bands:
        n = sum(1 for r in other if (lo is None or peak[(r["seed"], r["arm"])] / GRAD_FACTOR >= lo)
                and (hi is None or peak[(r["seed"], r["arm"])] / GRAD_FACTOR < hi))
        what = (f">= {lo:g}" if hi is None else f"< {hi:g}" if lo is None else f"in [{lo:g}, {hi:g})")
        counts.append(f"{n} with peak / {GRAD_FACTOR:g} {what}")
    c = doc["counts"]
    return [f"### early-warning ({path.parent.name}/{path.name})", "",
            f"Committed classes: {c['divergent']} divergent, {c['stable']} stable twins, {c['other']} other (the "
            "micro grid's 150 runs). Every number of the evaluation (hits, lead times, false alarms, calibrated "
            "thresholds, leading signals) is computed from the runs' per-step records at and before each divergence "
            "step; none of those records is committed, so nothing can be recomputed here. Bounds from the grid's "
            f"peak gradient norms: no stable twin can fire the gradient test unless its warm-up median was below "
            f"{p_st / GRAD_FACTOR:.3g} (peaks <= {p_st:.3g}), so the twins, and with them the thresholds calibrated "
            "on their false alarms, stay as committed unless one was; an 'other' run becomes divergent when its warm-up median is at "
            f"most its peak / {GRAD_FACTOR:g}: of the {len(other)}, " + ", ".join(counts) + ". The 26 divergent "
            "runs stay divergent; their divergence steps can only move earlier, shortening lead times.", ""]


# ---- repro --------------------------------------------------------------------------------------

def repro(path: Path) -> list[str]:
    doc = json.loads(path.read_text())
    rows = [f"{r['name']} {_g(r['summary']['max_grad_norm'])}" for r in doc["runs"]]
    peak = max(r["summary"]["max_grad_norm"] for r in doc["runs"])
    return [f"### {doc['preset']} ({path.parent.name}/{path.name})", "",
            f"Claims as committed: {', '.join(c['id'] + ' ' + c['verdict'] for c in doc['claims'])}. All "
            f"{len(doc['runs'])} runs finished undiverged; last losses "
            f"{min(r['summary']['final_loss'] for r in doc['runs']):.2f}-"
            f"{max(r['summary']['final_loss'] for r in doc['runs']):.2f}. Peak gradient norms: {', '.join(rows)}: "
            f"the gradient test can fire only where a warm-up median was at most {peak / GRAD_FACTOR:.3g}. "
            "No per-step loss or gradient norm is committed (the loss figure, figures/loss.png, draws every "
            "step's loss).", ""]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", default=str(ROOT / "docs"))
    args = p.parse_args(argv)
    docs = Path(args.docs)
    out = ["## LR sensitivity", ""]
    for f in sorted(docs.glob("lr-sensitivity/*/lr_sensitivity.json")):
        out += lr_sensitivity(f)
    out += ["## Injection", ""]
    lines, grid = injection(docs / "injection/micro-grid/injection.json", warmup=20)
    out += lines + i1_scenario(grid, 20)
    lines, decisive = injection(docs / "injection/tiny-cpu-decisive/injection.json", warmup=100)
    out += lines + i1_scenario(decisive, 100)
    out += ["## Early warning", ""] + early_warning(docs / "early-warning/early_warning.json", grid)
    out += ["## Repro claims", ""] + repro(docs / "repro/tiny-cpu/repro.json")
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
