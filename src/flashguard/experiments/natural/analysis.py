"""Outcomes of the natural-preconditions arms and the verdicts of claims N1-N5 (issue #12 item 4).

Definitions, fixed before the fix arms' results were read (the unit is one arm: one run of the
preset's config, every arm on the same seed and batches, differing in the attention arithmetic):

* an arm's **status** is the run summary (``runs.summarize_run``): ``diverged`` by the
  package's one divergence rule (flashguard.train.divergence, with the run's own factor, here 2;
  a step the trainer marked ``event/diverged`` counts), else ``done`` when it logged the
  preset's steps, ``partial`` (still training or stopped) before that, ``missing`` without a
  metrics.jsonl (the arm was not run).
* an arm's **delta lean** per layer is ``lean_across_probes(records, "delta")``: Stouffer's z
  over its probes' z of delta's error (numerics/delta_err_z/L*, each over (sequence, head)
  units; probes see different batches) with the lab's lean rule carried over: |z| >= 3.29 and a
  mean bias ratio of that sign >= the lab's minimum gives ``leans +`` / ``leans -``, significant
  with a smaller ratio ``weak``, else ``no lean``. O's is read alike and reported, not judged.
* where an arm's delta error is born, per layer (``split_across_probes``, reported, not judged):
  the part O's error carries and the part delta's own product and sum add, each with its
  Stouffer z across probes and its mean over tied rows (several Pbar == 1 in a tile) and the
  others (probes written before this split existed have none: the table is then left out).
* an arm that is incomplete is judged on the probes it has, and every verdict that reads it
  says so (its verdict may change as it trains on). An arm with no delta probe cannot be judged.

Claims (CLAIMS holds their titles; RULES their rules, as the Markdown states them):

* N1 held if some layer of ``paper`` leans + (verdict exactly "leans +"); not held if none does;
  inconclusive when ``paper`` is missing or has no delta probe.
* N2 held if no layer of ``fp32`` has a verdict starting "leans" (either sign; "weak" is not a
  lean); not held if one has; inconclusive when ``fp32`` is missing or has no delta probe.
* N3 (the lab's fix, ``paper-fp32fwd``), N4 (the study's fix, ``paper-fix``): inconclusive unless
  N1 held (nothing to remove) and the fix arm has a delta probe series at every layer where
  ``paper`` leans +; then held if the fix leans (verdict starting "leans") at none of those
  layers, not held if it leans at one. A lean of the fix elsewhere is reported, not judged.
  A preset without that fix arm (its role None, e.g. ``nat512-kernels``): "not applicable".
* N5 held if ``paper`` diverged, ``fp32`` finished its steps without diverging, and N1 held (a
  lean to attribute the divergence to); not held if ``paper`` finished its steps without
  diverging; else inconclusive (``paper`` unfinished, ``fp32`` missing or unfinished, both
  diverged: a divergence fp32 shares is not the lean's, or ``paper`` diverged without a lean).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from ... import keys
from ...diagnostics.across_probes import lean_across_probes, split_across_probes
from ...diagnostics.census_table import census_from_records
from ...train.config import load_config
from ...utils.jsonl import read_jsonl
from ..runs import summarize_run

__all__ = ["HELD", "NOT_HELD", "INCONCLUSIVE", "NOT_APPLICABLE", "CLAIMS", "RULES", "claim_texts", "arm_outcome", "missing_outcome", "run_config",
           "series_text", "judge_claims", "judge_lean_arises", "judge_control", "judge_fix", "judge_divergence",
           "matched_batches", "rules_text", "state_text"]

HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"
NOT_APPLICABLE = "not applicable"   # N3 / N4 of a preset without that fix arm
LEANS_PLUS = "leans +"      # N1's verdict: the study's sign
LEANS = "leans"             # N2-N4: a verdict starting with this (either sign)

_TITLES = {
    "N1": "a delta lean of the study's sign (positive) arises in real training in {harmed_what}",
    "N2": "{reference} attention shows no such lean (the control)",
    "N3": "the lab's fix{lab_fix_name} removes it in training",
    "N4": "the study's fix{study_fix_name} removes it in training",
    "N5": "the lean makes the run diverge at this scale",
}
_RULES = {
    "N1": "held if some layer of {harmed} has the across-probes delta verdict 'leans +'; not held if none has; "
          "inconclusive if {harmed} is not run or has no delta probe",
    "N2": "held if no layer of {reference} has a delta verdict starting 'leans' (either sign; 'weak' is not a lean); "
          "not held if one has; inconclusive if {reference} is not run or has no delta probe",
    "N3": "inconclusive unless N1 held and {lab_fix} has delta probes at every layer where {harmed} leans +; then "
          "held if {lab_fix} leans (verdict starting 'leans') at none of those layers, not held if at one",
    "N4": "as N3, with {study_fix}",
    "N5": "held if {harmed} diverged, {reference} finished without diverging and N1 held; not held if {harmed} "
          "finished without diverging; else inconclusive",
}
_NO_FIX = "not applicable: the preset has no arm of {what}"


def claim_texts(*, reference: str = "fp32", harmed: str = "paper", lab_fix: str | None = "paper-fp32fwd",
                study_fix: str | None = "paper-fix") -> tuple[dict, dict]:
    """(titles, rules) of N1-N5 with the preset's arms in their roles (a fix role None: its claim
    is not applicable). The defaults are nat512's roles: CLAIMS and RULES."""
    names = {"reference": reference, "harmed": harmed, "lab_fix": lab_fix, "study_fix": study_fix,
             "harmed_what": "the reference arithmetic (paper)" if harmed == "paper" else f"the {harmed} arm",
             "lab_fix_name": "" if lab_fix is None else f" ({lab_fix})",
             "study_fix_name": "" if study_fix is None else f" ({study_fix})"}
    titles = {cid: t.format(**names) for cid, t in _TITLES.items()}
    rules = {cid: r.format(**names) for cid, r in _RULES.items()}
    if lab_fix is None:
        rules["N3"] = _NO_FIX.format(what="the lab's fix")
    if study_fix is None:
        rules["N4"] = _NO_FIX.format(what="the study's fix")
    return titles, rules


