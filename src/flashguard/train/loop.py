"""The training loop: nanoGPT-style GPT-2 training with flashguard attention.

One optimizer step consumes ``data.batch_size`` sequences drawn uniformly from train.bin by
a seeded generator; the drawn start offsets are written to batches.jsonl, so that a run can
be replayed exactly (``replay=``). Under torchrun each process takes an equal slice of the
same global batch and DDP averages the gradients, so a run's numbers do not depend on the
number of processes (up to summation order). On CPU a run resumed from a checkpoint
reproduces the uninterrupted run bit for bit: the checkpoint holds model, optimizer, the
sampler's generator, torch's RNG and the step, and the logs are cut back to that step.

What rides along is plugged in from above: ``hooks`` (flashguard.train.hooks.TrainHook, e.g.
flashguard.diagnostics.DiagnosticsHook) and one logger (flashguard.train.loggers: metrics.jsonl,
TensorBoard, the console). The loop knows the hooks only through that interface: each may fit the
model in ``attach`` and claims the config keys it implements; a key that needs a hook
(flashguard.train.config.HOOK_KEYS) set with no hook claiming it is refused before anything runs.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .. import keys
from ..utils.atomic import atomic_write_text
from ..utils.jsonl import JsonlLog
from .checkpoint import latest_checkpoint
from .checkpointer import Checkpointer
from .config import ConfigError, RunConfig, refuse_unclaimed, save_config
from .divergence import LossWatch
from .evaluator import Evaluator, last_ce
from .hooks import RunInfo, StepInfo, TrainHook
from .loggers import run_logger
from .sampling import Batches, batch_sampler, load_replay
from .schedule import learning_rate

__all__ = ["train", "Trainer", "TrainResult", "EXIT_OK", "EXIT_CONFIG", "EXIT_DIVERGED", "JsonlLog", "build_model", "gpt_config"]

EXIT_OK = 0        # finished
EXIT_CONFIG = 2    # bad configuration, data or arguments (one line names the problem)
EXIT_DIVERGED = 3  # the divergence rule fired (train/divergence.py) and train.on_divergence = stop; see
                   # RUN_DIR/divergence.json (with on_divergence = continue the run goes on and ends 0)


@dataclass
class TrainResult:
    run_dir: Path
    steps_done: int
    diverged: bool
    last_loss: float
    best_val: float | None


def _setup_distributed(device_pref: str):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_pref == "auto":
        device_pref = "cuda" if torch.cuda.is_available() else "cpu"
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda but no CUDA device is available")
    device = torch.device(f"cuda:{local}" if device_pref == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return world, rank, device


def gpt_config(cfg: RunConfig):
    """The GPTConfig of a run configuration: the model preset with the config's fields set."""
    from ..model import model_config
    m = cfg.model
    overrides = {k: getattr(m, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias",
                                            "dropout") if getattr(m, k) is not None}
    overrides.update(attn_dropout=m.attn_dropout, qk_layernorm=m.qk_layernorm, attn_softcap=m.attn_softcap,
                     z_loss=m.z_loss)
    try:
        return model_config(m.preset, **overrides)
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None


def build_model(cfg: RunConfig, vocab_size_data: int | None = None):
    """The GPT of a run configuration (per-layer attention overrides applied)."""
    from ..model import GPT
    gcfg = gpt_config(cfg)
    if vocab_size_data is not None and vocab_size_data > gcfg.vocab_size:
        raise ConfigError(f"model.vocab_size ({gcfg.vocab_size}) is smaller than the data's vocabulary "
                          f"({vocab_size_data}); set model.vocab_size or prepare the data with another tokenizer")
    try:
        return GPT(gcfg, cfg.attention.specs(gcfg.n_layer))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"attention: {e}") from None


def _check_kernels(model, device: torch.device) -> None:
    """A layer whose kernel is triton needs triton and a device it runs on (refused before step 0)."""
    from ..attention.triton_flash import triton_device_problem
    for i, spec in enumerate(model.attention_specs):
        if spec.backend == "flash" and spec.kernel == "triton":
            problem = triton_device_problem(device)
            if problem:
                raise ConfigError(f"attention.kernel = triton (layer {i}) cannot run: {problem}")


