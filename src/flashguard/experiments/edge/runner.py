"""`flashguard edge`: which part of bf16 attention's error makes the LR edge.

    OUT/edge.json   preset, seeds, every run's overrides and outcome, per-arm counts, the error
                    sizes of the injected arms, the claims' verdicts
    OUT/edge.md     the same as tables
    OUT/runs/s<SEED>/<ARM>/lr<LR>/   each training run

Runs go through ``runs.train_run`` (finished runs skipped, interrupted ones resumed), so
rerunning the command continues; seeds may be split across processes writing to one OUT (each
writes the results of what it sees; a last run over all seeds writes the whole). The schedule
and the divergence rule are the LR experiment's (experiments/lr_sensitivity), the arms and the
claims presets.py's, the rules analysis.py's.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ...train import load_config
from ...train.divergence import DIVERGENCE_FACTOR, describe_rule
from ...utils.atomic import atomic_write_text
from ...utils.table import markdown_table
from ..lr_sensitivity.analysis import run_outcome
from ..lr_sensitivity.presets import GRID_KEYS, lr_name, run_spec
from ..lr_sensitivity.runner import _common, _run_dir, grid_start, train_grid, warmup_steps
from ..runs import check_seeds, claims_table, markdown_footer, versions
from .analysis import arm_summary, judge_claims, rules_text
from .figures import survival_curves
from .presets import EdgePreset
from .sizes import injected_error_sizes

__all__ = ["run_edge", "edge_markdown"]


def _check_overrides(overrides) -> None:
    taken = [o for o in overrides if o.split("=", 1)[0].strip() in GRID_KEYS
             or o.split("=", 1)[0].strip().startswith(("injection.", "attention.backend"))]
    if taken:
        raise ValueError(f"{', '.join(taken)}: set by the edge experiment's arms for every run; choose another "
                         "preset, --seeds or --steps instead")


def run_edge(preset: EdgePreset, out: str | Path, *, seeds=None, steps: int | None = None, overrides=(),
             progress: bool = False, keep_checkpoints: bool = False, log=print) -> dict:
    out, base, steps, overrides = grid_start(preset, out, steps, overrides, _check_overrides)
    common = _common(preset, steps, progress, [*preset.probes, *overrides])
    for a in preset.arms:  # every arm's config must load before anything trains
        load_config(base, [*common, *run_spec(a, preset.lrs[0], 0).overrides, f"train.steps={steps}"])
    seeds = list(preset.seeds) if not seeds else [int(s) for s in seeds]
    check_seeds(seeds)
    t0 = time.perf_counter()
    sizes = _sizes(out, base, common, preset, seeds[0], log)
    grid = [(seed, a, lr) for seed in seeds for lr in preset.lrs for a in preset.arms]
    return train_grid(grid, out, base, common, steps, log, keep_checkpoints=keep_checkpoints,
                      write=lambda: _write(out, preset, seeds, steps, common, sizes), t0=t0)


def _sizes(out: Path, base, common, preset: EdgePreset, seed: int, log) -> dict:
    """The injected arms' error sizes (sizes.py), measured once and kept in OUT/error_sizes.json."""
    path = out / "error_sizes.json"
    if path.exists():
        return json.loads(path.read_text())
    log(f"measuring the injected arms' error sizes (seed {seed}, first batch, at initialisation)")
    sizes = {"seed": seed}
    for a in preset.arms:
        s = injected_error_sizes(base, common, a, seed)
        if s is not None:
            sizes[a.name] = s
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(sizes, indent=1) + "\n")
    return sizes


