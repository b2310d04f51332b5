"""What the experiments share about a training run: training one (``train_run``: skip a finished
run, resume an interrupted one), summing one up (``summarize_run``, with the package's
divergence rule), checking an experiment's steps and seeds, and how their markdown ends (the
claims table, the figures, the versions line).

``summarize_run``'s rule (flashguard.train.divergence): the loss reaches 2x its running minimum
after warm-up, or the run's own train.divergence_factor; the loss at or above the run's initial
loss after the warm-up; a gradient norm 10^3 x the warm-up's median; a non-finite loss or
gradient; a step the trainer marked event/diverged.
"""
from __future__ import annotations

import math
import platform
from pathlib import Path

import torch

from .. import keys
from ..train import load_config, train
from ..train.checkpoint import latest_checkpoint
from ..train.divergence import find_divergence, rule_of
from ..utils.jsonl import read_metrics
from ..utils.table import markdown_table

__all__ = ["train_run", "summarize_run", "versions", "markdown_footer", "claims_table", "check_steps", "check_seeds"]


def versions() -> dict:
    """The versions an experiment's results were made with: flashguard, torch, Python."""
    from .. import __version__
    return {"flashguard": __version__, "torch": torch.__version__, "python": platform.python_version()}


def markdown_footer(result: dict) -> list[str]:
    """The closing lines of an experiment's markdown: its figures (if any) and the versions() line,
    so that every experiment's report ends alike."""
    lines = ([""] + [f"![{f}]({f})" for f in result["figures"]]) if result.get("figures") else []
    v = result["versions"]
    return lines + ["", f"flashguard {v['flashguard']}, torch {v['torch']}, Python {v['python']}."]


def claims_table(claims: list[dict]) -> str:
    """An experiment's claims as a Markdown table: the claim, its verdict (bold), the evidence."""
    return markdown_table(["claim", "verdict", "evidence"],
                          [[f"{c['id']}: {c['title']}", f"**{c['verdict']}**", c["evidence"]] for c in claims])


def check_steps(steps) -> None:
    """An experiment's ``steps``: None (the preset's) or an integer >= 1."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")


def check_seeds(seeds: list[int]) -> None:
    """An experiment's seeds: no seed twice."""
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds: repeated seed in {seeds}")


def train_run(spec, base: Path, common: list[str], steps: int, run_dir: Path, log) -> bool:
    """Train one matched run (``base`` config + ``common`` + ``spec.overrides``) into ``run_dir``:
    skipped when finished, resumed from its last checkpoint when interrupted, started afresh
    (the old folder moved aside) when it stopped before its first checkpoint. Every experiment
    that trains runs trains them through this. True when it trained."""
    cfg = load_config(base, [*common, *spec.overrides, f"train.steps={steps}"])
    status = summarize_run(run_dir, steps)["status"]
    if status in ("done", "diverged"):
        log(f"  {spec.name}: already {status}, skipped")
        return False
    resume = latest_checkpoint(run_dir) is not None
    if run_dir.exists() and not resume:
        k = 1
        while run_dir.with_name(f"{run_dir.name}.incomplete-{k}").exists():
            k += 1
        run_dir.rename(run_dir.with_name(f"{run_dir.name}.incomplete-{k}"))
    from ..diagnostics import training_hooks
    train(cfg, run_dir, resume=resume, log_fn=log, hooks=training_hooks())
    return True


def summarize_run(run: str | Path, steps: int | None = None) -> dict:
    """One line of numbers per training run: steps, final/min loss, diverged_at (first step by the
    rule), max grad norm, last val loss, wall_s (sum of step times) and status: done | diverged |
    partial | missing."""
    run = Path(run)
    if not (run / "metrics.jsonl").is_file():
        return {"steps": 0, "final_loss": None, "min_loss": None, "diverged_at": None, "divergence": None,
                "max_grad_norm": None, "last_val": None, "wall_s": 0.0, "status": "missing", "precision": None}
    recs = [r for r in read_metrics(run) if keys.LOSS_TRAIN in r]
    cfg = load_config(run / "config.toml") if (run / "config.toml").is_file() else None
    diverged_at, why = find_divergence(recs, **rule_of(cfg))
    finite = [r[keys.LOSS_TRAIN] for r in recs if math.isfinite(r[keys.LOSS_TRAIN])]
    grads = [r[keys.GRAD_NORM] for r in recs if keys.GRAD_NORM in r]
    vals = [r[keys.LOSS_VAL] for r in recs if keys.LOSS_VAL in r]
    target = steps if steps is not None else (cfg.train.steps if cfg else None)
    if diverged_at is not None:
        status = "diverged"
    elif recs and target is not None and recs[-1][keys.STEP] + 1 >= target:
        status = "done"
    else:
        status = "partial"
    return {
        "steps": recs[-1][keys.STEP] + 1 if recs else 0,
        "final_loss": recs[-1][keys.LOSS_TRAIN] if recs else None,
        "min_loss": min(finite) if finite else None,
        "diverged_at": diverged_at, "divergence": why,
        "max_grad_norm": max(grads) if grads else None,
        "last_val": vals[-1] if vals else None,
        "wall_s": sum(r.get(keys.STEP_TIME, 0.0) for r in recs),
        "status": status,
        "precision": cfg.attention.spec.precision if cfg else None,
    }
