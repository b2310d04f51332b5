"""The training loop: nanoGPT-style GPT-2 training with flashguard attention.

One optimizer step consumes ``data.batch_size`` sequences drawn uniformly from train.bin by
a seeded generator; the drawn start offsets are written to batches.jsonl, so that a run can
be replayed exactly (``replay=``). Under torchrun each process takes an equal slice of the
same global batch and DDP averages the gradients, so a run's numbers do not depend on the
number of processes (up to summation order). On CPU a run resumed from a checkpoint
reproduces the uninterrupted run bit for bit: the checkpoint holds model, optimizer, the
sampler's generator, torch's RNG and the step, and the logs are cut back to that step.

What rides along is plugged in from above: ``hooks`` (flashguard.train.hooks.TrainHook: the
diagnostics' probes, flashguard.diagnostics.DiagnosticsHook, are one; the [injection] section
is another, added by the loop itself) and one logger (flashguard.train.loggers: metrics.jsonl,
TensorBoard, the console).
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
from ..utils.jsonl import read_jsonl
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import ConfigError, RunConfig, config_to_dict, load_config, save_config
from .divergence import LossWatch
from .hooks import RunInfo, StepInfo, TrainHook
from .loggers import run_logger
from .schedule import learning_rate

__all__ = ["train", "TrainResult", "EXIT_OK", "EXIT_CONFIG", "EXIT_DIVERGED", "JsonlLog", "build_model", "gpt_config"]

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


class JsonlLog:
    """Append-only JSON-lines log, flushed per line (a kill loses nothing written before)."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path, self.enabled = Path(path), enabled
        self._f = open(self.path, "a") if enabled else None

    def write(self, record: dict) -> None:
        if self._f:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f:
            self._f.close()

    read = staticmethod(read_jsonl)  # records in file order; [] for a missing file

    @staticmethod
    def truncate_after(path: Path, step: int) -> None:
        """Keep the records of steps <= ``step`` (the ones a resumed run will not redo)."""
        if Path(path).exists():
            kept = [r for r in JsonlLog.read(path) if r.get("step", -1) <= step]
            atomic_write_text(Path(path), "".join(json.dumps(r) + "\n" for r in kept))


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
    hooks = list(hooks)
    for h in hooks:
        if not isinstance(h, TrainHook):
            raise TypeError(f"hooks must be flashguard.train.hooks.TrainHook instances, got {type(h).__name__}")
    claimed = {k for h in hooks for k in h.config_keys}
    if cfg.train.diagnostics_every and "train.diagnostics_every" not in claimed:
        raise ConfigError(f"train.diagnostics_every = {cfg.train.diagnostics_every} needs the diagnostics hook: "
                          "train(cfg, run_dir, hooks=[flashguard.diagnostics.DiagnosticsHook()]) "
                          "(flashguard train and repro pass it)")
    if cfg.train.update_entropy_every and "train.update_entropy_every" not in claimed:
        raise ConfigError(f"train.update_entropy_every = {cfg.train.update_entropy_every} needs its hook: "
                          "train(cfg, run_dir, hooks=[flashguard.diagnostics.DiagnosticsHook()]), which carries "
                          "flashguard.diagnostics.update_entropy.UpdateEntropyHook (flashguard train and repro pass it)")
    return hooks


