"""The divergence rule: the one definition of "the run diverged at step s", for the trainer
(online: it stops the run, writes ``event/diverged`` and divergence.json) and for every reader
of a finished run (the repro's run summaries and claim C1, the report, the early-warning
monitor's offline evaluation and its lead times).

A run has diverged at the first step whose training loss or gradient norm is non-finite, whose
loss is at least ``factor`` times the lowest loss seen since the warm-up ended, or (optional,
``train.divergence_loss``) whose loss exceeds a fixed ``ceiling``. The running minimum starts
after the warm-up because the first steps' losses (5.5 for bytes) fall so fast that any ratio
against them means nothing.

The trainer applies the rule with the run's own ``train.divergence_factor`` (unset: only
non-finite values and the ceiling stop a run). A reader of a finished run (``find_divergence``
with ``rule_of(config)``) applies the same rule with the run's factor, or ``DIVERGENCE_FACTOR``
(2) when the run set none, so that every run is judged by one ratio; a step the trainer marked
``event/diverged`` counts as diverged whatever the ratio.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..keys import DIVERGED, GRAD_NORM, LOSS_TRAIN, STEP

__all__ = ["LossWatch", "DIVERGENCE_FACTOR", "find_divergence", "rule_of", "describe_rule"]

DIVERGENCE_FACTOR = 2.0   # the repro issue's ratio: the loss doubles its running minimum


@dataclass
class LossWatch:
    factor: float | None = DIVERGENCE_FACTOR   # None: no ratio test (non-finite values and the ceiling only)
    after: int = 0               # steps before this one do not set the running minimum
    ceiling: float | None = None  # a loss above this is a divergence (train.divergence_loss)
    best: float = math.inf

    def update(self, step: int, loss: float, grad_norm: float = 0.0) -> str | None:
        """Feed one step; returns why the run diverged at this step, else None."""
        if not math.isfinite(loss) or not math.isfinite(grad_norm):
            return f"non-finite (loss {loss:.4g}, gradient norm {grad_norm:.4g})"
        if self.factor is not None and math.isfinite(self.best) and loss >= self.factor * self.best:
            return f"loss {loss:.4g} >= {self.factor:g} x its running minimum {self.best:.4g}"
        if self.ceiling is not None and loss > self.ceiling:
            return f"loss {loss:.4g} > train.divergence_loss {self.ceiling:g}"
        if step >= self.after:
            self.best = min(self.best, loss)
        return None


def rule_of(cfg=None, *, factor: float | None = None) -> dict:
    """The rule's parameters for reading a finished run with configuration ``cfg`` (a RunConfig,
    or None for a run without one): ``{"factor", "after", "ceiling"}`` for ``find_divergence``.
    ``factor`` overrides the run's; else the run's ``train.divergence_factor``, else
    DIVERGENCE_FACTOR."""
    if factor is None:
        factor = (cfg.train.divergence_factor if cfg is not None else None) or DIVERGENCE_FACTOR
    return {"factor": factor,
            "after": cfg.optim.warmup_steps if cfg is not None else 0,
            "ceiling": cfg.train.divergence_loss if cfg is not None else None}


def describe_rule(factor: float | None = DIVERGENCE_FACTOR) -> str:
    ratio = f"loss >= {factor:g} x its running minimum after warm-up, or " if factor is not None else ""
    return ratio + "a non-finite loss or gradient norm"


def find_divergence(records, *, factor: float | None = DIVERGENCE_FACTOR, after: int = 0,
                    ceiling: float | None = None) -> tuple[int | None, str | None]:
    """(step, reason) of the first divergent record of a run's metrics records (in step order),
    or (None, None): LossWatch over ``loss/train`` and ``grad/norm``, and any record the trainer
    marked ``event/diverged`` (its rule fired there, e.g. with a factor or ceiling of its own).
    Records without a step or a training loss are skipped."""
    watch = LossWatch(factor, after=after, ceiling=ceiling)
    for r in records:
        step, loss = r.get(STEP), r.get(LOSS_TRAIN)
        if step is None or not isinstance(loss, (int, float)) or isinstance(loss, bool):
            continue
        g = r.get(GRAD_NORM)
        reason = watch.update(step, float(loss), float(g) if isinstance(g, (int, float)) else 0.0)
        if reason is None and r.get(DIVERGED):
            reason = f"the trainer's divergence rule ({DIVERGED})"
        if reason is not None:
            return step, reason
    return None, None
