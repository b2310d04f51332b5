"""`flashguard lr-sensitivity`: final loss over a log grid of learning rates per
attention arithmetic, at the same seed and batches, with Wortsman et al.'s LR sensitivity and the
verdicts (analysis.py states every definition and rule).

    OUT/lr_sensitivity.json   preset, grid, seeds, every run's overrides and outcome, curves, verdicts
    OUT/lr_sensitivity.md     the loss-by-lr table, the per-seed curve summaries, the verdicts, the runs
    OUT/lr_curves.png         final loss against lr, one line per arithmetic
    OUT/runs/s<SEED>/<ARITHMETIC>/lr<LR>/   each training run (config.toml, metrics.jsonl, ...)

Runs are trained by ``runs.train_run`` (skip finished, resume interrupted), so rerunning
the command continues where it stopped; the results are rewritten after every run that trained.
A finished run's checkpoints are deleted (the analysis reads metrics only; ``keep_checkpoints``
keeps them): a tiny-cpu grid would otherwise hold 56 checkpoints of 39 MB. Every run shares the
repro preset's config and the seed's batch order; the trainer stops a run at the divergence rule
(train.divergence_factor = 2) and logs every step's loss (the final loss averages the last ones).
"""
from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

from ...train import load_config
from ...train.checkpoint import checkpoint_dir
from ...train.divergence import DIVERGENCE_FACTOR, describe_rule
from ...utils.atomic import atomic_write_text
from ...utils.table import markdown_table
from ..repro.presets import config_path, get_preset
from ..runs import check_seeds, check_steps, claims_table, markdown_footer, train_run, versions
from .analysis import (FINAL_WINDOW, curve, judge_fix, judge_harm, mean_curve, compare, rules_text, run_outcome)
from .figures import lr_curves
from .presets import GRID_KEYS, WARMUP_FRACTION, LRPreset, lr_name, run_spec

__all__ = ["run_lr_sensitivity", "lr_markdown", "warmup_steps", "grid_start", "train_grid"]


def warmup_steps(steps: int) -> int:
    """The warm-up of a run of ``steps`` steps: WARMUP_FRACTION of it, at least one step."""
    return max(1, round(WARMUP_FRACTION * steps))


def _common(preset: LRPreset, steps: int, progress: bool, overrides) -> list[str]:
    repro = get_preset(preset.repro)
    return [*repro.overrides, *preset.overrides, "optim.schedule=cosine", f"optim.warmup_steps={warmup_steps(steps)}",
            # one evaluation, at the last step (reported next to the final training loss)
            f"train.eval_every={steps}", f"train.eval_batches={preset.eval_batches}",
            f"train.checkpoint_every={preset.checkpoint_every}", "train.keep_last=1", "train.log_every=1",
            "train.diagnostics_every=0", f"train.divergence_factor={DIVERGENCE_FACTOR}",
            f"train.progress={'true' if progress else 'false'}", *overrides]


def _check_overrides(overrides) -> None:
    taken = [o for o in overrides if o.split("=", 1)[0].strip() in GRID_KEYS]
    if taken:
        raise ValueError(f"{', '.join(taken)}: set by the lr-sensitivity grid for every run "
                         f"({', '.join(GRID_KEYS)}); choose another preset, --seeds or --steps instead")


def _run_dir(out: Path, seed: int, name: str, lr: float) -> Path:
    return out / "runs" / f"s{seed}" / name / lr_name(lr)


def run_lr_sensitivity(preset: LRPreset, out: str | Path, *, seeds=None, steps: int | None = None, overrides=(),
                       progress: bool = True, keep_checkpoints: bool = False, log=print) -> dict:
    out, base, steps, overrides = grid_start(preset, out, steps, overrides, _check_overrides)
    common = _common(preset, steps, progress, overrides)
    cfg0 = None
    for a in preset.arithmetics:  # every arithmetic's config must load before anything trains
        spec = run_spec(a, preset.lrs[0], 0)
        cfg = load_config(base, [*common, *(o for o in spec.overrides if not o.startswith("train.seed=")),
                                 f"train.steps={steps}"])
        cfg0 = cfg0 or cfg
    seeds = [cfg0.train.seed] if not seeds else [int(s) for s in seeds]
    check_seeds(seeds)
    t0 = time.perf_counter()
    grid = [(seed, a, lr) for seed in seeds for a in preset.arithmetics for lr in preset.lrs]
    return train_grid(grid, out, base, common, steps, log, keep_checkpoints=keep_checkpoints,
                      write=lambda: _write(out, preset, seeds, steps, common), t0=t0)