def train(cfg: RunConfig, run_dir: str | Path, *, resume: bool = False, replay: str | Path | None = None,
          log_fn=print, hooks=()) -> TrainResult:
    """Train ``cfg`` into ``run_dir``. ``hooks``: TrainHooks called at the loop's points
    (flashguard.train.hooks); ``log_fn`` receives the console lines."""
    from ..data import TokenDataset

    hooks = _check_hooks(cfg, hooks)
    run_dir = Path(run_dir)
    world, rank, device = _setup_distributed(cfg.train.device)
    main = rank == 0
    t = cfg.train
    if cfg.data.batch_size % (world * t.grad_accum):
        raise ConfigError(f"data.batch_size ({cfg.data.batch_size}) must be divisible by the number of "
                          f"processes ({world}) times train.grad_accum ({t.grad_accum})")
    try:
        data = TokenDataset(cfg.data.dir)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"data.dir: {e}") from None

    torch.manual_seed(t.seed)
    model = build_model(cfg, data.vocab_size).to(device)
    _check_kernels(model, device)
    # [injection]: delta hooks in the chosen flash layers, their draws keyed by (seed, step, call, layer, rank)
    from .injection import InjectionHook
    injection = InjectionHook.install(model, cfg, rank=rank)
    if injection is not None:
        hooks.insert(0, injection)
    block = model.config.block_size
    for split in ("train", "val"):
        if data.num_tokens(split) <= block + 1:
            raise ConfigError(f"model.block_size ({block}) does not fit the {split} split of {cfg.data.dir} "
                              f"({data.num_tokens(split)} tokens)")
        if cfg.data.doc_starts:
            try:
                data.usable_doc_starts(split, block)
            except ValueError as e:
                raise ConfigError(f"data.doc_starts: {e}") from None
    o = cfg.optim
    optimizer = model.configure_optimizer(weight_decay=o.weight_decay, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    raw_model = model
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)

    sampler = torch.Generator().manual_seed(t.seed + 1)
    start, best_val, resumed_from = 0, None, None
    metrics_path, batches_path = run_dir / "metrics.jsonl", run_dir / "batches.jsonl"
    if resume:
        ckpt_path = latest_checkpoint(run_dir)
        if ckpt_path is None:
            raise ConfigError(f"--resume: no checkpoint in {run_dir / 'checkpoints'}")
        state = load_checkpoint(ckpt_path)
        raw_model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        sampler.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        if device.type == "cuda" and state.get("cuda_rng") is not None:
            # the CUDA generator draws the sdpa backend's dropout masks (flash and math seed theirs
            # from the CPU generator above); a checkpoint from a CPU run has none to restore
            torch.cuda.set_rng_state(state["cuda_rng"], device)
        start, best_val = state["step"], state.get("best_val")
        if main:
            JsonlLog.truncate_after(metrics_path, start - 1)
            JsonlLog.truncate_after(batches_path, start - 1)
            resumed_from = ckpt_path
    elif main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if latest_checkpoint(run_dir) is not None or metrics_path.exists():
            raise ConfigError(f"{run_dir} already holds a run; use --resume to continue it or another --out")
    if world > 1:
        dist.barrier()
    if main:
        save_config(cfg, run_dir / "config.toml")

    replayed = None
    if replay is not None:
        replayed = {r["step"]: r["indices"] for r in JsonlLog.read(Path(replay) / "batches.jsonl")}
        if not replayed:
            raise ConfigError(f"--replay: {Path(replay) / 'batches.jsonl'} has no batches")
        other = load_config(Path(replay) / "config.toml") if (Path(replay) / "config.toml").exists() else None
        if other is not None and other.data.batch_size != cfg.data.batch_size:
            raise ConfigError(f"--replay: data.batch_size {cfg.data.batch_size} differs from the replayed run's "
                              f"{other.data.batch_size}")

    logger = run_logger(cfg, run_dir, main=main, start=start, log_fn=log_fn)
    batches = JsonlLog(batches_path, main)
    if resumed_from is not None:
        logger.message(f"resumed from {resumed_from} at step {start}")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.autocast == "bf16")
    per_rank = cfg.data.batch_size // world
    micro = per_rank // t.grad_accum
    tokens_per_step = cfg.data.batch_size * block

    def evaluate() -> float:
        gen = torch.Generator().manual_seed(t.seed + 2)  # the same validation batches every time
        raw_model.eval()
        losses = []
        with torch.no_grad(), autocast:
            for _ in range(t.eval_batches):
                idx = data.sample_indices("val", cfg.data.batch_size, block, gen, doc_starts=cfg.data.doc_starts)
                x, y = data.batch("val", idx, block)
                losses.append(_ce_of(raw_model, x.to(device), y.to(device)))
        raw_model.train()
        return float(sum(losses) / len(losses))

    last_loss, diverged, step, result = float("nan"), False, start, None
    watch = LossWatch(t.divergence_factor, after=o.warmup_steps, ceiling=t.divergence_loss)
    if resume:
        # the watch's running minimum, initial loss and baseline window; a checkpoint from before
        # the initial-loss and gradient tests kept only the running minimum (those tests stay off)
        watch.load_state_dict(state.get("divergence_watch") or {"best": state.get("loss_min", math.inf)})
    try:
        run = RunInfo(cfg=cfg, run_dir=run_dir, model=raw_model, start=start, rank=rank, world=world,
                      log=logger.message)
        for h in hooks:
            h.start(run)
        for step in range(start, t.steps):
            for h in hooks:
                h.step_begin(step, raw_model)
            t0 = time.perf_counter()
            lr = learning_rate(step, o, t.steps)
            for g in optimizer.param_groups:
                g["lr"] = lr
            if replayed is not None:
                if step not in replayed:
                    raise ConfigError(f"--replay: the replayed run has no batch for step {step}")
                indices = torch.tensor(replayed[step], dtype=torch.long)
            else:
                indices = data.sample_indices("train", cfg.data.batch_size, block, sampler,
                                              doc_starts=cfg.data.doc_starts)
            mine = indices[rank * per_rank:(rank + 1) * per_rank]
            loss_sum = torch.zeros((), device=device)
            for j in range(t.grad_accum):
                x, y = data.batch("train", mine[j * micro:(j + 1) * micro], block)
                x, y = x.to(device), y.to(device)
                sync = contextlib.nullcontext() if (world == 1 or j == t.grad_accum - 1) else model.no_sync()
                with sync:
                    with autocast:
                        _, loss = model(x, y)
                    (loss / t.grad_accum).backward()
                loss_sum += _last_ce(raw_model, loss).detach() / t.grad_accum
            train_loss = _all_mean(loss_sum, world).item()
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), o.grad_clip or float("inf")).item()
            record = {keys.STEP: step, keys.LOSS_TRAIN: train_loss, keys.LR: lr, keys.GRAD_NORM: grad_norm}
            info = StepInfo(step=step, model=raw_model, indices=indices, record=record)
            for h in hooks:  # e.g. the probes and the monitor, into the record, before optimizer.step()
                h.after_backward(info)
            why = watch.update(step, train_loss, grad_norm)
            bad = why is not None
            if bad:
                diverged = True
                record[keys.DIVERGED] = 1
                if main:
                    _write_divergence(run_dir, step, record, indices, train_loss, grad_norm, why)
                    logger.message(f"divergence at step {step}: {why}"
                           f" (details in {run_dir / 'divergence.json'})")
            if not bad or (t.on_divergence == "continue" and math.isfinite(grad_norm)):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            for h in hooks:
                h.after_optimizer_step(info)
            batches.write({"step": step, "indices": indices.tolist()})
            dt = time.perf_counter() - t0
            record[keys.STEP_TIME] = dt
            record[keys.TOKENS_PER_S] = tokens_per_step / dt
            last_loss = train_loss
            done = step + 1
            if t.eval_every and (done % t.eval_every == 0 or done == t.steps) and not (bad and t.on_divergence == "stop"):
                val = evaluate()
                record[keys.LOSS_VAL] = val
                is_best = best_val is None or val < best_val
                best_val = val if is_best else best_val
            else:
                is_best = False
            if step % t.log_every == 0 or keys.LOSS_VAL in record or bad or info.keep:
                logger.metrics(record)
            logger.progress(record)
            if bad and t.on_divergence == "stop":
                break
            if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps or is_best:
                path = None
                if main:
                    state = {"step": done, "model": raw_model.state_dict(), "optim": optimizer.state_dict(),
                             "data_rng": sampler.get_state(), "torch_rng": torch.get_rng_state(),
                             "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                             "best_val": best_val, "divergence_watch": watch.state_dict(),
                             "config": config_to_dict(cfg), "world_size": world}
                    path = save_checkpoint(run_dir, done, state, t.keep_last, best=is_best)
                if world > 1:
                    dist.barrier()
                for h in hooks:
                    h.checkpoint(done, path)
        steps_done = step if diverged and t.on_divergence == "stop" else t.steps
        result = TrainResult(run_dir, steps_done, diverged, last_loss, best_val)
    finally:
        try:
            for h in hooks:
                h.end(result)
        finally:
            logger.close()
            batches.close()
    return result


def _last_ce(model, loss: torch.Tensor) -> torch.Tensor:
    """The cross-entropy part of the last training loss (the model may add a z-loss)."""
    ce = getattr(model, "last_ce", None)
    return ce if ce is not None else loss


def _ce_of(model, x, y) -> float:
    _, loss = model(x, y)
    return float(_last_ce(model, loss))


def _write_divergence(run_dir: Path, step: int, record: dict, indices: torch.Tensor, loss: float, grad_norm: float,
                      reason: str):
    ckpt = latest_checkpoint(run_dir)
    bundle = {"step": step, "loss": loss, "grad_norm": grad_norm, "reason": reason, "metrics": record,
              "batch_indices": indices.tolist(),
              "last_good_checkpoint": str(ckpt) if ckpt else None,
              "how_to_replay": "flashguard train CONFIG --out NEW_DIR --replay " + str(run_dir)}
    atomic_write_text(run_dir / "divergence.json", json.dumps(bundle, indent=1, default=str) + "\n")