def _all_mean(x: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        x = x.clone()
        dist.all_reduce(x)
        x /= world
    return x


def _check_hooks(cfg: RunConfig, hooks) -> list:
    """The hooks as a list: each a TrainHook, and every key that needs a hook claimed by one."""
    hooks = list(hooks)
    for h in hooks:
        if not isinstance(h, TrainHook):
            raise TypeError(f"hooks must be flashguard.train.hooks.TrainHook instances, got {type(h).__name__}")
    refuse_unclaimed(cfg, {k for h in hooks for k in h.config_keys})
    return hooks


def _check_batch_split(cfg: RunConfig, world: int) -> None:
    if cfg.data.batch_size % (world * cfg.train.grad_accum):
        raise ConfigError(f"data.batch_size ({cfg.data.batch_size}) must be divisible by the number of "
                          f"processes ({world}) times train.grad_accum ({cfg.train.grad_accum})")


def _open_data(cfg: RunConfig):
    from ..data import TokenDataset
    try:
        return TokenDataset(cfg.data.dir)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.dir: {e}") from None


def _check_data_fits(cfg: RunConfig, data, block: int) -> None:
    """Each split holds more than one block, and its document starts (data.doc_starts) are usable."""
    for split in ("train", "val"):
        if data.num_tokens(split) <= block + 1:
            raise ConfigError(f"model.block_size ({block}) does not fit the {split} split of {cfg.data.dir} "
                              f"({data.num_tokens(split)} tokens)")
        if cfg.data.doc_starts:
            try:
                data.usable_doc_starts(split, block)
            except ValueError as e:
                raise ConfigError(f"data.doc_starts: {e}") from None


def _claim_run_dir(run_dir: Path) -> None:
    """A fresh run's folder: created, and refused when it already holds a run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if latest_checkpoint(run_dir) is not None or (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"{run_dir} already holds a run; use --resume to continue it or another --out")


class Trainer:
    """One training run. Construction does everything before step 0 (and refuses what cannot run);
    ``train()`` loops over ``train_step()``, with evaluation, logging and checkpoints after each step.

    Its parts: the model (``raw_model``; ``model`` is its DDP wrapper under torchrun), the
    optimizer, ``batches`` (flashguard.train.sampling), ``evaluator`` (flashguard.train.evaluator),
    ``checkpointer`` (flashguard.train.checkpointer), ``logger`` (flashguard.train.loggers), the
    divergence ``watch`` and the ``hooks``."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, *, resume: bool = False,
                 replay: str | Path | None = None, log_fn=print, hooks=()):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.hooks = _check_hooks(cfg, hooks)
        self.world, self.rank, self.device = _setup_distributed(cfg.train.device)
        self.main = self.rank == 0
        _check_batch_split(cfg, self.world)
        self.data = _open_data(cfg)
        self._build_model()
        sampler = batch_sampler(cfg)
        self.checkpointer = Checkpointer(cfg, self.run_dir, model=self.raw_model, optimizer=self.optimizer,
                                         sampler=sampler, device=self.device, world=self.world, main=self.main)
        state, resumed_from = self._start_or_resume(resume)
        replayed = load_replay(replay, cfg) if replay is not None else None
        self.logger = run_logger(cfg, self.run_dir, main=self.main, start=self.start, log_fn=log_fn)
        batch_log = JsonlLog(self.run_dir / "batches.jsonl", self.main)
        self.batches = Batches(cfg, self.data, sampler, self.block, batch_log, replayed)
        if resumed_from is not None:
            self.logger.message(f"resumed from {resumed_from} at step {self.start}")
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=cfg.train.autocast == "bf16")
        self.evaluator = Evaluator(cfg, self.data, self.raw_model, self.device, self.autocast, self.block)
        self.watch = LossWatch(cfg.train.divergence_factor, after=cfg.optim.warmup_steps,
                               ceiling=cfg.train.divergence_loss)
        if state is not None:
            self.watch.load_state_dict(Checkpointer.watch_state(state))
        self.diverged, self.last_loss = False, float("nan")

    def _build_model(self) -> None:
        """The seeded model (fitted by the hooks' ``attach``), the optimizer and (under torchrun) the DDP wrapper."""
        cfg, device = self.cfg, self.device
        torch.manual_seed(cfg.train.seed)
        self.raw_model = build_model(cfg, self.data.vocab_size).to(device)
        _check_kernels(self.raw_model, device)
        for h in self.hooks:  # before the optimizer and DDP see the model
            h.attach(self.raw_model, cfg, self.rank)
        self.block = self.raw_model.config.block_size
        _check_data_fits(cfg, self.data, self.block)
        o = cfg.optim
        self.optimizer = self.raw_model.configure_optimizer(weight_decay=o.weight_decay, lr=o.lr,
                                                            betas=(o.beta1, o.beta2), eps=o.eps)
        self.model = self.raw_model
        if self.world > 1:
            ids = [device.index] if device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(self.raw_model, device_ids=ids)

    def _start_or_resume(self, resume: bool) -> tuple[dict | None, Path | None]:
        """The first step and best validation loss (restored with --resume, the logs cut back to the
        checkpoint), and config.toml written: (the checkpoint's state, its path) or (None, None)."""
        self.start, self.best_val = 0, None
        state = resumed_from = None
        if resume:
            path, state = self.checkpointer.restore()
            self.start, self.best_val = state["step"], state.get("best_val")
            if self.main:
                JsonlLog.truncate_after(self.run_dir / "metrics.jsonl", self.start - 1)
                JsonlLog.truncate_after(self.run_dir / "batches.jsonl", self.start - 1)
                resumed_from = path
        elif self.main:
            _claim_run_dir(self.run_dir)
        if self.world > 1:
            dist.barrier()
        if self.main:
            save_config(self.cfg, self.run_dir / "config.toml")
        return state, resumed_from

    def train(self) -> TrainResult:
        t = self.cfg.train
        step, result = self.start, None
        try:
            run = RunInfo(cfg=self.cfg, run_dir=self.run_dir, model=self.raw_model, start=self.start,
                          rank=self.rank, world=self.world, log=self.logger.message)
            for h in self.hooks:
                h.start(run)
            for step in range(self.start, t.steps):
                info, bad = self.train_step(step)
                stop = bad and t.on_divergence == "stop"
                is_best = self._evaluate(step + 1, info.record) if not stop else False
                if step % t.log_every == 0 or keys.LOSS_VAL in info.record or bad or info.keep:
                    self.logger.metrics(info.record)
                self.logger.progress(info.record)
                if stop:
                    break
                if self.checkpointer.due(step + 1, is_best):
                    self._checkpoint(step + 1, is_best)
            steps_done = step if self.diverged and t.on_divergence == "stop" else t.steps
            result = TrainResult(self.run_dir, steps_done, self.diverged, self.last_loss, self.best_val)
        finally:
            try:
                for h in self.hooks:
                    h.end(result)
            finally:
                self.logger.close()
                self.batches.close()
        return result

    def train_step(self, step: int) -> tuple[StepInfo, bool]:
        """One optimizer step (the hooks called at their points, the batch logged): its StepInfo,
        and whether the divergence rule fired at it."""
        t, o = self.cfg.train, self.cfg.optim
        for h in self.hooks:
            h.step_begin(step, self.raw_model)
        t0 = time.perf_counter()
        lr = learning_rate(step, o, t.steps)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        indices = self.batches.indices(step)
        train_loss = self._forward_backward(indices)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.raw_model.parameters(), o.grad_clip or float("inf")).item()
        record = {keys.STEP: step, keys.LOSS_TRAIN: train_loss, keys.LR: lr, keys.GRAD_NORM: grad_norm}
        info = StepInfo(step=step, model=self.raw_model, indices=indices, record=record)
        for h in self.hooks:  # metrics into the record, before optimizer.step()
            h.after_backward(info)
        bad = self._check_divergence(info, train_loss, grad_norm)
        if not bad or (t.on_divergence == "continue" and math.isfinite(grad_norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for h in self.hooks:
            h.after_optimizer_step(info)
        self.batches.record(step, indices)
        dt = time.perf_counter() - t0
        record[keys.STEP_TIME] = dt
        record[keys.TOKENS_PER_S] = self.cfg.data.batch_size * self.block / dt
        self.last_loss = train_loss
        return info, bad

    def _forward_backward(self, indices: torch.Tensor) -> float:
        """This process's slice of the global batch in train.grad_accum micro-batches, gradients
        accumulated (DDP syncs at the last): the cross-entropy, averaged over processes."""
        t = self.cfg.train
        per_rank = self.cfg.data.batch_size // self.world
        micro = per_rank // t.grad_accum
        mine = indices[self.rank * per_rank:(self.rank + 1) * per_rank]
        loss_sum = torch.zeros((), device=self.device)
        for j in range(t.grad_accum):
            x, y = self.data.batch("train", mine[j * micro:(j + 1) * micro], self.block)
            x, y = x.to(self.device), y.to(self.device)
            last = self.world == 1 or j == t.grad_accum - 1
            with contextlib.nullcontext() if last else self.model.no_sync():
                with self.autocast:
                    _, loss = self.model(x, y)
                (loss / t.grad_accum).backward()
            loss_sum += last_ce(self.raw_model, loss).detach() / t.grad_accum
        return _all_mean(loss_sum, self.world).item()

    def _check_divergence(self, info: StepInfo, loss: float, grad_norm: float) -> bool:
        """The divergence rule on this step; when it fires: marked in the record, divergence.json written."""
        why = self.watch.update(info.step, loss, grad_norm)
        if why is None:
            return False
        self.diverged = True
        info.record[keys.DIVERGED] = 1
        if self.main:
            _write_divergence(self.run_dir, info.step, info.record, info.indices, loss, grad_norm, why)
            self.logger.message(f"divergence at step {info.step}: {why}"
                                f" (details in {self.run_dir / 'divergence.json'})")
        return True

    def _evaluate(self, done: int, record: dict) -> bool:
        """The validation loss into ``record`` when due: whether it is the best so far."""
        if not self.evaluator.due(done):
            return False
        t0 = time.perf_counter()
        val = self.evaluator()
        record[keys.EVAL_TIME] = time.perf_counter() - t0
        record[keys.LOSS_VAL] = val
        is_best = self.best_val is None or val < self.best_val
        self.best_val = val if is_best else self.best_val
        return is_best

    def _checkpoint(self, done: int, is_best: bool) -> None:
        path = self.checkpointer.save(done, best_val=self.best_val, watch=self.watch, is_best=is_best)
        for h in self.hooks:
            h.checkpoint(done, path)


def train(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, replay: str | Path | None = None,
          log_fn=print, hooks=()) -> TrainResult:
    """Train ``cfg`` into ``run_dir``. ``hooks``: TrainHooks called at the loop's points
    (flashguard.train.hooks); ``log_fn`` receives the console lines."""
    return Trainer(cfg, run_dir, resume=resume, replay=replay, log_fn=log_fn, hooks=hooks).train()


def _write_divergence(run_dir: Path, step: int, record: dict, indices: torch.Tensor, loss: float, grad_norm: float,
                      reason: str):
    ckpt = latest_checkpoint(run_dir)
    bundle = {"step": step, "loss": loss, "grad_norm": grad_norm, "reason": reason, "metrics": record,
              "batch_indices": indices.tolist(),
              "last_good_checkpoint": str(ckpt) if ckpt else None,
              "how_to_replay": "flashguard train CONFIG --out NEW_DIR --replay " + str(run_dir)}
    atomic_write_text(run_dir / "divergence.json", json.dumps(bundle, indent=1, default=str) + "\n")
