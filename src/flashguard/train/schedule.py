"""Learning-rate schedule: linear warm-up, then cosine decay to min_lr (or constant)."""
from __future__ import annotations

import math

from .config import OptimConfig


def learning_rate(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """lr for 0-based ``step``: warm-up over the first ``warmup_steps`` steps (step 0 gets
    lr / warmup_steps, not 0), then cosine from lr to min_lr over the remaining steps up to
    ``decay_steps`` (default: the run's length), min_lr after that."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    end = cfg.decay_steps or total_steps
    if step >= end:
        return cfg.min_lr
    span = max(1, end - cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / span
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