def grid_start(preset, out, steps, overrides, check_overrides) -> tuple[Path, Path, int, list[str]]:
    """What the LR and edge experiments do first: ``steps`` checked, ``overrides`` checked by the
    experiment's ``check_overrides``; (OUT, the repro preset's config, the steps, the overrides)."""
    check_steps(steps)
    overrides = list(overrides)
    check_overrides(overrides)
    return Path(out), config_path(get_preset(preset.repro)), steps or preset.steps, overrides


def train_grid(grid, out: Path, base, common, steps: int, log, *, keep_checkpoints: bool, write, t0: float) -> dict:
    """Train every (seed, arithmetic, lr) of ``grid`` in order into OUT/runs/s<SEED>/<NAME>/lr<LR>
    (runs.train_run: finished runs skipped, interrupted ones resumed), dropping a finished
    run's checkpoints unless kept, and calling ``write()`` after each run that trained, so the
    results survive an interrupt; then ``write()``'s result with its wall time since ``t0``.
    Shared by the LR and edge experiments."""
    for i, (seed, a, lr) in enumerate(grid, 1):
        spec = run_spec(a, lr, seed)
        d = _run_dir(out, seed, a.name, lr)
        log(f"[{i}/{len(grid)}] seed {seed} {spec.title}")
        if train_run(spec, base, common, steps, d, log):
            if not keep_checkpoints:
                _drop_checkpoints(d, steps)
            write()
    result = write()
    result["wall_s"] = time.perf_counter() - t0
    return result


def _drop_checkpoints(run_dir: Path, steps: int) -> None:
    """Delete a finished run's checkpoints (an interrupted one keeps its last, to resume from)."""
    if run_outcome(run_dir, steps)["status"] in ("done", "diverged") and checkpoint_dir(run_dir).is_dir():
        shutil.rmtree(checkpoint_dir(run_dir))


def _write(out: Path, preset: LRPreset, seeds, steps: int, common) -> dict:
    lrs = list(preset.lrs)
    names = [a.name for a in preset.arithmetics]
    runs, curves = [], {}
    for seed in seeds:
        for a in preset.arithmetics:
            outcomes = {}
            for lr in lrs:
                o = run_outcome(_run_dir(out, seed, a.name, lr), steps)
                outcomes[lr] = o
                spec = run_spec(a, lr, seed)
                runs.append({"seed": seed, "arithmetic": a.name, "label": a.label, "lr": lr,
                             "dir": f"runs/s{seed}/{a.name}/{lr_name(lr)}",
                             "overrides": [*common, *spec.overrides], **o})
            curves[(seed, a.name)] = curve(outcomes, lrs)
    means = {n: mean_curve([curves[(s, n)] for s in seeds]) for n in names}
    ref = preset.reference
    vs_ref = [{"seed": s, "arithmetic": n, **compare(curves[(s, n)], curves[(s, ref)])}
              for s in seeds for n in names if n != ref and curves[(s, n)]["complete"] and curves[(s, ref)]["complete"]]
    harm = judge_harm(curves, seeds, reference=ref, harmed=preset.harmed)
    claims = [harm] + [judge_fix(curves, seeds, harm, fix=f, label=preset.arithmetic(f).label, claim_id=f"L{k}",
                                 reference=ref) for k, f in enumerate(preset.fixes, 2)]
    result = {"experiment": "lr-sensitivity", "preset": preset.name, "about": preset.about,
              "repro_preset": preset.repro, "steps": steps, "warmup_steps": warmup_steps(steps),
              "final_window": max(1, math.ceil(FINAL_WINDOW * steps)), "seeds": seeds, "lrs": lrs,
              "arithmetics": [{"name": a.name, "label": a.label, "overrides": list(a.overrides)}
                              for a in preset.arithmetics],
              "reference": ref, "harmed": preset.harmed, "fixes": list(preset.fixes),
              "divergence_rule": describe_rule(DIVERGENCE_FACTOR), "definitions": rules_text(),
              "versions": versions(), "runs": runs,
              "curves": [{"seed": s, "arithmetic": n, **curves[(s, n)]} for s in seeds for n in names],
              "means": [{"arithmetic": n, **means[n]} for n in names], "vs_reference": vs_ref,
              "claims": claims, "figures": []}
    out.mkdir(parents=True, exist_ok=True)
    lr_curves(means, {n: [curves[(s, n)] for s in seeds] for n in names},
              {a.name: a.label for a in preset.arithmetics}, out / "lr_curves.png",
              title=f"LR sensitivity, {preset.name}, {steps} steps, seeds {', '.join(map(str, seeds))} "
                    "(x: a seed diverged)")
    result["figures"].append("lr_curves.png")
    atomic_write_text(out / "lr_sensitivity.json", json.dumps(result, indent=1, default=float) + "\n")
    atomic_write_text(out / "lr_sensitivity.md", lr_markdown(result))
    return result


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _lr(x) -> str:
    return "none" if x is None else f"{x:.3g}"