CLAIMS, RULES = claim_texts()
FINISHED = ("done", "diverged")


# ---------------------------------------------------------------- one arm's outcome

def run_config(run_dir: str | Path) -> dict | None:
    """The run's attention (backend; precision and stabilizer, which only a flash backend uses),
    seed and steps from its config.toml (None without one)."""
    p = Path(run_dir) / "config.toml"
    if not p.is_file():
        return None
    cfg = load_config(p)
    spec = cfg.attention.spec
    return {"backend": spec.backend, "precision": spec.precision, "stabilizer": spec.stabilizer, "seed": cfg.train.seed,
            "steps": cfg.train.steps, "divergence_factor": cfg.train.divergence_factor}


def _series(per_layer: dict) -> list[dict]:
    """lean_across_probes' {layer: ProbeSeries} as JSON-ready rows, in layer order."""
    out = []
    for layer, s in sorted(per_layer.items()):
        out.append({"layer": layer, "probes": len(s.zs), "first_step": s.steps[0], "last_step": s.steps[-1],
                    "positive": s.positive, "stouffer_z": s.stouffer_z, "mean_ratio": s.mean_ratio,
                    "verdict": s.verdict, "steps": s.steps, "zs": s.zs})
    return out


def missing_outcome(arm: str, run_dir: str | Path | None = None, overrides=()) -> dict:
    """The outcome of an arm that was not run (no metrics.jsonl, or no folder given)."""
    return {"arm": arm, "dir": None if run_dir is None else str(run_dir), "overrides": list(overrides),
            "status": "missing", "steps": 0, "target_steps": None, "diverged_at": None, "divergence": None,
            "last_val": None, "last_val_step": None, "delta": [], "O": [], "census": None, "config": None,
            "metrics_age_s": None, "state": "not run"}