def _write(out: Path, preset: EdgePreset, seeds, steps: int, common, sizes: dict) -> dict:
    labels = {a.name: a.label for a in preset.arms}
    runs, per_lr = [], []
    for lr in preset.lrs:
        outcomes = {a.name: {s: run_outcome(_run_dir(out, s, a.name, lr), steps) for s in seeds} for a in preset.arms}
        for a in preset.arms:
            for s in seeds:
                runs.append({"seed": s, "arm": a.name, "label": a.label, "lr": lr,
                             "dir": f"runs/s{s}/{a.name}/{lr_name(lr)}",
                             "overrides": [*common, *run_spec(a, lr, s).overrides], **outcomes[a.name][s]})
        per_lr.append({"lr": lr, "arms": [{"arm": a.name, "label": a.label, **arm_summary(outcomes[a.name])}
                                          for a in preset.arms],
                       "claims": judge_claims(preset.claims, outcomes, labels)})
    result = {"experiment": "edge", "preset": preset.name, "about": preset.about, "repro_preset": preset.repro,
              "steps": steps, "warmup_steps": warmup_steps(steps), "seeds": seeds, "lrs": list(preset.lrs),
              "arms": [{"name": a.name, "label": a.label, "overrides": list(a.overrides)} for a in preset.arms],
              "divergence_rule": describe_rule(DIVERGENCE_FACTOR), "rules": rules_text(),
              "error_sizes": sizes, "by_lr": per_lr, "versions": versions(), "runs": runs}
    out.mkdir(parents=True, exist_ok=True)
    result["figures"] = []
    for block in per_lr:
        name = f"survival_{lr_name(block['lr'])}.png"
        survival_curves(block["arms"], steps, out / name,
                        title=f"{preset.name}, peak lr {block['lr']:.3g}: seeds still training ({len(seeds)} seeds)")
        result["figures"].append(name)
    atomic_write_text(out / "edge.json", json.dumps(result, indent=1, default=float) + "\n")
    atomic_write_text(out / "edge.md", edge_markdown(result))
    return result


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _sizes_lines(result: dict) -> list[str]:
    """The injected arms' error sizes: a sentence and a table (none when no arm is injected)."""
    sizes = {k: v for k, v in result["error_sizes"].items() if k != "seed"}
    if not sizes:
        return []
    labels = {a["name"]: a["label"] for a in result["arms"]}
    rows = [[labels.get(name, name), s["point"], f"{s['rms_own']:.3g}", f"{s['rms_injected']:.3g}", _f(s["ratio"]),
             _f(s["lean_own"], "+.3f"), _f(s["lean_injected"], "+.3f")] for name, s in sizes.items()]
    return [f"Injected arms' error sizes (seed {result['error_sizes']['seed']}, first batch, at initialisation, "
            "elements of every layer pooled): rms of the arithmetic's own error, rms of the error the run got, "
            "their ratio, and mean(error) / mean(|error|) of each (a description, not a test).", "",
            markdown_table(["arm", "point", "rms own", "rms injected", "ratio", "lean own", "lean injected"], rows), ""]


def edge_markdown(result: dict) -> str:
    seeds = result["seeds"]
    lines = [f"# flashguard edge attribution: {result['preset']}", "",
             f"{result['about']}. {result['steps']} steps a run (warm-up {result['warmup_steps']}, cosine to lr/10), "
             f"seeds {', '.join(map(str, seeds))}. Divergence: {result['divergence_rule']}.", "",
             result["rules"], ""]
    for block in result["by_lr"]:
        arms = [[a["label"], f"{a['diverged']}/{a['finished']}"
                 + (f" ({len(a['unfinished_seeds'])} unfinished)" if a["unfinished_seeds"] else ""),
                 ", ".join(map(str, a["diverged_steps"])) or "-", _f(a["median_step"], "g"), _f(a["mean_final_loss"])]
                for a in block["arms"]]
        lines += [f"## Peak lr {block['lr']:.3g}", "",
                  markdown_table(["arm", "diverged / seeds", "steps of divergence", "median step",
                                  "mean final loss (trained runs)"], arms),
                  "", claims_table(block["claims"]), ""]
    lines += _sizes_lines(result)
    runs = [[r["seed"], r["label"], f"{r['lr']:.3g}", r["status"], r["steps"], _f(r["diverged_at"], "d"),
             r.get("divergence") or "", _f(r["final_loss"])] for r in result["runs"]]
    lines.append(markdown_table(["seed", "arm", "peak lr", "status", "steps", "diverged at", "reason", "final loss"],
                                runs))
    lines += markdown_footer(result)
    return "\n".join(lines) + "\n"
