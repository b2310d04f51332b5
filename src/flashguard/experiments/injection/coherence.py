"""Reading the grid by its coherent component, placing a real run on it, and where the runaway starts.

**The coherent component.** An arm injects alpha * rule(e). Its mean, in units of the real error's
mean size E|e|, is its coherent component

    c = alpha * (2p - 1)        coherent p (zero-mean: p = 1/2, c = 0)
    c = alpha * b               real and shuffled, b = mean(e) / mean(|e|) of the arithmetic's own error

while alpha alone is its size. If the sign structure, not the size, decides whether a run diverges,
the arms' outcomes order by c (every arm above some c* diverges, every arm below trains on) whatever
their p, and zero-mean arms train on at every size. ``by_component`` lays the runs out that way.

**A real run's margin.** The probes of the baseline arm (the arithmetic itself, alpha 1) measure
b per layer at every probe step (numerics/delta_err_mean over numerics/delta_err_abs: the mean
signed error of delta over its mean absolute error, elements pooled). What adds up in W_Q over
steps is the lean that persists, so a layer's b is the mean over its probe steps (one step's b
is mostly noise: its sign changes from probe to probe), and the run's is the largest upper
confidence bound |mean| + Z_CRIT * sd / sqrt(n) over layers (n probe steps, p < 0.001 two-sided).
The margin (``margin``) is how many times larger a coherent component had to be to diverge at
this scale: the smallest c at which every seed of a coherent arm diverged, over that bound. Only
the ratio transfers, and only as far as the mechanism does: the boundary c* itself depends on the
model, the learning rate and the length of the run.

**Where the runaway starts** (the study's C3: in W_Q of one early layer). In a diverged arm, a
layer has run away at the first probe step where its W_Q spectral norm (max over heads) reaches
``RUNAWAY_FACTOR`` times the baseline arm's of the same seed at the same step; the leading layer
is the first to do so (ties: both are reported and neither leads). ``judge_leading_layer`` calls
C3 held when one layer leads in more diverged runs than chance would give (exact binomial test
against 1 / n_layers, p < ALPHA), not held when at least ``MIN_RUNS`` diverged runs show no such
layer, inconclusive below that. Both constants were fixed before the first grid was read.

**A secondary outcome for I1** (``judge_runaway``). The divergence rule (loss doubling its running
minimum) misses a run whose W_Q runs away before its loss has fallen: its running minimum stays
high, and a loss stuck at twice the baseline's never doubles it (on the micro grid every fully
coherent arm ended so, W_Q ~50x the baseline's, loss 3.4-4.2 against 1.9). I1 stays judged by the
rule; beside it, the same comparison with "W_Q ran away" (some layer at RUNAWAY_FACTOR x the
baseline's, the C3 criterion) as the outcome, labelled secondary because it was added after the
first grid showed the rule's blind spot. It never replaces the rule's verdict. (Issue 23 added two
tests to the rule itself, fixed before any run was re-judged: a loss at or above the run's initial
loss after the warm-up, and a gradient norm 10^3 x the warm-up's median; a run whose W_Q runs away
with its gradient norm now diverges by the rule, one whose loss merely stays high does not.)
"""
from __future__ import annotations

import math
import statistics

from ... import keys
from ...attention.error_stats import ALPHA, Z_CRIT
from .analysis import HELD, INCONCLUSIVE, NOT_HELD

__all__ = ["RUNAWAY_FACTOR", "MIN_RUNS", "LEADING_LAYER_CLAIM", "RUNAWAY_CLAIM", "coherent_component",
           "real_bias_ratio", "by_component", "margin", "runaway_steps", "judge_leading_layer", "judge_runaway"]

RUNAWAY_FACTOR = 2.0   # W_Q norm >= 2 x the baseline's at the same step: that layer has run away
MIN_RUNS = 10          # diverged runs needed before "no layer leads" is a finding
LEADING_LAYER_CLAIM = ("C3", "The runaway starts in W_Q of one early layer")
RUNAWAY_CLAIM = ("I1-wq", "A coherent delta error runs W_Q away where a zero-mean one of the same or larger size "
                          "does not (secondary outcome)")


