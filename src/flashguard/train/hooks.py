"""The training loop's hook interface: code that rides along a run without the loop knowing it.

    class MyHook(TrainHook):
        def after_backward(self, step):            # a StepInfo
            step.record["my/metric"] = ...
            step.keep = True                       # write this step's record to metrics.jsonl
    train(cfg, run_dir, hooks=[MyHook()])

The loop calls every hook, in the order given, at these points of a run:

* ``attach(model, cfg, rank)``   once, right after the seeded model is built (the GPT, on its
                            device) and before the optimizer and any DDP wrapper: the one point
                            where a hook may fit the model (the [injection] section's hook puts
                            its attention hooks into the chosen layers here);
* ``start(run)``            once, after the model, optimizer and any resumed state are set up and
                            before the first step (``run``: a RunInfo);
* ``step_begin(step, model)``   before the step's forward pass;
* ``after_backward(step)``  after the step's forward/backward and gradient clipping, before the
                            divergence test and the optimizer step: ``step.model`` holds the
                            step's gradients, ``step.record`` its metrics so far (loss, lr, grad
                            norm), and a hook may add metrics to it;
* ``after_optimizer_step(step)``   after the optimizer step (skipped steps included, as the loop
                            decides by the divergence rule);
* ``checkpoint(step, path)``   after the checkpoint of ``step`` completed steps is written
                            (``path`` None on the processes that do not write it);
* ``end(result)``           when the run stops: a TrainResult, or None when it stopped by an error.

Hooks run on every process; ``run.main`` tells the one that writes the logs. A hook must not
change the model's parameters or the RNG streams the loop uses, or resume and replay are no
longer bit-exact. ``config_keys`` names the config keys a hook implements: the loop refuses
a run that sets a key of flashguard.train.config.HOOK_KEYS (the keys inert without their hook)
that no hook claims, naming the key and the hook (``train.diagnostics_every`` without
flashguard.diagnostics.DiagnosticsHook, ``injection.rule`` without
flashguard.train.injection.InjectionHook). flashguard.diagnostics.training_hooks() builds the
standard hooks, the ones ``flashguard train`` and the repro pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

__all__ = ["TrainHook", "RunInfo", "StepInfo"]


@dataclass
class RunInfo:
    """What a hook learns at ``start``."""

    cfg: Any                        # the RunConfig
    run_dir: Path
    model: Any                      # the GPT (not its DDP wrapper)
    start: int                      # the first step this process runs (> 0 after --resume)
    rank: int = 0
    world: int = 1
    log: Callable[[str], None] = print   # a console line (the run's logger)

    @property
    def main(self) -> bool:
        return self.rank == 0


@dataclass
class StepInfo:
    """One optimizer step as the hooks see it."""

    step: int
    model: Any                      # the GPT (not its DDP wrapper), with the step's gradients
    indices: Any                    # (batch_size,) the step's data offsets (the global batch)
    record: dict                    # the step's metrics; hooks may add keys
    keep: bool = False              # set by a hook: write this record even off the log_every grid
    extra: dict = field(default_factory=dict)   # free for hooks to pass things between their calls


class TrainHook:
    """Base class: every callback does nothing; override the ones you need."""

    config_keys: tuple[str, ...] = ()

    def attach(self, model, cfg, rank: int) -> None:
        pass

    def start(self, run: RunInfo) -> None:
        pass

    def step_begin(self, step: int, model) -> None:
        pass

    def after_backward(self, step: StepInfo) -> None:
        pass

    def after_optimizer_step(self, step: StepInfo) -> None:
        pass

    def checkpoint(self, step: int, path: Path | None) -> None:
        pass

    def end(self, result) -> None:
        pass
