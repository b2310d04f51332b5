"""The divergence rule: the one definition of "the run diverged at step s", for the trainer
(online: it stops the run, writes ``event/diverged`` and divergence.json) and for every reader
of a finished run (the repro's run summaries and claim C1, the report, the early-warning
monitor's offline evaluation and its lead times).

The rule (issue 23; fixed before any run was re-judged with it). Steps are fed in order with
their training loss L and gradient norm g (before clipping). ``after`` is the warm-up length;
the *baseline window* is the steps before ``W = max(after, BASELINE_STEPS)`` (BASELINE_STEPS =
20): the warm-up, or the first 20 steps where the warm-up is shorter or absent. The *initial
loss* L0 is the first finite loss fed (step 0 of a run). A run has diverged at the first step s
where any of these holds (the reason names every condition that fired there):

1. non-finite: L or g is inf or NaN;
2. running minimum: L >= ``factor`` x the lowest loss seen at steps >= ``after``;
3. ceiling (optional, ``train.divergence_loss``): L > ``ceiling``;
4. initial loss: s >= W and L >= L0;
5. gradient norm: s >= BASELINE_STEPS and g >= GRAD_FACTOR (10^3) x the median gradient norm of
   the baseline window's steps fed before s (frozen once the window has ended; the test is
   skipped while that median is 0 or no window step has a gradient norm).

``factor = None`` switches off the relative tests (2, 4 and 5): only non-finite values and the
ceiling count.

Why 4 and 5. Test 2's running minimum starts after the warm-up because the first steps' losses
(5.5 for bytes) fall so fast that any ratio against them means nothing. That leaves a blind spot
that decided verdicts: a run that blows up *inside* the warm-up (micro model, ``paper``, lr
0.139: loss 5.44 -> 9.1, gradient norm 1.6 -> 1e8 -> 7e11, ending at 8.98) starts its running
minimum already high and never doubles it, so it was "not diverged"; so were runs whose W_Q ran
away before their loss had fallen (docs/cpu-reproduction.md). Test 4 catches the first kind
without a ratio to tune: a run that, once its warm-up is over, is no better than a model that has
learnt nothing (its loss at initialisation, about log(vocabulary)) has failed, whatever its
running minimum. It waits for the end of the warm-up (and at least 20 steps) because a long
warm-up starts at a learning rate near 0, where the loss sits at L0 within batch noise. Test 5
catches the second kind where the loss moves too little: a healthy run's gradient norm moves by
a factor of a few to tens (the norm at initialisation is often the largest), so a thousandfold
rise over the median of its first steps is an explosion, never noise. It runs inside the warm-up
too, against the median of the window steps so far, from step 20 on (a median of fewer steps is
one odd step away from meaning nothing). Both constants were fixed before re-judging any run.

Not part of the rule: a matched-baseline form (the loss above the same-seed baseline's at the same
step by a margin) needs a second run, which the trainer does not have; experiments that have
one compare runs in their own analyses.

The trainer applies the rule with the run's own ``train.divergence_factor`` (unset: only
non-finite values and the ceiling stop a run), at every step. A reader of a finished run
(``find_divergence`` with ``rule_of(config)``) applies the same rule with the run's factor, or
``DIVERGENCE_FACTOR`` (2) when the run set none, so that every run is judged by one ratio, over
the logged records (a run logged every k steps is judged on those; its initial loss is step 0's,
which is always logged); a step the trainer marked ``event/diverged`` counts as diverged whatever
the rule says. ``describe_rule`` is the rule in words for experiment documents.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from ..keys import DIVERGED, GRAD_NORM, LOSS_TRAIN, STEP

__all__ = ["LossWatch", "DIVERGENCE_FACTOR", "GRAD_FACTOR", "BASELINE_STEPS", "find_divergence", "rule_of",
           "describe_rule"]

DIVERGENCE_FACTOR = 2.0   # the repro issue's ratio: the loss doubles its running minimum
GRAD_FACTOR = 1e3         # a gradient norm 10^3 x the baseline window's median is an explosion
BASELINE_STEPS = 20       # the baseline window is the warm-up, and at least the first 20 steps


@dataclass
class LossWatch:
    factor: float | None = DIVERGENCE_FACTOR   # None: no relative test (non-finite values and the ceiling only)
    after: int = 0               # steps before this one do not set the running minimum (the warm-up)
    ceiling: float | None = None  # a loss above this is a divergence (train.divergence_loss)
    best: float = math.inf       # the running minimum of the losses at steps >= after
    initial: float | None = None  # the first finite loss fed (NaN: unknown, e.g. resumed without it)
    window: list = field(default_factory=list)  # the baseline window's finite gradient norms so far

    @property
    def window_end(self) -> int:
        """First step after the baseline window: max(after, BASELINE_STEPS)."""
        return max(self.after, BASELINE_STEPS)

    def update(self, step: int, loss: float, grad_norm: float | None = None) -> str | None:
        """Feed one step (``grad_norm`` None: not measured, the gradient test is skipped); returns
        why the run diverged at this step (every condition that fired, '; '-joined), else None."""
        g = grad_norm
        if not math.isfinite(loss) or (g is not None and not math.isfinite(g)):
            return f"non-finite (loss {loss:.4g}, gradient norm {g if g is not None else float('nan'):.4g})"
        if self.initial is None:
            self.initial = loss
        fired = []
        if self.factor is not None and math.isfinite(self.best) and loss >= self.factor * self.best:
            fired.append(f"loss {loss:.4g} >= {self.factor:g} x its running minimum {self.best:.4g}")
        if self.ceiling is not None and loss > self.ceiling:
            fired.append(f"loss {loss:.4g} > train.divergence_loss {self.ceiling:g}")
        if self.factor is not None and step >= self.window_end and loss >= self.initial:
            fired.append(f"loss {loss:.4g} >= the run's initial loss {self.initial:.4g} after the warm-up "
                         f"(from step {self.window_end})")
        if self.factor is not None and g is not None and step >= BASELINE_STEPS and self.window:
            ref = statistics.median(self.window)
            if ref > 0 and g >= GRAD_FACTOR * ref:
                fired.append(f"gradient norm {g:.4g} >= {GRAD_FACTOR:g} x the median gradient norm {ref:.4g} "
                             f"of the warm-up (steps < {self.window_end}) so far")
        if step >= self.after:
            self.best = min(self.best, loss)
        if g is not None and step < self.window_end:
            self.window.append(g)
        return "; ".join(fired) if fired else None

    def state_dict(self) -> dict:
        """What a checkpoint keeps so that a resumed run is judged as if it had not stopped."""
        return {"best": self.best, "initial": self.initial, "window": list(self.window)}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``. A state without the initial loss (a checkpoint written before
        the initial-loss test existed) leaves that test off (NaN compares false)."""
        self.best = state.get("best", math.inf)
        self.initial = state.get("initial", math.nan)
        self.window = list(state.get("window", []))


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
    """The rule in words (printed into experiment documents)."""
    if factor is None:
        return "a non-finite loss or gradient norm"
    return (f"loss >= {factor:g} x its running minimum after warm-up; loss >= the run's initial loss once the "
            f"warm-up (at least {BASELINE_STEPS} steps) is over; gradient norm >= {GRAD_FACTOR:g} x the median "
            f"gradient norm of the warm-up (at least its first {BASELINE_STEPS} steps), from step {BASELINE_STEPS} "
            "on; or a non-finite loss or gradient norm")


def find_divergence(records, *, factor: float | None = DIVERGENCE_FACTOR, after: int = 0,
                    ceiling: float | None = None) -> tuple[int | None, str | None]:
    """(step, reason) of the first divergent record of a run's metrics records (in step order),
    or (None, None): LossWatch over ``loss/train`` and ``grad/norm``, and any record the trainer
    marked ``event/diverged`` (its rule fired there, e.g. with a factor or ceiling of its own).
    Records without a step or a training loss are skipped; a record without a gradient norm
    skips the gradient test."""
    watch = LossWatch(factor, after=after, ceiling=ceiling)
    for r in records:
        step, loss = r.get(STEP), r.get(LOSS_TRAIN)
        if step is None or not _number(loss):
            continue
        g = r.get(GRAD_NORM)
        reason = watch.update(step, float(loss), float(g) if _number(g) else None)
        if reason is None and r.get(DIVERGED):
            reason = f"the trainer's divergence rule ({DIVERGED})"
        if reason is not None:
            return step, reason
    return None, None


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
