"""Which signal leads: on each divergent run, when each signal first leaves the stable runs' range.

Signals, read at the probe steps (the records carrying ``attn/max_logit/L*``; every 25 steps in
the injection grid) so that every signal is judged on the same time grid:

* ``W_Q norm L<l>``: each layer's W_Q spectral norm (``weights/wq_spectral_norm_max/L<l>``, max
  over heads);
* ``max logit``: the largest attention logit over the layers (``attn/max_logit/L*``);
* ``delta sign consistency``: max over the layers of |2 ``numerics/delta_err_pos_frac`` - 1| (0:
  the delta errors' signs are balanced, 1: all one sign), where it is logged;
* ``tie rate``: max over the layers of ``numerics/tie_rate/L*``;
* ``loss`` and ``grad norm``: ``loss/train`` and ``grad/norm`` averaged over the steps since the
  previous probe step (one noisy step against a band of many runs would cross it by chance).

The stable range at step s: the maximum of the signal over the stable runs of the same seed at
step s (every arm of a seed sees the same batches, so the band carries that seed's data); all
stable runs where a seed has none. ``band`` = a number q instead: the q-th percentile of those
runs at s (linear interpolation), a check that one stable run far out (the rule calls a run
stable whatever its logits do as long as its loss holds) does not decide the answer alone. A signal leaves the range at the first probe step s <= d (the
divergence step) where it is above the band there and at the next probe step (persistence, as the
monitor asks of its probe signals; when the next probe step is past d, s alone counts); a
non-finite value is above any band. Its lead is d - s. The leading signal of a run is the one that
leaves first (ties: all of them); "by how much" is its lead minus the next signal's. This is an
offline account of the finished runs (the band uses the stable runs' whole history), not a
detector.
"""
from __future__ import annotations

import math
import re
import statistics

import numpy as np

from ... import keys

__all__ = ["signal_series", "leading_signals"]

_LOGIT = re.compile(keys.MAX_LOGIT.pattern())
_TIE = re.compile(keys.TIE_RATE.pattern())
_POS = re.compile(keys.DELTA_ERR_POS_FRAC.pattern())
_WQ = re.compile(keys.WQ_NORM_MAX.pattern())


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _max(vals):
    vals = [v for v in vals if _num(v)]
    if not vals:
        return None
    return math.inf if any(not math.isfinite(v) for v in vals) else max(vals)


def signal_series(records) -> dict[str, dict[int, float]]:
    """{signal name: {probe step: value}} of one run."""
    out: dict[str, dict[int, float]] = {}
    since = []   # every-step values since the previous probe step
    for r in records:
        step = r.get(keys.STEP)
        since.append(r)
        if not any(_LOGIT.fullmatch(k) for k in r):
            continue
        for k, v in r.items():
            m = _WQ.fullmatch(k)
            if m and _num(v):
                out.setdefault(f"W_Q norm L{m.group(1)}", {})[step] = v
        pairs = {"max logit": _max(v for k, v in r.items() if _LOGIT.fullmatch(k)),
                 "tie rate": _max(v for k, v in r.items() if _TIE.fullmatch(k)),
                 "delta sign consistency": _max(abs(2 * v - 1) for k, v in r.items() if _POS.fullmatch(k) and _num(v))}
        for key, name in ((keys.LOSS_TRAIN, "loss"), (keys.GRAD_NORM, "grad norm")):
            vals = [x[key] for x in since if _num(x.get(key))]
            pairs[name] = (math.inf if any(not math.isfinite(v) for v in vals) else statistics.fmean(vals)) \
                if vals else None
        for name, v in pairs.items():
            if v is not None:
                out.setdefault(name, {})[step] = v
        since = []
    return dict(sorted(out.items()))


def _exit_step(series: dict[int, float], band: dict[int, float], d: int) -> int | None:
    steps = [s for s in sorted(series) if s <= d and s in band]
    above = [series[s] > band[s] or not math.isfinite(series[s]) for s in steps]
    for i, s in enumerate(steps):
        if above[i] and (i + 1 == len(steps) or above[i + 1]):
            return s
    return None


def _upper(vals, band):
    if band == "max":
        return max(vals)
    if any(not math.isfinite(v) for v in vals):   # numpy's percentile of +inf values is nan
        vals = [v if math.isfinite(v) else 1e308 for v in vals]
    return float(np.percentile(np.asarray(vals, dtype=float), float(band)))


def leading_signals(runs, *, band="max") -> dict:
    """{"runs": [{"run", "seed", "divergence_step", "band_from", "exits": {signal: step or None},
    "leads": {signal: lead or None}, "leader": [signals], "margin": steps or None, "next"}],
    "signals": {signal: {"left": n, "led": n, "median_lead": x}}, "divergent": n}."""
    series = {r.id: signal_series(r.records) for r in runs}
    stable = [r for r in runs if r.stable]
    rows = []
    names = sorted({n for s in series.values() for n in s})
    for r in (x for x in runs if x.diverged):
        ref = [s for s in stable if s.seed == r.seed] or stable
        d = r.divergence_step
        exits = {}
        for name in names:
            mine = series[r.id].get(name)
            refs = [series[s.id][name] for s in ref if name in series[s.id]]
            if not mine or not refs:
                exits[name] = None
                continue
            upper = {}
            for step in mine:
                vals = [x[step] for x in refs if step in x]
                if vals:
                    upper[step] = _upper(vals, band)
            exits[name] = _exit_step(mine, upper, d)
        leads = {n: (None if s is None else d - s) for n, s in exits.items()}
        found = sorted((s, n) for n, s in exits.items() if s is not None)
        leader = [n for s, n in found if s == found[0][0]] if found else []
        later = [(s, n) for s, n in found if s > found[0][0]] if found else []
        rows.append({"run": r.id, "arm": r.arm, "seed": r.seed, "divergence_step": d,
                     "band_from": "same seed" if ref is not stable else "all seeds",
                     "reference_runs": len(ref), "exits": exits, "leads": leads, "leader": leader,
                     "margin": (later[0][0] - found[0][0]) if later else None,
                     "next": later[0][1] if later else None})
    summary = {}
    for name in names:
        ls = [row["leads"][name] for row in rows if row["leads"].get(name) is not None]
        summary[name] = {"left": len(ls), "led": sum(name in row["leader"] for row in rows),
                         "median_lead": statistics.median(ls) if ls else None}
    return {"band": band, "divergent": len(rows), "stable": len(stable), "runs": rows, "signals": summary}