def real_bias_ratio(records) -> dict:
    """b = mean(e) / mean(|e|) of delta's error from a run's probe records: {"by_layer": {layer:
    {"mean", "sd", "se", "upper" (|mean| + Z_CRIT se), "n"}}, "b": the largest |mean| over layers,
    "upper": the largest upper bound, "n": probe values}. b and upper are None when the run logged
    no delta-error probes."""
    per_layer: dict[int, list[float]] = {}
    for r in records:
        for k, v in r.items():
            where = keys.DELTA_ERR_MEAN.parse(k)
            if where is None or where[1] is not None:
                continue
            layer = where[0]
            a = r.get(keys.DELTA_ERR_ABS.key(layer))
            if isinstance(v, (int, float)) and isinstance(a, (int, float)) and a > 0 and math.isfinite(v):
                per_layer.setdefault(layer, []).append(float(v) / float(a))
    by_layer = {}
    for layer, bs in sorted(per_layer.items()):
        mean = statistics.fmean(bs)
        sd = statistics.stdev(bs) if len(bs) > 1 else math.inf
        se = sd / math.sqrt(len(bs))
        by_layer[layer] = {"mean": mean, "sd": sd, "se": se, "upper": abs(mean) + Z_CRIT * se, "n": len(bs)}
    if not by_layer:
        return {"by_layer": {}, "b": None, "upper": None, "n": 0}
    return {"by_layer": by_layer, "b": max(abs(x["mean"]) for x in by_layer.values()),
            "upper": max(x["upper"] for x in by_layer.values()), "n": sum(x["n"] for x in by_layer.values())}


def coherent_component(rule: str, p: float | None, alpha: float, b: float | None = None) -> float | None:
    """c of one arm (see the module docstring); None for real/shuffled when b is unknown."""
    if rule == "coherent":
        return alpha * (2.0 * float(p) - 1.0)
    if rule == "zero-mean":
        return 0.0
    if rule in ("real", "shuffled"):
        return None if b is None else alpha * abs(b)
    raise ValueError(f"unknown injection rule {rule!r}")


def by_component(runs, b: float | None) -> list[dict]:
    """One row per (column, alpha) over seeds, ordered by coherent component then size:
    {"column", "alpha", "c", "seeds", "diverged", "steps"}. ``runs``: the runner's run records
    (rule, p, alpha, column, summary)."""
    rows: dict[tuple, dict] = {}
    for r in runs:
        key = (r["column"], float(r["alpha"]))
        row = rows.setdefault(key, {"column": r["column"], "alpha": float(r["alpha"]),
                                    "c": coherent_component(r["rule"], r["p"], float(r["alpha"]), b),
                                    "seeds": 0, "diverged": 0, "finished": 0, "steps": []})
        s = r["summary"]
        row["seeds"] += 1
        if s["status"] in ("done", "diverged"):
            row["finished"] += 1
        if s["status"] == "diverged":
            row["diverged"] += 1
            row["steps"].append(s["diverged_at"])
    return sorted(rows.values(), key=lambda x: (math.inf if x["c"] is None else x["c"], x["alpha"], x["column"]))


def margin(rows, b_upper: float | None) -> dict:
    """How far the real arithmetic sits from the boundary, in coherent component:
    {"c_diverged": smallest c of a coherent arm whose every seed diverged, "c_trained": largest c
    below it whose every seed trained on, "b": the bound on the run's lean (real_bias_ratio's
    "upper"), "ratio": c_diverged / b (at least this far below), "text"}."""
    coh = [r for r in rows if r["column"].startswith("coherent") and r["finished"] == r["seeds"] > 0]
    div = [r["c"] for r in coh if r["diverged"] == r["seeds"]]
    c_div = min(div) if div else None
    ok = [r["c"] for r in coh if r["diverged"] == 0 and (c_div is None or r["c"] < c_div)]
    c_ok = max(ok) if ok else None
    out = {"c_diverged": c_div, "c_trained": c_ok, "b": b_upper, "ratio": None}
    if b_upper is None:
        out["text"] = "no delta-error probes in the baseline run: its coherent component is unknown"
    elif c_div is None:
        out["text"] = (f"no coherent arm diverged at every seed: no boundary to measure the real run's "
                       f"lean (|b| <= {b_upper:.3g}) against")
    else:
        out["ratio"] = c_div / b_upper if b_upper > 0 else math.inf
        out["text"] = (f"the arithmetic's own delta error leans by at most |b| <= {b_upper:.3g} of its size "
                       f"(mean over probe steps, upper bound at p < 0.001); "
                       f"a coherent component of {c_div:g} diverged at every seed"
                       + (f" ({c_ok:g} trained on)" if c_ok is not None else "")
                       + f": the real run sits at least {out['ratio']:.3g}x below the boundary at this scale")
    return out


def _norms(outcome) -> dict[int, dict[int, float]]:
    return {int(layer): {int(s): v for s, v in pts} for layer, pts in outcome["wq_norm"].items()}


def runaway_steps(outcome, baseline, factor: float = RUNAWAY_FACTOR) -> dict[int, int | None]:
    """{layer: the first probe step at which the layer's W_Q norm reached ``factor`` x the
    baseline's at that step (None: never)}."""
    mine, base = _norms(outcome), _norms(baseline)
    out = {}
    for layer, pts in sorted(mine.items()):
        ref = base.get(layer, {})
        out[layer] = next((s for s in sorted(pts) if s in ref and pts[s] >= factor * ref[s]), None)
    return out


def _binomial_upper(k: int, n: int, q: float) -> float:
    """P(X >= k) for X ~ Binomial(n, q)."""
    return sum(math.comb(n, i) * q ** i * (1 - q) ** (n - i) for i in range(k, n + 1))


