"""Measures of a detector on runs: lead time on the divergent runs, false alarms on the stable twins.

The unit is a run. A run is divergent or stable by the package's one divergence rule only
(``Run.divergence_step``, from ``flashguard.train.divergence``). On a divergent run with
divergence step d and first alarm a: a hit when a <= d, with lead time d - a (0: the alarm came at
the divergence step itself, no warning in advance); a miss when there is no alarm up to d (an
alarm after d cannot warn: the trainer stopped the run at d). On a stable run: a false alarm when
the detector alarms at any step of the run, else quiet.

``sweep`` replays every detector over every run once per threshold of its grid (plus its default
threshold) and keeps the first alarm steps: calibration, the held-out numbers and the figures all
read from that table, so every number comes from the same replays.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Outcome", "outcome", "sweep", "measure", "grid_of"]


@dataclass(frozen=True)
class Outcome:
    kind: str               # hit | miss (divergent run) | false_alarm | quiet (stable run)
    alarm_step: int | None  # the first alarm counted (<= d for a divergent run)
    lead: int | None        # hits: divergence step - alarm step


def outcome(first_alarm: int | None, divergence_step: int | None) -> Outcome:
    """A run's outcome from its first alarm step (None: never) and its divergence step (None:
    stable)."""
    if divergence_step is None:
        return Outcome("false_alarm", first_alarm, None) if first_alarm is not None else Outcome("quiet", None, None)
    if first_alarm is not None and first_alarm <= divergence_step:
        return Outcome("hit", first_alarm, divergence_step - first_alarm)
    return Outcome("miss", None, None)


def grid_of(detector) -> list[float]:
    """The thresholds swept for a detector: its grid and its default threshold, ascending."""
    return sorted({float(t) for t in detector.grid} | {float(detector.threshold)})


def sweep(runs, detectors, *, log=None) -> dict:
    """{detector name: {run id: {threshold: first alarm step or None}}}. A divergent run is replayed
    up to its divergence step only (later alarms are misses whatever they are)."""
    table = {}
    for det in detectors:
        grid = grid_of(det)
        table[det.name] = {r.id: det.first_alarms(r.records, grid, warmup=r.warmup, until=r.divergence_step)
                           for r in runs}
        if log:
            log(f"  {det.name}: {len(runs)} runs x {len(grid)} thresholds replayed")
    return table


def _quartiles(xs) -> dict:
    if not xs:
        return {"median": None, "q1": None, "q3": None, "min": None, "max": None}
    q1, med, q3 = (float(v) for v in np.percentile(np.asarray(xs, dtype=float), [25, 50, 75]))
    return {"median": med, "q1": q1, "q3": q3, "min": int(min(xs)), "max": int(max(xs))}


def measure(runs, first_alarm: dict) -> dict:
    """Counts and lead times of one detector at one threshold on ``runs``; ``first_alarm``: {run id:
    first alarm step or None}. Lead-time quartiles are over the hits (linear interpolation)."""
    per_run = {r.id: outcome(first_alarm.get(r.id), r.divergence_step) for r in runs}
    div = [r for r in runs if r.diverged]
    stable = [r for r in runs if r.stable]
    other = [r for r in runs if r.other]
    leads = [per_run[r.id].lead for r in div if per_run[r.id].kind == "hit"]
    fa = sum(per_run[r.id].kind == "false_alarm" for r in stable)
    return {"unit": "run", "divergent": len(div), "stable": len(stable), "hits": len(leads),
            "hits_ahead": sum(1 for x in leads if x > 0), "misses": len(div) - len(leads),
            "lead_times": sorted(leads), "lead": _quartiles(leads),
            "false_alarms": fa, "false_alarm_rate": fa / len(stable) if stable else None,
            # runs that lean by design and did not diverge by the rule: alarms there counted apart
            "other": len(other), "other_alarms": sum(first_alarm.get(r.id) is not None for r in other),
            "runs": {rid: {"kind": o.kind, "alarm_step": o.alarm_step, "lead": o.lead} for rid, o in per_run.items()}}
