"""`flashguard early-warning --runs DIR [DIR ...] --out OUT`: the early-warning
detectors measured on finished training runs (those of the injection grid: runs that really
diverge and their stable twins).

    OUT/early_warning.json   runs used and skipped, every detector's numbers at its default threshold,
                             the calibrated thresholds and their held-out numbers (both folds), the
                             monitor thresholds calibration would set, the sweep curves, which signal leads
    OUT/early_warning.md     the same as tables
    OUT/lead_times.png       lead-time distributions (default thresholds; calibrated, held-out)
    OUT/tradeoff.png         false-alarm rate against median lead time as the thresholds move

Everything is written atomically (utils/atomic.py) and only after all runs are read, so a reader
of OUT never sees a half-written result; rerun the command as more runs finish.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from pathlib import Path

from ... import keys
from ...keys import MAX_LOGIT
from ...train.divergence import describe_rule
from ...utils.atomic import atomic_write_json, atomic_write_text
from .calibrate import FALSE_ALARM_TARGET, calibrate, split_by_seed
from .detectors import MonitorDetector, ScoreDetector, default_detectors, monitor_thresholds
from .evaluate import grid_of, measure, sweep
from .figures import lead_times, tradeoff
from .report import early_warning_markdown
from .runs import load_runs
from .signals import leading_signals

__all__ = ["run_early_warning", "evaluate_detectors"]

# the monitor's level thresholds a scale changes (monitor_thresholds); the rest stay as they are
_MONITOR_LEVELS = ("wq_growth_watch", "wq_growth_warn", "wq_norm_ratio_watch", "wq_norm_ratio_warn",
                   "max_logit_watch", "max_logit_warn", "grad_spike_watch", "grad_spike_warn")


def _median_lead_with_misses(runs, alarms: dict) -> float | None:
    """Median over divergent runs of the lead, a miss counting 0 (the trade-off figure's x)."""
    div = [r for r in runs if r.diverged]
    if not div:
        return None
    leads = []
    for r in div:
        a = alarms.get(r.id)
        leads.append(r.divergence_step - a if a is not None and a <= r.divergence_step else 0)
    return float(statistics.median(leads))


def evaluate_detectors(runs, detectors=None, *, target: float = FALSE_ALARM_TARGET, log=None) -> dict:
    """Every number of the evaluation from loaded runs (``runs.load_runs``): a JSON-ready dict."""
    detectors = list(detectors or default_detectors())
    names = [d.name for d in detectors]
    if len(set(names)) != len(names):
        raise ValueError(f"detector names must be unique, got {names}")
    table = sweep(runs, detectors, log=log)
    default = {d.name: measure(runs, {rid: a[d.threshold] for rid, a in table[d.name].items()}) for d in detectors}
    cal = calibrate(runs, detectors, table, target=target)
    rev = calibrate(runs, detectors, table, target=target, reverse=True)
    curves = {}
    for d in detectors:
        pts = []
        for t in grid_of(d):
            alarms = {rid: a[t] for rid, a in table[d.name].items()}
            m = measure(runs, alarms)
            pts.append([t, _median_lead_with_misses(runs, alarms), m["false_alarm_rate"], m["hits"], m["false_alarms"]])
        curves[d.name] = {"points": pts, "default": d.threshold, "calibrated": cal[d.name]["threshold"],
                          "columns": ["threshold", "median lead (miss = 0)", "false-alarm rate", "hits",
                                      "false alarms"]}
    monitor = {}
    for d in detectors:
        if isinstance(d, MonitorDetector):
            entry = {}
            for fold, c in (("odd->even", cal), ("even->odd", rev)):
                k = c[d.name]["threshold"]
                th = None if k is None else asdict(monitor_thresholds(k))
                entry[fold] = {"scale": k, "met_target": c[d.name]["met_target"],
                               "thresholds": None if th is None else {f: th[f] for f in _MONITOR_LEVELS}}
            base = asdict(monitor_thresholds(1.0))
            entry["defaults"] = {f: base[f] for f in _MONITOR_LEVELS}
            monitor[d.name] = entry
    cal_half, held_half = split_by_seed(runs)
    by_seed = {}
    for r in runs:
        s = by_seed.setdefault(str(r.seed), {"divergent": 0, "stable": 0, "other": 0})
        s["divergent" if r.diverged else "stable" if r.stable else "other"] += 1
    factors = sorted({r.rule.get("factor") for r in runs if r.rule.get("factor") is not None})
    return {
        "unit": "run",
        "counts": {"runs": len(runs), "divergent": sum(r.diverged for r in runs),
                   "stable": sum(r.stable for r in runs), "other": sum(r.other for r in runs),
                   "by_seed": by_seed},
        "divergence_rule": "; ".join(describe_rule(f) for f in factors) if factors else describe_rule(),
        "runs": [{"id": r.id, "seed": r.seed, "arm": r.arm, "injection": r.injection, "diverged": r.diverged,
                  "divergence_step": r.divergence_step, "divergence_reason": r.divergence_reason,
                  "last_step": r.last_step, "warmup": r.warmup, **_peaks(r)} for r in runs],
        "detectors": [{"name": d.name, "about": d.about, "default": d.threshold, "grid": grid_of(d),
                       "scored_runs": _scored_runs(d, runs)} for d in detectors],
        "default": default,
        "false_alarm_target": target,
        "split": {"rule": "calibration = runs of odd seeds, held out = runs of even seeds (reverse fold beside it)",
                  "calibration_seeds": sorted({r.seed for r in cal_half}),
                  "held_out_seeds": sorted({r.seed for r in held_half})},
        "calibrated": cal, "calibrated_reverse": rev, "monitor_calibration": monitor,
        "tradeoff": curves,
        "signals": leading_signals(runs),
        "signals_p90": leading_signals(runs, band=90),
    }


def _scored_runs(detector, runs) -> int | None:
    """How many runs give a score detector a score at all (a signal not logged in a run, e.g. the
    update entropy without ``train.update_entropy_every``, can raise no alarm there); None for the
    detectors that read every step's loss or the monitor's inputs."""
    if not isinstance(detector, ScoreDetector):
        return None
    return sum(bool(detector.with_threshold(detector.threshold).scores(r.records)) for r in runs)


def _peaks(run) -> dict:
    """The final loss and the largest max logit of a run: what a reader needs to see that a run
    the rule calls stable may still have run its logits away."""
    logits = [v for r in run.records for k, v in r.items() if MAX_LOGIT.matches(k) and MAX_LOGIT.parse(k)[1] is None
              and isinstance(v, (int, float))]
    losses = [r[keys.LOSS_TRAIN] for r in run.records if isinstance(r.get(keys.LOSS_TRAIN), (int, float))]
    return {"final_loss": losses[-1] if losses else None, "peak_max_logit": max(logits) if logits else None}


def run_early_warning(run_folders, out, *, target: float = FALSE_ALARM_TARGET, log=print) -> dict:
    """Read the finished runs below ``run_folders``, evaluate the detectors, write OUT."""
    out = Path(out)
    folders = [Path(f) for f in run_folders]
    if not folders:
        raise ValueError("--runs: give at least one folder of runs")
    for f in folders:
        try:
            out.resolve().relative_to(f.resolve())
        except ValueError:
            continue
        raise ValueError(f"--out {out} lies inside the runs folder {f}: write the results elsewhere")
    runs, skipped = load_runs(folders, log=log)
    if not runs:
        raise ValueError(f"no finished runs below {', '.join(map(str, folders))} ({len(skipped)} skipped)")
    log(f"{len(runs)} finished runs ({sum(r.diverged for r in runs)} divergent), {len(skipped)} skipped")
    result = {"experiment": "early-warning", "run_folders": [str(f) for f in folders], "skipped": skipped,
              **evaluate_detectors(runs, target=target, log=log), "figures": []}
    names = [d["name"] for d in result["detectors"]]
    out.mkdir(parents=True, exist_ok=True)
    lead_times(names, result["default"], {n: c["held_out"] for n, c in result["calibrated"].items()},
               out / "lead_times.png",
               title=f"early warning on {result['counts']['divergent']} divergent / "
                     f"{result['counts']['stable']} stable runs")
    tradeoff(result["tradeoff"], out / "tradeoff.png", title="thresholds swept over each detector's grid (all runs)")
    result["figures"] = ["lead_times.png", "tradeoff.png"]
    atomic_write_json(out / "early_warning.json", _jsonable(result), indent=1)
    atomic_write_text(out / "early_warning.md", early_warning_markdown(result))
    return result


def _jsonable(x):
    """JSON without NaN/inf (atomic_write_json refuses them): a non-finite number becomes a string."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x