def arm_outcome(run_dir: str | Path, steps: int, *, arm: str, overrides=(), now: float | None = None) -> dict:
    """One arm: its status by the run summary (runs.summarize_run: the one divergence rule), steps run, the
    last validation loss (and its step), the delta and O leans across probes per layer, the
    census summary line, the run's config, and a one-line ``state``."""
    run_dir = Path(run_dir)
    s = summarize_run(run_dir, steps)
    if s["status"] == "missing":
        return {**missing_outcome(arm, run_dir, overrides), "state": f"not run (no metrics.jsonl in {run_dir})"}
    recs = read_jsonl(run_dir / "metrics.jsonl")
    vals = [(r[keys.STEP], r[keys.LOSS_VAL]) for r in recs
            if isinstance(r.get(keys.STEP), int) and isinstance(r.get(keys.LOSS_VAL), (int, float))
            and math.isfinite(r[keys.LOSS_VAL])]
    census = census_from_records(recs)
    age = (time.time() if now is None else now) - (run_dir / "metrics.jsonl").stat().st_mtime
    out = {"arm": arm, "dir": str(run_dir), "overrides": list(overrides), "status": s["status"], "steps": s["steps"],
           "target_steps": steps, "diverged_at": s["diverged_at"], "divergence": s["divergence"],
           "last_val": vals[-1][1] if vals else None, "last_val_step": vals[-1][0] if vals else None,
           "delta": _series(lean_across_probes(recs, "delta")), "O": _series(lean_across_probes(recs, "O")),
           "delta_split": [{"layer": layer, **row} for layer, row in split_across_probes(recs).items()],
           "census": census.summary() if census is not None else None, "config": run_config(run_dir),
           "metrics_age_s": age}
    out["state"] = state_text(out)
    return out


def state_text(o: dict, *, short: bool = False) -> str:
    """An arm's state from its outcome: a sentence (the outcome's "state"), or, ``short``, a
    table cell (natural.md's arms table)."""
    if o["status"] == "missing":
        return "not run"
    if o["status"] == "diverged":
        return f"diverged at step {o['diverged_at']}" + ("" if short else f" ({o['divergence']})")
    if o["status"] == "done":
        return "done" if short else f"done ({o['steps']} steps, not diverged)"
    if short:
        return f"incomplete (running or stopped at step {o['steps'] - 1})"
    age = o.get("metrics_age_s")
    when = "" if age is None else f"; metrics last written {_age(age)} before this analysis"
    return (f"incomplete: {o['steps']} of {o['target_steps']} steps logged, not diverged so far (still training "
            f"or stopped{when})")


