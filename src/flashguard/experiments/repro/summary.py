"""One line of numbers per training run, with the package's divergence rule
(flashguard.train.divergence: the loss reaches 2x its running minimum after warm-up, or the
run's own train.divergence_factor; the loss at or above the run's initial loss after the
warm-up; a gradient norm 10^3 x the warm-up's median; a non-finite loss or gradient; a step the
trainer marked event/diverged)."""
from __future__ import annotations

import math
from pathlib import Path

from ... import keys
from ...train.config import load_config
from ...train.divergence import DIVERGENCE_FACTOR, find_divergence, rule_of
from ...utils.jsonl import read_metrics

__all__ = ["summarize_run", "DIVERGENCE_FACTOR"]


def summarize_run(run: str | Path, steps: int | None = None) -> dict:
    """steps, final/min loss, diverged_at (first step by the rule), max grad norm, last val
    loss, wall_s (sum of step times) and status: done | diverged | partial | missing."""
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
