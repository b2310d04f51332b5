"""The repro issue's divergence rule, one implementation for the trainer (online) and the
run summaries (offline): a run has diverged at the first step whose training loss is
non-finite, or at least ``factor`` times the lowest loss seen since the warm-up ended.

The running minimum starts after the warm-up because the first steps' losses (5.5 for bytes)
fall so fast that any ratio against them means nothing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LossWatch"]


@dataclass
class LossWatch:
    factor: float | None = 2.0   # None: only non-finite losses count
    after: int = 0               # steps before this one do not set the running minimum
    best: float = math.inf

    def update(self, step: int, loss: float, grad_norm: float = 0.0) -> str | None:
        """Feed one step; returns why the run diverged at this step, else None."""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite (loss {loss:.4g}, gradient norm {grad_norm:.4g})"
        if self.factor is not None and math.isfinite(self.best) and loss >= self.factor * self.best:
            return f"loss {loss:.4g} >= {self.factor:g} x its running minimum {self.best:.4g}"
        if step >= self.after:
            self.best = min(self.best, loss)
        return None
