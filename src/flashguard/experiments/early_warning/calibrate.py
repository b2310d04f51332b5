"""Calibration of each detector's threshold on one half of the runs, measured on the other.

The split is by seed, fixed before any number is looked at: runs of odd seeds are the
calibration half, runs of even seeds the held-out half (``split_by_seed``; every run of a seed is
on the same side, so that matched arms of one seed never straddle the split). The reverse fold
(calibrate on even, measure on odd) is reported beside it as a check, not chosen between.

The rule, also fixed in advance (``FALSE_ALARM_TARGET`` = 10 %): a detector's calibrated threshold
is the smallest threshold of its grid whose false-alarm rate on the calibration half's stable runs
is <= the target. Divergent runs play no part in the choice (the lead times are what is measured,
so they must not set the threshold). Without stable runs in the calibration half there is nothing
to calibrate on (None). When no threshold of the grid meets the target (stable runs that alarm at
every threshold: the rule calls a run stable while its loss holds, whatever its logits do), the
fallback, fixed in advance too, is the smallest threshold with the lowest false-alarm rate on the
calibration half, marked ``met_target: false`` so that it is never read as a calibrated one.
"""
from __future__ import annotations

from .evaluate import grid_of, measure

__all__ = ["FALSE_ALARM_TARGET", "split_by_seed", "choose_threshold", "calibrate"]

FALSE_ALARM_TARGET = 0.10


def split_by_seed(runs) -> tuple[list, list]:
    """(calibration, held-out): runs of odd seeds, runs of even seeds (input order kept)."""
    return [r for r in runs if r.seed % 2 == 1], [r for r in runs if r.seed % 2 == 0]


def _fa_rate(stable_alarms, t: float) -> float:
    return sum(a.get(t) is not None for a in stable_alarms) / len(stable_alarms)


def choose_threshold(stable_alarms, grid, target: float = FALSE_ALARM_TARGET, *,
                     fallback: bool = False) -> float | None:
    """The smallest threshold t of ``grid`` with (stable runs alarmed at t) / (stable runs) <=
    ``target``; ``stable_alarms``: one {threshold: first alarm step or None} per stable run. None
    without stable runs, or when no t meets the target (``fallback``: then the smallest t with the
    lowest rate)."""
    stable_alarms = list(stable_alarms)
    if not stable_alarms:
        return None
    grid = sorted(float(x) for x in grid)
    for t in grid:
        if _fa_rate(stable_alarms, t) <= target:
            return t
    if not fallback:
        return None
    return min(grid, key=lambda t: (_fa_rate(stable_alarms, t), t))


def calibrate(runs, detectors, table: dict, *, target: float = FALSE_ALARM_TARGET, reverse: bool = False) -> dict:
    """{detector name: {"threshold", "default", "met_target", "calibration_false_alarm_rate",
    "calibration": {...}, "held_out": measure(...) or None}} for the seed split (``reverse``:
    calibrate on the even seeds)."""
    cal, held = split_by_seed(runs)
    if reverse:
        cal, held = held, cal
    out = {}
    for det in detectors:
        rows = table[det.name]
        stable_cal = [r for r in cal if r.stable]
        alarms = [rows[r.id] for r in stable_cal]
        t = choose_threshold(alarms, grid_of(det), target, fallback=True)
        top = max(grid_of(det))
        entry = {"threshold": t, "default": det.threshold,
                 "met_target": t is not None and _fa_rate(alarms, t) <= target,
                 "calibration_false_alarm_rate": None if t is None else _fa_rate(alarms, t),
                 "calibration": {"seeds": sorted({r.seed for r in cal}), "runs": len(cal),
                                 "stable": len(stable_cal), "divergent": sum(r.diverged for r in cal),
                                 # the stable runs that alarm even at the grid's largest threshold: why
                                 # no threshold may meet the target
                                 "alarmed_at_max": [r.id for r in stable_cal if rows[r.id][top] is not None]},
                 "held_out": None}
        if t is not None and held:
            entry["held_out"] = measure(held, {rid: a[t] for rid, a in rows.items()})
            entry["held_out"]["seeds"] = sorted({r.seed for r in held})
        out[det.name] = entry
    return out
