"""Outcomes of the injection runs, the divergence boundary alpha*(p) and the coherence verdict.

A run's outcome: the run summary (runs.summarize_run: the package's one divergence rule,
train/divergence.py), each layer's W_Q spectral norm (max over heads) and max |logit| over time
from the weight and attention probes, and its loss series. A cell (column, alpha) over seeds is
``diverged`` (every seed diverged), ``trained`` (every seed finished without diverging),
``split`` (the seeds disagree) or ``missing`` (a seed's run is missing or unfinished). A
column's boundary alpha* is its smallest diverged alpha.

The verdict (``judge_coherence``) for I1, "a coherent delta error explodes where a zero-mean one
of the same or larger size does not", reads the fully coherent column (the largest p of the
grid, > 1/2) against the zero-mean one:

* held: coherent diverged at some alpha_c while zero-mean trained on at some alpha_z >= alpha_c;
* not held: coherent diverged, and zero-mean diverged at every alpha >= the smallest such alpha_c
  (the size, not the sign structure, decides at this grid and length), or zero-mean diverged
  where coherent trained on at every alpha;
* inconclusive: nothing diverged (no explosion to compare), the baseline (no injection)
  diverged by itself, or the cells the answer rests on are missing, unfinished or split.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from ... import keys
from ...utils.jsonl import read_jsonl
from ..runs import summarize_run

__all__ = ["HELD", "NOT_HELD", "INCONCLUSIVE", "COHERENCE_CLAIM", "run_outcome", "cell_outcomes", "boundaries",
           "judge_coherence"]

HELD, NOT_HELD, INCONCLUSIVE = "held", "not held", "inconclusive"
COHERENCE_CLAIM = ("I1", "A coherent delta error explodes where a zero-mean one of the same or larger size does not")


def _layer_series(records, metric) -> dict[int, list[list[float]]]:
    out: dict[int, list[list[float]]] = {}
    for r in records:
        step = r.get(keys.STEP)
        if step is None:
            continue
        for k, v in r.items():
            where = metric.parse(k)
            if where is not None and where[1] is None and isinstance(v, (int, float)):
                out.setdefault(where[0], []).append([step, float(v)])
    return dict(sorted(out.items()))


def run_outcome(run_dir: str | Path, steps: int) -> dict:
    """summary (summarize_run), wq_norm / max_logit {layer: [[step, value], ...]} (per-layer max
    over heads, at the probe steps), loss [[step, loss], ...]."""
    run_dir = Path(run_dir)
    summary = summarize_run(run_dir, steps)
    recs = read_jsonl(run_dir / "metrics.jsonl")
    out = {"summary": summary,
           "wq_norm": _layer_series(recs, keys.WQ_NORM_MAX),
           "max_logit": _layer_series(recs, keys.MAX_LOGIT),
           "loss": [[r[keys.STEP], r[keys.LOSS_TRAIN]] for r in recs if keys.LOSS_TRAIN in r],
           # the online monitor's first warning (monitor/state 2, written by the diagnostics hook)
           "first_warning": next((r[keys.STEP] for r in recs if r.get(keys.MONITOR_STATE) == 2), None)}
    for name in ("wq_norm", "max_logit"):
        series = out[name]
        out[f"{name}_last"] = {layer: pts[-1][1] for layer, pts in series.items()}
        out[f"{name}_peak"] = {layer: max(v for _, v in pts) for layer, pts in series.items()}
    return out


def _state(summary: dict) -> str:
    if summary["status"] == "diverged":
        return "diverged"
    if summary["status"] == "done":
        return "trained"
    return "missing"


def cell_outcomes(summaries: dict) -> dict:
    """summaries: {(column, alpha): {seed: run summary}} -> {(column, alpha): cell}, a cell being
    {"state": diverged | trained | split | missing, "seeds": n, "diverged": k, "steps": [divergence
    steps], "median_step", "final_loss" (median over the seeds that trained on)}."""
    cells = {}
    for key, by_seed in summaries.items():
        states = [_state(s) for s in by_seed.values()]
        steps = sorted(s["diverged_at"] for s in by_seed.values() if s["diverged_at"] is not None)
        finals = [s["final_loss"] for s in by_seed.values() if _state(s) == "trained" and s["final_loss"] is not None]
        if not states or "missing" in states:
            state = "missing"
        elif all(x == "diverged" for x in states):
            state = "diverged"
        elif all(x == "trained" for x in states):
            state = "trained"
        else:
            state = "split"
        cells[key] = {"state": state, "seeds": len(states), "diverged": states.count("diverged"), "steps": steps,
                      "median_step": statistics.median(steps) if steps else None,
                      "final_loss": statistics.median(finals) if finals else None}
    return cells


def boundaries(cells: dict, column_names, alphas) -> dict:
    """{column: {"alpha_star", "below" (the largest trained alpha under it), "known" (every cell
    up to alpha* decided), "monotone" (no trained cell above alpha*), "text"}}."""
    alphas = sorted(alphas)
    out = {}
    for col in column_names:
        states = [(a, cells.get((col, a), {"state": "missing"})["state"]) for a in alphas]
        star = next((a for a, s in states if s == "diverged"), None)
        under = [(a, s) for a, s in states if star is None or a < star]
        below = max((a for a, s in under if s == "trained"), default=None)
        known = all(s in ("trained", "diverged") for _, s in under)
        monotone = star is None or all(s != "trained" for a, s in states if a > star)
        if star is None:
            text = f"> {alphas[-1]:g}" if known else "unknown (missing or split cells)"
        else:
            text = (f"({below:g}, {star:g}]" if below is not None else f"<= {star:g}") + ("" if known else " ?")
            text += "" if monotone else " (not monotone)"
        out[col] = {"alpha_star": star, "below": below, "known": known, "monotone": monotone, "text": text}
    return out


def _cell_text(col, a, c) -> str:
    if c is None or c["state"] == "missing":
        return f"{col} at alpha {a:g}: missing or unfinished"
    if c["state"] == "diverged":
        return f"{col} at alpha {a:g} diverged (step {c['median_step']:g}, {c['diverged']}/{c['seeds']} seeds)"
    if c["state"] == "trained":
        loss = f", final loss {c['final_loss']:.3f}" if c["final_loss"] is not None else ""
        return f"{col} at alpha {a:g} trained on ({c['seeds']} seed{'s' if c['seeds'] != 1 else ''}{loss})"
    return f"{col} at alpha {a:g} split: {c['diverged']}/{c['seeds']} seeds diverged"


def judge_coherence(cells: dict, alphas, *, coherent: str, zero_mean: str = "zero-mean",
                    baseline: tuple | None = ("real", 1.0)) -> dict:
    """The I1 verdict from the cells: {"id", "title", "verdict", "evidence", "numbers"}."""
    alphas = sorted(float(a) for a in alphas)
    coh = {a: cells.get((coherent, a)) for a in alphas}
    zm = {a: cells.get((zero_mean, a)) for a in alphas}

    def st(c):
        return "missing" if c is None else c["state"]

    def result(verdict, evidence, **numbers):
        return {"id": COHERENCE_CLAIM[0], "title": COHERENCE_CLAIM[1], "verdict": verdict, "evidence": evidence,
                "numbers": {"coherent_column": coherent, "zero_mean_column": zero_mean, **numbers}}

    if baseline is not None and baseline in cells:
        b = cells[baseline]
        if b["state"] != "trained":
            why = "diverged by itself" if b["state"] == "diverged" else f"is {b['state']}"
            return result(INCONCLUSIVE, f"the baseline (no injection) {why}: {_cell_text('real', baseline[1], b)}")
    diverged_c = [a for a in alphas if st(coh[a]) == "diverged"]
    trained_z = [a for a in alphas if st(zm[a]) == "trained"]
    pairs = [(ac, az) for ac in diverged_c for az in trained_z if az >= ac]
    if pairs:
        ac = min(p[0] for p in pairs)
        az = max(p[1] for p in pairs if p[0] == ac)
        return result(HELD, f"{_cell_text(coherent, ac, coh[ac])}; {_cell_text(zero_mean, az, zm[az])}",
                      alpha_coherent=ac, alpha_zero_mean=az, coherent_step=coh[ac]["median_step"])
    if diverged_c:
        ac = diverged_c[0]
        above = [a for a in alphas if a >= ac]
        undecided = [a for a in above if st(zm[a]) in ("missing", "split")]
        if undecided:
            return result(INCONCLUSIVE, f"{_cell_text(coherent, ac, coh[ac])}; but "
                          + "; ".join(_cell_text(zero_mean, a, zm[a]) for a in undecided), alpha_coherent=ac)
        steps = ", ".join(f"alpha {a:g}: coherent {coh[a]['median_step'] if st(coh[a]) == 'diverged' else '-'}"
                          f" / zero-mean {zm[a]['median_step']:g}" for a in above)
        return result(NOT_HELD, f"{_cell_text(coherent, ac, coh[ac])}, and zero-mean diverged at every alpha >= "
                      f"{ac:g} too (median divergence steps {steps})", alpha_coherent=ac)
    undecided_c = [a for a in alphas if st(coh[a]) in ("missing", "split")]
    if undecided_c:
        return result(INCONCLUSIVE, "; ".join(_cell_text(coherent, a, coh[a]) for a in undecided_c))
    diverged_z = [a for a in alphas if st(zm[a]) == "diverged"]
    if diverged_z:
        az = diverged_z[0]
        return result(NOT_HELD, f"{_cell_text(zero_mean, az, zm[az])}, where the coherent error trained on at "
                      f"every alpha up to {alphas[-1]:g}", alpha_zero_mean=az)
    return result(INCONCLUSIVE, f"nothing diverged: {coherent} and {zero_mean} trained on at every alpha up to "
                  f"{alphas[-1]:g} (no explosion to compare; longer runs or larger alpha needed)")
