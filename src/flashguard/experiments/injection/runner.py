"""`flashguard injection`: the grid's matched runs, the phase diagram, the verdict.

    OUT/injection.json   preset, grid, seeds, every run's overrides and outcome, cells, boundaries, verdict
    OUT/injection.md     the phase table (alpha x column), boundaries alpha*(p), the verdict, the runs
    OUT/phase.png        the phase diagram;  OUT/wq_norms.png  W_Q norms of the telling arms (first seed)
    OUT/runs/s<SEED>/<ARM>/   each training run (config.toml with its [injection], metrics.jsonl, ...)

Runs are trained by ``runs.train_run`` (skip finished, resume interrupted), so rerunning
the command continues where it stopped; the results are rewritten after every run. Every run
of a seed shares the repro preset's config, that seed and its batch order; all layers are
probed every ``diagnostics_every`` steps for the W_Q norms and max logits, and the trainer stops
a run at the divergence rule (train.divergence_factor = 2).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ...train import build_model, load_config
from ...train.injection import install_injection
from ...train.divergence import DIVERGENCE_FACTOR, describe_rule
from ...utils.atomic import atomic_write_text
from ...utils.table import markdown_table
from ..repro.presets import config_path, get_preset
from ..runs import check_seeds, claims_table, markdown_footer, train_run, versions
from ...utils.jsonl import read_jsonl
from .analysis import boundaries, cell_outcomes, judge_coherence, run_outcome
from .coherence import (by_component, judge_leading_layer, judge_runaway, margin, real_bias_ratio,
                        runaway_steps)
from .figures import phase_diagram, wq_norms
from .presets import InjectionPreset, arms, columns

__all__ = ["run_injection", "injection_markdown"]


def _common(preset: InjectionPreset, progress: bool, overrides) -> list[str]:
    repro = get_preset(preset.repro)
    return [*repro.overrides, *preset.overrides, f"attention.precision={repro.precision}",
            f"train.diagnostics_every={preset.diagnostics_every}", "train.diagnostics_layers=[]",
            f"train.divergence_factor={DIVERGENCE_FACTOR}", f"train.progress={'true' if progress else 'false'}",
            f'injection.reference="{preset.reference}"', *overrides]


def run_injection(preset: InjectionPreset, out: str | Path, *, seeds=None, steps: int | None = None,
                  overrides=(), progress: bool = True, log=print) -> dict:
    out = Path(out)
    base = config_path(get_preset(preset.repro))
    common = _common(preset, progress, list(overrides))
    grid = arms(preset)
    first = [o for o in grid[0].run_spec(0).overrides if not o.startswith("train.seed=")]
    cfg0 = load_config(base, [*common, *first])  # validates the overrides before anything trains
    seeds = [cfg0.train.seed] if not seeds else [int(s) for s in seeds]
    check_seeds(seeds)
    steps = steps or preset.steps
    for arm in grid:  # every arm's config must load before anything trains ...
        cfg = load_config(base, [*common, *arm.run_spec(seeds[0]).overrides])
    install_injection(build_model(cfg), cfg)  # ... and fit the model (e.g. injection.layers)
    t0 = time.perf_counter()
    n = len(grid) * len(seeds)
    i = 0
    for seed in seeds:
        for arm in grid:
            i += 1
            spec = arm.run_spec(seed)
            log(f"[{i}/{n}] seed {seed} {arm.name}: {spec.title}")
            if train_run(spec, base, common, steps, out / "runs" / f"s{seed}" / arm.name, log):
                # survives an interrupt (only after a run that trained: reading every run's metrics
                # after each skipped one made regenerating a finished 150-run grid quadratic)
                _write(out, preset, grid, seeds, steps, common, figures=False)
    result = _write(out, preset, grid, seeds, steps, common, figures=True)
    result["wall_s"] = time.perf_counter() - t0
    return result


def _write(out: Path, preset: InjectionPreset, grid, seeds, steps: int, common, *, figures: bool) -> dict:
    cols = [c for c, _, _ in columns(preset.ps)]
    alphas = sorted(float(a) for a in preset.alphas)
    runs, outcomes, summaries, by_cell = [], {}, {}, {}
    for seed in seeds:
        for arm in grid:
            d = out / "runs" / f"s{seed}" / arm.name
            o = run_outcome(d, steps)
            outcomes[(seed, arm.name)] = o
            summaries.setdefault((arm.column, arm.alpha), {})[seed] = o["summary"]
            by_cell.setdefault((arm.column, arm.alpha), {})[seed] = o
            runs.append({"name": arm.name, "title": arm.run_spec(seed).title, "seed": seed, "column": arm.column,
                         "rule": arm.rule, "p": arm.p,
                         "alpha": arm.alpha, "dir": f"runs/s{seed}/{arm.name}",
                         "overrides": [*common, *arm.run_spec(seed).overrides], **o})
    cells = cell_outcomes(summaries)
    bounds = boundaries(cells, cols, alphas)
    coherent = cols[-3] if cols[-3] != "zero-mean" else None  # the largest p > 0.5
    verdict = (judge_coherence(cells, alphas, coherent=coherent) if coherent and "zero-mean" in cols else
               {"id": "I1", "title": "", "verdict": "inconclusive",
                "evidence": "the grid needs a zero-mean column (p = 0.5) and a coherent one (p > 0.5)", "numbers": {}})
    # the arithmetic's own lean (the baseline arm's probes), the grid by coherent component, C3
    base = next((a for a in grid if a.baseline), None)
    finished = ("done", "diverged")
    base_out = {} if base is None else {seed: outcomes[(seed, base.name)] for seed in seeds
                                        if outcomes[(seed, base.name)]["summary"]["status"] in finished}
    lean = {} if base is None else {
        seed: real_bias_ratio(read_jsonl(m) if (m := out / "runs" / f"s{seed}" / base.name / "metrics.jsonl").exists()
                              else []) for seed in seeds}
    b = max((x["b"] for x in lean.values() if x["b"] is not None), default=None)
    upper = max((x["upper"] for x in lean.values() if x["upper"] is not None), default=None)
    rows = by_component(runs, b)
    runaways = [{"seed": seed, "name": name, "steps": runaway_steps(o, base_out[seed])}
                for (seed, name), o in outcomes.items()
                if seed in base_out and name != base.name and o["summary"]["status"] == "diverged"]
    n_layers = max((len(o["wq_norm"]) for o in outcomes.values()), default=0)
    verdicts = [verdict]
    if n_layers:
        verdicts.append(judge_leading_layer([r["steps"] for r in runaways], n_layers))
        if coherent and "zero-mean" in cols and base_out:
            verdicts.append(judge_runaway(by_cell, base_out, alphas, coherent=coherent))
    result = {"experiment": "injection", "preset": preset.name, "about": preset.about, "repro_preset": preset.repro,
              "steps": steps, "seeds": seeds, "alphas": alphas, "ps": list(preset.ps), "columns": cols,
              "reference": preset.reference, "divergence_rule": describe_rule(DIVERGENCE_FACTOR),
              "versions": versions(), "runs": runs,
              "cells": [{"column": c, "alpha": a, **cells[(c, a)]} for c in cols for a in alphas if (c, a) in cells],
              "boundaries": bounds, "lean": {str(k): v for k, v in lean.items()}, "by_component": rows,
              "margin": margin(rows, upper), "runaways": runaways, "claims": verdicts, "figures": []}
    out.mkdir(parents=True, exist_ok=True)
    if figures:
        phase_diagram(cells, cols, alphas, bounds, out / "phase.png",
                      title=f"delta error injection, {preset.name}, {steps} steps, seeds {', '.join(map(str, seeds))}")
        result["figures"].append("phase.png")
        telling = ["real-a1", *(f"{coherent}-a{a:g}" for a in alphas), f"zero-mean-a{alphas[-1]:g}"]
        first = {name: o for (seed, name), o in outcomes.items() if seed == seeds[0]}
        if wq_norms(first, [a for a in telling if a in first], out / "wq_norms.png",
                    title=f"W_Q spectral norms, seed {seeds[0]}") is not None:
            result["figures"].append("wq_norms.png")
    atomic_write_text(out / "injection.json", json.dumps(result, indent=1, default=float) + "\n")
    atomic_write_text(out / "injection.md", injection_markdown(result))
    return result


def _cell(c: dict) -> str:
    s = c["state"]
    if s == "diverged":
        return f"diverged @ {c['median_step']:g}" + (f" ({c['diverged']}/{c['seeds']})" if c["seeds"] > 1 else "")
    if s == "trained":
        return "trained" + (f" ({c['final_loss']:.2f})" if c["final_loss"] is not None else "")
    if s == "split":
        return f"split {c['diverged']}/{c['seeds']}"
    return "-"


def _component_row(r: dict) -> list[str]:
    c = "?" if r["c"] is None else f"{r['c']:.3g}"
    steps = ", ".join(map(str, sorted(r["steps"]))) or "-"
    done = f"{r['diverged']}/{r['seeds']}" if r["finished"] == r["seeds"] else \
        f"{r['diverged']}/{r['seeds']} ({r['seeds'] - r['finished']} unfinished)"
    return [c, r["column"], f"{r['alpha']:g}", done, steps]


def _run_row(r: dict) -> list[str]:
    s = r["summary"]
    wq = ", ".join(f"{v:.2f}" for _, v in sorted(r["wq_norm_last"].items())) or "-"
    ml = ", ".join(f"{v:.1f}" for _, v in sorted(r["max_logit_peak"].items())) or "-"
    fl = "-" if s["final_loss"] is None else f"{s['final_loss']:.3f}"
    return [r["name"], r["seed"], s["status"], s["steps"], "-" if s["diverged_at"] is None else s["diverged_at"], fl,
            wq, ml]


def injection_markdown(result: dict) -> str:
    cols, alphas = result["columns"], result["alphas"]
    cells = {(c["column"], c["alpha"]): c for c in result["cells"]}
    grid = [[f"{a:g}"] + [_cell(cells[(c, a)]) if (c, a) in cells else "-" for c in cols] for a in alphas]
    grid.append(["**alpha\\***"] + [result["boundaries"][c]["text"] for c in cols])
    lines = [f"# flashguard injection experiment: {result['preset']}", "",
             f"{result['about']}. delta = delta_ref + alpha * rule(e), e = delta_lp - delta_ref (O_ref in "
             f"{result['reference']}); {result['steps']} steps, seeds {', '.join(map(str, result['seeds']))}. "
             f"Divergence: {result['divergence_rule']}. A cell: diverged @ median step (seeds diverged / seeds), "
             "or trained (median final loss).", "",
             markdown_table(["alpha", *cols], grid), "", claims_table(result["claims"])]
    if result.get("by_component"):
        lines += ["", "The grid by coherent component c = alpha (2p - 1) (real and shuffled: alpha |b|, b the "
                  "baseline's measured lean of delta's error, mean over probe steps), in units of the real "
                  "error's mean size:", "",
                  markdown_table(["c", "column", "alpha", "diverged / seeds", "divergence steps"],
                                 [_component_row(r) for r in result["by_component"]])]
        lines += ["", f"**Margin of the real run:** {result['margin']['text']}."]
    lines += ["", markdown_table(["run", "seed", "status", "steps", "diverged at", "final loss",
                                  "W_Q norm last (per layer)", "max logit peak (per layer)"],
                                 [_run_row(r) for r in result["runs"]])]
    lines += markdown_footer(result)
    return "\n".join(lines) + "\n"
