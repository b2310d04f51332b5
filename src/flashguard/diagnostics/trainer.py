"""The trainer's diagnostics hook (``train.diagnostics_every``, ``train.diagnostics_layers``).

    train(cfg, run_dir, hooks=training_hooks())   # [InjectionHook(), DiagnosticsHook()]: what flashguard
                                                   # train and repro pass

``DiagnosticsHook`` is a flashguard.train.hooks.TrainHook: the training loop does not know the
diagnostics; they plug in from above. It does nothing when ``train.diagnostics_every = 0``.

When probes run: on a step with ``step % diagnostics_every == 0`` the probes read that step's
*own* forward and backward - hooks record the chosen layers' q, k, v, the qkv input and dO
during the first micro-batch (no extra model forward or backward) - and run after the
backward and the gradient clipping, *before* the optimizer step. So the weight metrics are
those of the weights that produced the step's gradient, and the logged record holds the
step's loss, gradient norm and probe metrics side by side. dO is rescaled by the number of
accumulation micro-batches (the gradient of the mean loss). Only the main process probes.

The probes never change training: they only read tensors, run under ``torch.no_grad`` with
the global RNG forked, and a failing probe is reported (console and ``diagnostics/failed``)
without stopping the run. Their cost is logged as ``time/diagnostics_s`` (also counted in
``time/step_s``).

Every step's record also goes through the early-warning Monitor: ``monitor/state`` (0 ok,
1 watch, 2 warning) is written into it and a console line announces each change of state.

State that spans probes (ProbeState) is saved after each probe as
``RUN_DIR/diagnostics/state_<step>.json``; snapshots older than the one the oldest kept
checkpoint needs are deleted. A resumed run continues from the snapshot before its start
step, and rebuilds the monitor by replaying the kept metrics.jsonl records.
"""
from __future__ import annotations

import time
import traceback
from pathlib import Path

from .. import keys
from ..train.hooks import RunInfo, StepInfo, TrainHook
from ..train.injection import InjectionHook
from .capture import CaptureHooks, resolve_layers
from ..utils.jsonl import read_metrics
from .monitor import Monitor, MonitorThresholds
from .probes import run_probes
from .state import ProbeState
from .update_entropy import UpdateEntropyHook

__all__ = ["TrainerDiagnostics", "DiagnosticsHook", "training_hooks", "DEFAULT_EVERY"]

# The recommended interval. One probe of all four tiny-cpu layers costs about three training
# steps (benchmarks/diagnostics.py on one core: 1.15 s against 0.38 s per step; the measurement
# alone, the fp64 reference and the layer's arithmetic, 1.88 steps), so every 50 steps adds ~6 %
# (measured: +2.8 % to +7.2 % over four runs; the goal is <= 10 %), and the monitor still sees a
# runaway within ~100 steps.
DEFAULT_EVERY = 50