def judge_leading_layer(runaways: list[dict], n_layers: int) -> dict:
    """C3 from the runaway steps of the diverged runs (one {layer: step | None} per run)."""
    leads: list[int] = []
    for ra in runaways:
        steps = {layer: s for layer, s in ra.items() if s is not None}
        if not steps:
            continue
        first = min(steps.values())
        who = [layer for layer, s in steps.items() if s == first]
        if len(who) == 1:
            leads.append(who[0])
    n = len(runaways)
    counts = {layer: leads.count(layer) for layer in range(n_layers)}
    top = max(counts, key=lambda layer: counts[layer]) if counts else None
    numbers = {"diverged_runs": n, "led_by": counts, "no_single_leader": n - len(leads)}

    def result(verdict, evidence, **more):
        return {"id": LEADING_LAYER_CLAIM[0], "title": LEADING_LAYER_CLAIM[1], "verdict": verdict,
                "evidence": evidence, "numbers": {**numbers, **more}}

    if n < MIN_RUNS:
        return result(INCONCLUSIVE, f"{n} diverged run(s); {MIN_RUNS} are needed to tell a leading layer from chance")
    share = ", ".join(f"L{layer} first in {c}" for layer, c in counts.items())
    p = _binomial_upper(counts[top], n, 1.0 / n_layers)
    if p < ALPHA:
        early = top < max(1, n_layers // 2) or n_layers <= 2
        return result(HELD if early else NOT_HELD,
                      f"of {n} diverged runs, {share} ({n - len(leads)} with no single first layer); "
                      f"L{top} leads more often than chance (binomial p = {p:.2g})"
                      + ("" if early else f", but L{top} is not an early layer of {n_layers}"),
                      leader=top, p=p)
    return result(NOT_HELD, f"of {n} diverged runs, {share} ({n - len(leads)} with no single first layer): "
                  f"no layer leads more often than chance (binomial p = {p:.2g} for L{top})", leader=None, p=p)


def judge_runaway(runs, baselines: dict, alphas, *, coherent: str, zero_mean: str = "zero-mean") -> dict:
    """The secondary I1 reading. ``runs``: {(column, alpha): {seed: outcome}}; ``baselines``: {seed:
    the baseline arm's outcome}. A cell ran away when every seed's run has a layer whose W_Q norm
    reached RUNAWAY_FACTOR x its seed's baseline's, held when none has, split otherwise. Held: the
    coherent column ran away at some alpha_c where zero-mean held at some alpha_z >= alpha_c; not
    held: zero-mean ran away at every alpha >= the smallest such alpha_c, or ran away where the
    coherent error held at every alpha; inconclusive otherwise."""
    def state(col, a):
        by_seed = runs.get((col, float(a))) or {}
        flags = [any(v is not None for v in runaway_steps(o, baselines[seed]).values())
                 for seed, o in by_seed.items() if seed in baselines
                 and (o.get("summary") or {}).get("status") in ("done", "diverged")]
        if not flags or len(flags) < len(by_seed):
            return "missing"
        return "ran away" if all(flags) else "held" if not any(flags) else "split"

    alphas = sorted(float(a) for a in alphas)
    coh = {a: state(coherent, a) for a in alphas}
    zm = {a: state(zero_mean, a) for a in alphas}
    numbers = {"coherent_column": coherent, "coherent": coh, "zero_mean": zm, "factor": RUNAWAY_FACTOR}

    def result(verdict, evidence):
        return {"id": RUNAWAY_CLAIM[0], "title": RUNAWAY_CLAIM[1], "verdict": verdict, "evidence": evidence,
                "numbers": numbers}

    table = "; ".join(f"alpha {a:g}: {coherent} {coh[a]}, {zero_mean} {zm[a]}" for a in alphas)
    away = [a for a in alphas if coh[a] == "ran away"]
    pairs = [(ac, az) for ac in away for az in alphas if az >= ac and zm[az] == "held"]
    if pairs:
        ac = min(p[0] for p in pairs)
        az = max(p[1] for p in pairs if p[0] == ac)
        return result(HELD, f"W_Q ran away (>= {RUNAWAY_FACTOR:g}x the baseline's) with {coherent} at alpha {ac:g}, "
                            f"not with {zero_mean} at alpha {az:g} ({table})")
    if away and all(zm[a] == "ran away" for a in alphas if a >= away[0]):
        return result(NOT_HELD, f"{zero_mean} ran away wherever {coherent} did ({table})")
    if not away and any(zm[a] == "ran away" for a in alphas) and all(coh[a] == "held" for a in alphas):
        return result(NOT_HELD, f"{zero_mean} ran away where {coherent} held at every alpha ({table})")
    return result(INCONCLUSIVE, f"no coherent cell ran away against a zero-mean cell that held ({table})")
