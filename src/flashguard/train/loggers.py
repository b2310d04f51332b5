"""Where a run's metrics and console lines go: one interface, JSON lines, TensorBoard and the console behind it.

    log = run_logger(cfg, run_dir, main=True, start=0, log_fn=print)
    log.progress(record)     # every step (the console's progress bar)
    log.metrics(record)      # a record kept: metrics.jsonl, TensorBoard
    log.message("...")       # a console line
    log.close()

Only the main process writes; the others get a logger that drops everything.
"""
from __future__ import annotations

from pathlib import Path

from .. import keys
from ..utils.jsonl import JsonlLog

__all__ = ["RunLogger", "JsonlMetrics", "TensorBoardMetrics", "WandbMetrics", "Console", "Loggers", "run_logger"]

WANDB_EXTRA = "pip install flashguard[wandb]"


class RunLogger:
    """The interface; every method does nothing."""

    def progress(self, record: dict) -> None:
        """Called after every step with the step's record (written or not)."""

    def metrics(self, record: dict) -> None:
        """A record to keep (the loop decides which: train.log_every, evaluations, divergence, probes)."""

    def message(self, text: str) -> None:
        """A line for whoever watches the run."""

    def close(self) -> None:
        pass


class JsonlMetrics(RunLogger):
    """metrics.jsonl: one JSON object per kept record, appended and flushed per line."""

    def __init__(self, path: Path):
        self._log = JsonlLog(path)

    def metrics(self, record: dict) -> None:
        self._log.write(record)

    def close(self) -> None:
        self._log.close()


class TensorBoardMetrics(RunLogger):
    """RUN_DIR/tensorboard: every value of a kept record as a scalar at its step."""

    def __init__(self, folder: Path):
        from .config import ConfigError
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("train.tensorboard = true needs the tensorboard package (pip install tensorboard)") from None
        self._tb = SummaryWriter(str(folder))

    def metrics(self, record: dict) -> None:
        step = record[keys.STEP]
        for k, v in record.items():
            if k != keys.STEP:
                self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._tb.close()


class WandbMetrics(RunLogger):
    """Weights & Biases: every value of a kept record logged at its step. The optional extra
    (``pip install flashguard[wandb]``); wandb is imported only when this logger is made.
    ``run``: a wandb run to log into; else the active one (``wandb.run``), else a new one from
    ``wandb.init(**init)``, which ``close`` then finishes (a run it did not start is left open)."""

    def __init__(self, run=None, **init):
        try:
            import wandb
        except ImportError:
            raise ImportError(f"W&B logging needs the wandb package, the optional extra: {WANDB_EXTRA}") from None
        active = run if run is not None else getattr(wandb, "run", None)
        self._own = active is None
        self._run = active if active is not None else wandb.init(**init)

    def metrics(self, record: dict) -> None:
        self._run.log({k: v for k, v in record.items() if k != keys.STEP}, step=int(record[keys.STEP]))

    def close(self) -> None:
        if self._own and self._run is not None:
            self._run.finish()
        self._run = None


class Console(RunLogger):
    """Console lines through ``log_fn``; with ``progress``, a tqdm bar showing loss and tokens/s."""

    def __init__(self, log_fn=print, *, progress: bool = False, total: int = 0, initial: int = 0):
        self._log_fn = log_fn
        self._bar = None
        if progress:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def progress(self, record: dict) -> None:
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record[keys.LOSS_TRAIN]:.4f}", tok_s=f"{record[keys.TOKENS_PER_S]:.0f}")

    def message(self, text: str) -> None:
        self._log_fn(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class Loggers(RunLogger):
    """Several loggers as one, called in order."""

    def __init__(self, loggers=()):
        self.loggers = list(loggers)

    def progress(self, record: dict) -> None:
        for lg in self.loggers:
            lg.progress(record)

    def metrics(self, record: dict) -> None:
        for lg in self.loggers:
            lg.metrics(record)

    def message(self, text: str) -> None:
        for lg in self.loggers:
            lg.message(text)

    def close(self) -> None:
        for lg in self.loggers:
            lg.close()


def run_logger(cfg, run_dir: Path, *, main: bool, start: int = 0, log_fn=print) -> Loggers:
    """The run's logger: on the main process metrics.jsonl, TensorBoard if train.tensorboard, and
    the console (a progress bar if train.progress); elsewhere nothing."""
    if not main:
        return Loggers()
    t = cfg.train
    out = Loggers([JsonlMetrics(Path(run_dir) / "metrics.jsonl")])
    try:
        if t.tensorboard:
            out.loggers.append(TensorBoardMetrics(Path(run_dir) / "tensorboard"))
        out.loggers.append(Console(log_fn, progress=t.progress, total=t.steps, initial=start))
    except BaseException:
        out.close()
        raise
    return out