class TrainerDiagnostics:
    """Created by DiagnosticsHook on the main process when ``train.diagnostics_every > 0``.

        diag = TrainerDiagnostics(cfg, raw_model, run_dir, start=start, log_fn=print)
        each step:  diag.begin(step)   # before the forward: hooks if the probes are due
                    ...forward/backward, clip...
                    diag.end(step, record, grad_scale=grad_accum)   # before optimizer.step()
        finally:    diag.close()
    """

    def __init__(self, cfg, model, run_dir, *, start: int = 0, log_fn=print):
        from ..train.config import ConfigError
        t = cfg.train
        self.every = int(t.diagnostics_every)
        self.model = model
        self.run_dir = Path(run_dir)
        self.log = log_fn
        try:
            self.layers = resolve_layers(model.config.n_layer, list(t.diagnostics_layers))
        except ValueError as e:
            raise ConfigError(f"train.diagnostics_layers: {e}") from None
        self.state = ProbeState()
        if start > 0:
            self.state = ProbeState.load_before(self.run_dir, start) or ProbeState()
            for s, p in ProbeState.snapshots(self.run_dir):
                if s >= start:  # left by steps the resumed run redoes
                    p.unlink(missing_ok=True)
        self.monitor = Monitor(MonitorThresholds.for_warmup(cfg.optim.warmup_steps))
        if start > 0 and (self.run_dir / "metrics.jsonl").exists():
            for r in read_metrics(self.run_dir / "metrics.jsonl"):
                if r.get(keys.STEP, -1) < start:
                    self.monitor.update(r)
        self._hooks: CaptureHooks | None = None
        self._failed_once = False

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def begin(self, step: int) -> None:
        self.close()
        if self.due(step):
            self._hooks = CaptureHooks(self.model, self.layers).install()

    def end(self, step: int, record: dict, grad_scale: float = 1.0) -> None:
        """Run the probes (if captured this step), then the monitor; both write into ``record``."""
        if self._hooks is not None:
            t0 = time.perf_counter()
            hooks, self._hooks = self._hooks, None
            hooks.remove()
            try:
                record.update(run_probes(self.model, hooks.captures(grad_scale=grad_scale),
                                         state=self.state, step=step))
                self._save_state(step)
            except Exception as e:  # diagnostics must never stop a training run
                record[keys.DIAGNOSTICS_FAILED] = 1.0
                if not self._failed_once:
                    self.log(f"diagnostics: probes failed at step {step}: {e!r}\n{traceback.format_exc()}")
                    self._failed_once = True
            record[keys.DIAGNOSTICS_TIME] = time.perf_counter() - t0
        status = self.monitor.update(record)
        record[keys.MONITOR_STATE] = float(status.state)
        if status.changed:
            self.log(status.message())

    def close(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def _save_state(self, step: int) -> None:
        d = ProbeState.snapshot_dir(self.run_dir)
        self.state.save(d / f"state_{step:07d}.json")
        from ..train.checkpoint import list_checkpoints
        ckpts = list_checkpoints(self.run_dir)
        snaps = ProbeState.snapshots(self.run_dir)
        if not ckpts:
            return
        # the oldest kept checkpoint (step C) resumes from the last snapshot before C
        needed = [s for s, _ in snaps if s < ckpts[0][0]]
        floor = needed[-1] if needed else 0
        for s, p in snaps:
            if s < floor:
                p.unlink(missing_ok=True)


class DiagnosticsHook(TrainHook):
    """The probes and the monitor as a hook of the training loop (main process only): the capture
    hooks go in at ``step_begin`` when the probes are due, probes and monitor write into the step's
    record at ``after_backward`` (before the optimizer step; a probed step's record is always
    written), and the capture hooks come out at ``end``. It also carries the spectral entropy of the
    W_Q W_K^T update (``train.update_entropy_every``, flashguard.diagnostics.update_entropy), so
    that every caller that passes this hook (``flashguard train``, the repro's runs) has it; do not
    pass an UpdateEntropyHook beside it."""

    config_keys = ("train.diagnostics_every", "train.diagnostics_layers", *UpdateEntropyHook.config_keys)

    def __init__(self):
        self.diag: TrainerDiagnostics | None = None
        self._grad_scale = 1.0
        self.update_entropy = UpdateEntropyHook()

    def start(self, run: RunInfo) -> None:
        self.update_entropy.start(run)
        if run.main and run.cfg.train.diagnostics_every:
            self.diag = TrainerDiagnostics(run.cfg, run.model, run.run_dir, start=run.start, log_fn=run.log)
            self._grad_scale = run.cfg.train.grad_accum

    def step_begin(self, step: int, model) -> None:
        if self.diag is not None:
            self.diag.begin(step)

    def after_backward(self, step: StepInfo) -> None:
        self.update_entropy.after_backward(step)   # before the monitor reads the record
        if self.diag is not None:
            self.diag.end(step.step, step.record, grad_scale=self._grad_scale)
            if keys.DIAGNOSTICS_TIME in step.record:
                step.keep = True

    def end(self, result) -> None:
        self.update_entropy.end(result)
        if self.diag is not None:
            self.diag.close()


def training_hooks() -> list[TrainHook]:
    """The standard hooks of a training run, new, in the order the loop calls them: the [injection]
    section's (flashguard.train.injection.InjectionHook; nothing when injection.rule = none) and the
    probes' (DiagnosticsHook, the update entropy included). Together they claim every key of
    flashguard.train.config.HOOK_KEYS; ``flashguard train`` and the repro's runs pass them."""
    return [InjectionHook(), DiagnosticsHook()]