def _final_loss_rows(result: dict) -> list[list[str]]:
    """A row a peak lr: each arithmetic's final loss, mean over seeds (d k/n: k of n seeds diverged)."""
    means = {m["arithmetic"]: m for m in result["means"]}
    rows = []
    for i, lr in enumerate(result["lrs"]):
        cells = []
        for a in result["arithmetics"]:
            m = means[a["name"]]
            d = m["diverged"][i]
            cells.append(_f(m["counted"][i]) + (f" (d {d}/{m['seeds']})" if d else ""))
        rows.append([f"{lr:.3g}"] + cells)
    return rows


def _per_seed_rows(result: dict) -> list[list]:
    """A row a (arithmetic, seed), and a mean row an arithmetic when there are several seeds."""
    labels = {a["name"]: a["label"] for a in result["arithmetics"]}
    means = {m["arithmetic"]: m for m in result["means"]}
    seeds = result["seeds"]
    diffs = {(d["seed"], d["arithmetic"]): d["sens_diff"] for d in result["vs_reference"]}
    curves = {(c["seed"], c["arithmetic"]): c for c in result["curves"]}
    rows = []
    for n in (a["name"] for a in result["arithmetics"]):
        for s in seeds:
            c = curves[(s, n)]
            if not c["complete"]:
                rows.append([labels[n], s, _f(c["l0"]), f"unfinished ({len(c['missing'])} runs)", None, None, None, None])
                continue
            diff = "-" if n == result["reference"] else _f(diffs.get((s, n)), "+.3f")
            rows.append([labels[n], s, _f(c["l0"]), _lr(c["best_lr"]), _f(c["best_loss"]), _f(c["sensitivity"]),
                         _lr(c["largest_trainable_lr"]), diff])
        m = means[n]
        if len(seeds) > 1:
            ds = [diffs[(s, n)] for s in seeds if (s, n) in diffs]
            mean_diff = "-" if n == result["reference"] or len(ds) != len(seeds) else _f(sum(ds) / len(ds), "+.3f")
            rows.append([labels[n], "mean", _f(m["l0"]), None, _f(m["best_loss"]), _f(m["sensitivity"]),
                         ", ".join(_lr(x) for x in m["largest_trainable_lr"]), mean_diff])
    return rows


def lr_markdown(result: dict) -> str:
    labels = {a["name"]: a["label"] for a in result["arithmetics"]}
    seeds = result["seeds"]
    ref = labels[result["reference"]]
    lines = [f"# flashguard LR-sensitivity experiment: {result['preset']}", "",
             f"{result['about']}. {result['steps']} steps a run (warm-up {result['warmup_steps']}, cosine to lr/10), "
             f"seeds {', '.join(map(str, seeds))}; the final loss averages the last {result['final_window']} "
             f"step{'s' if result['final_window'] != 1 else ''}. "
             f"Divergence: {result['divergence_rule']}.", "", result["definitions"], "",
             "Final loss by peak lr, mean over seeds (diverged runs counted as l0; d k/n: k of n seeds diverged):", "",
             markdown_table(["peak lr"] + [labels[a["name"]] for a in result["arithmetics"]], _final_loss_rows(result))]
    lines += ["", f"Per seed (sensitivity - {ref}'s: the same seed's difference):", "",
              markdown_table(["arithmetic", "seed", "l0", "best lr", "l*", "LR sensitivity", "largest trainable lr",
                              f"sensitivity - {ref}'s"], _per_seed_rows(result))]
    lines += ["", claims_table(result["claims"])]
    runs = [[r["seed"], r["label"], f"{r['lr']:.3g}", r["status"], r["steps"], _f(r["diverged_at"], "d"),
             _f(r["final_loss"]), _f(r["last_val"])] for r in result["runs"]]
    lines += ["", markdown_table(["seed", "arithmetic", "peak lr", "status", "steps", "diverged at", "final loss",
                                  "val loss (last step)"], runs)]
    lines += markdown_footer(result)
    return "\n".join(lines) + "\n"