def _age(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def series_text(row: dict) -> str:
    """One layer's lean across probes, e.g. "L0 +7.2 leans + (18/21 probes +)"."""
    return f"L{row['layer']} {row['stouffer_z']:+.1f} {row['verdict']} ({row['positive']}/{row['probes']} probes +)"


# ---------------------------------------------------------------- matching

def matched_batches(dirs: dict[str, Path | None], reference: str) -> dict:
    """Whether the arms saw the same batches: each arm's batches.jsonl against the reference arm's
    over the steps both logged. {arm: {"compared", "first_mismatch"}} (None: nothing to compare)."""
    def load(d):
        if d is None:
            return {}
        return {r["step"]: r.get("indices") for r in read_jsonl(Path(d) / "batches.jsonl")
                if isinstance(r.get("step"), int)}
    ref = load(dirs.get(reference))
    out = {}
    for arm, d in dirs.items():
        if arm == reference:
            continue
        mine = load(d)
        common = sorted(set(ref) & set(mine))
        if not common:
            out[arm] = None
            continue
        bad = next((s for s in common if ref[s] != mine[s]), None)
        out[arm] = {"compared": len(common), "first_mismatch": bad}
    return out


# ---------------------------------------------------------------- claims

def _claim(cid: str, verdict: str, evidence: str, numbers: dict | None = None) -> dict:
    return {"id": cid, "title": CLAIMS[cid], "rule": RULES[cid], "verdict": verdict, "evidence": evidence,
            "numbers": numbers or {}}


def _get(outcomes: dict, arm: str) -> dict:
    return outcomes.get(arm) or missing_outcome(arm)


def _not_run(o: dict) -> str:
    how = f" ({' '.join(o['overrides'])})" if o.get("overrides") else ""
    where = f" (nothing at {o['dir']})" if o.get("dir") else ""
    return (f"{o['arm']} not run{where}: decided by its run{how}; train it, or pass --runs {o['arm']}=DIR of its "
            f"run folder")


def _unjudgeable(o: dict) -> str | None:
    """Why an arm's leans cannot be read (None: they can)."""
    if o["status"] == "missing":
        return _not_run(o)
    if not o["delta"]:
        return (f"{o['arm']} has no delta probe ({o['steps']} steps logged): decided by a run probed with "
                f"train.diagnostics_every > 0 on a flash arithmetic or torch's SDPA")
    return None


def _caveat(o: dict) -> str:
    """The note on an incomplete arm judged on what it has."""
    if o["status"] != "partial":
        return ""
    last = max(r["last_step"] for r in o["delta"]) if o["delta"] else None
    through = f"; judged on its probes through step {last}" if last is not None else ""
    return (f" ({o['arm']} incomplete: {o['steps']} of {o['target_steps']} steps{through}, the verdict may change "
            f"as it trains on)")


def _layers_text(o: dict) -> str:
    return f"{o['arm']}: " + "; ".join(series_text(r) for r in o["delta"])


def judge_lean_arises(outcomes: dict, *, harmed: str = "paper") -> dict:
    """N1: some layer of ``harmed`` leans + across its probes."""
    o = _get(outcomes, harmed)
    why = _unjudgeable(o)
    if why:
        return _claim("N1", INCONCLUSIVE, why)
    plus = [r["layer"] for r in o["delta"] if r["verdict"] == LEANS_PLUS]
    numbers = {"arm": harmed, "leans_plus_layers": plus, "delta": o["delta"]}
    if plus:
        return _claim("N1", HELD, f"{harmed} leans + at {', '.join(f'L{l}' for l in plus)}: {_layers_text(o)}"
                      + _caveat(o), numbers)
    return _claim("N1", NOT_HELD, f"no layer of {harmed} leans +: {_layers_text(o)}" + _caveat(o), numbers)


def judge_control(outcomes: dict, *, reference: str = "fp32") -> dict:
    """N2: no layer of ``reference`` leans (either sign)."""
    o = _get(outcomes, reference)
    why = _unjudgeable(o)
    if why:
        return _claim("N2", INCONCLUSIVE, why)
    leaning = [r["layer"] for r in o["delta"] if r["verdict"].startswith(LEANS)]
    numbers = {"arm": reference, "leaning_layers": leaning, "delta": o["delta"]}
    if leaning:
        return _claim("N2", NOT_HELD, f"{reference} leans at {', '.join(f'L{l}' for l in leaning)}: "
                      f"{_layers_text(o)}" + _caveat(o), numbers)
    return _claim("N2", HELD, f"no layer of {reference} leans: {_layers_text(o)}" + _caveat(o), numbers)


def judge_fix(outcomes: dict, n1: dict, *, fix: str, claim_id: str, harmed: str = "paper") -> dict:
    """N3 / N4: ``fix`` leans at none of the layers where ``harmed`` leans + (N1's layers)."""
    o = _get(outcomes, fix)
    if n1["verdict"] != HELD:
        extra = "" if o["status"] != "missing" else f"; {_not_run(o)}"
        return _claim(claim_id, INCONCLUSIVE, f"nothing to remove: N1 is {n1['verdict']} ({n1['evidence']})"
                      + extra)
    why = _unjudgeable(o)
    if why:
        return _claim(claim_id, INCONCLUSIVE, why)
    target = n1["numbers"]["leans_plus_layers"]
    paper = {r["layer"]: r for r in n1["numbers"]["delta"]}
    mine = {r["layer"]: r for r in o["delta"]}
    absent = [l for l in target if l not in mine]
    numbers = {"arm": fix, "layers": target, "delta": o["delta"]}
    pairs = "; ".join(f"{harmed} {series_text(paper[l])} vs {fix} "
                      + (series_text(mine[l]) if l in mine else f"L{l} not probed") for l in target)
    if absent:
        return _claim(claim_id, INCONCLUSIVE, f"{fix} has no delta probe at {', '.join(f'L{l}' for l in absent)}, "
                      f"where {harmed} leans +: {pairs}" + _caveat(o), numbers)
    still = [l for l in target if mine[l]["verdict"].startswith(LEANS)]
    elsewhere = [r for r in o["delta"] if r["layer"] not in target and r["verdict"].startswith(LEANS)]
    other = ("; elsewhere (reported, not judged): " + "; ".join(series_text(r) for r in elsewhere)) if elsewhere else ""
    if still:
        return _claim(claim_id, NOT_HELD, f"{fix} still leans at {', '.join(f'L{l}' for l in still)}: {pairs}"
                      + other + _caveat(o), numbers)
    return _claim(claim_id, HELD, f"{fix} leans at none of {harmed}'s layers: {pairs}" + other + _caveat(o), numbers)


def judge_divergence(outcomes: dict, n1: dict, *, harmed: str = "paper", reference: str = "fp32") -> dict:
    """N5: ``harmed`` diverged where ``reference`` did not, with a lean (N1) to attribute it to."""
    p, f = _get(outcomes, harmed), _get(outcomes, reference)
    numbers = {"harmed": {"arm": harmed, "status": p["status"], "steps": p["steps"], "diverged_at": p["diverged_at"]},
               "reference": {"arm": reference, "status": f["status"], "steps": f["steps"],
                             "diverged_at": f["diverged_at"]}}
    if p["status"] == "missing":
        return _claim("N5", INCONCLUSIVE, _not_run(p), numbers)
    if p["status"] == "done":
        return _claim("N5", NOT_HELD, f"{harmed} finished its {p['steps']} steps without diverging "
                      f"(last val loss {_num(p['last_val'])})", numbers)
    if p["status"] == "partial":
        return _claim("N5", INCONCLUSIVE, f"{harmed} {p['state']}: decided when it finishes its {p['target_steps']} "
                      "steps or diverges", numbers)
    # the harmed arm diverged
    said = f"{harmed} diverged at step {p['diverged_at']} ({p['divergence']})"
    if f["status"] == "missing":
        return _claim("N5", INCONCLUSIVE, f"{said}; {_not_run(f)}", numbers)
    if f["status"] == "diverged":
        return _claim("N5", INCONCLUSIVE, f"{said}, and {reference} too, at step {f['diverged_at']}: a divergence "
                      "the control shares is not the lean's", numbers)
    if f["status"] == "partial":
        return _claim("N5", INCONCLUSIVE, f"{said}; {reference} {f['state']}: decided when it finishes its "
                      f"{f['target_steps']} steps", numbers)
    if n1["verdict"] != HELD:
        return _claim("N5", INCONCLUSIVE, f"{said} and {reference} finished without diverging, but N1 is "
                      f"{n1['verdict']}: no lean to attribute the divergence to", numbers)
    return _claim("N5", HELD, f"{said}; {reference} finished its {f['steps']} steps without diverging; "
                  f"{harmed} leans + (N1)", numbers)


def _num(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def judge_claims(outcomes: dict, *, reference: str = "fp32", harmed: str = "paper",
                 lab_fix: str | None = "paper-fp32fwd", study_fix: str | None = "paper-fix") -> list[dict]:
    """N1-N5 from the arms' outcomes ({arm name: arm_outcome}; an absent arm counts as not run).
    A fix role None (the preset has no such arm): its claim is "not applicable". Titles and rules
    name the arms in their roles (claim_texts)."""
    n1 = judge_lean_arises(outcomes, harmed=harmed)
    fixes = []
    for fix, cid, what in ((lab_fix, "N3", "the lab's fix"), (study_fix, "N4", "the study's fix")):
        if fix is None:
            fixes.append(_claim(cid, NOT_APPLICABLE, f"this preset has no arm of {what}: nothing to judge"))
        else:
            fixes.append(judge_fix(outcomes, n1, fix=fix, claim_id=cid, harmed=harmed))
    claims = [n1, judge_control(outcomes, reference=reference), *fixes,
              judge_divergence(outcomes, n1, harmed=harmed, reference=reference)]
    titles, rules = claim_texts(reference=reference, harmed=harmed, lab_fix=lab_fix, study_fix=study_fix)
    for c in claims:
        c["title"], c["rule"] = titles[c["id"]], rules[c["id"]]
    return claims


def rules_text(**roles) -> str:
    """The definitions and verdict rules, as the Markdown states them (``roles``: the preset's
    reference, harmed, lab_fix, study_fix, as claim_texts takes them; default nat512's)."""
    return ("Status: the repro's run summary with the package's one divergence rule; an arm short of the preset's "
            "steps is incomplete and is judged on the probes it has (its verdicts say so). Delta lean per layer: "
            "Stouffer's z over the run's probes' z of delta's error (numerics/delta_err_z, per (sequence, head) "
            "units; probes see different batches) with the lab's lean rule: 'leans +/-' at |z| >= 3.29 with a mean "
            "bias ratio of that sign at least the lab's minimum, 'weak' if significant with a smaller ratio. "
            + " ".join(f"{k}: {v}." for k, v in claim_texts(**roles)[1].items()))
