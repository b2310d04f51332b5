"""A training run's state on disk: what a checkpoint holds, writing it and restoring it.

The state is everything a resumed run needs to reproduce the uninterrupted one bit for bit on
CPU: model, optimizer, the data sampler's generator, torch's RNG (and CUDA's on a GPU), the
step, the best validation loss and the divergence watch (flashguard.train.divergence)."""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import ConfigError, config_to_dict

__all__ = ["Checkpointer"]


class Checkpointer:
    """Writes and restores one run's checkpoints (only the main process writes; all restore)."""

    def __init__(self, cfg, run_dir: Path, *, model, optimizer, sampler: torch.Generator, device: torch.device,
                 world: int, main: bool):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self.device, self.world, self.main = device, world, main

    def due(self, done: int, is_best: bool) -> bool:
        """Whether the run saves after ``done`` completed steps (every checkpoint_every, at the end, at a best)."""
        t = self.cfg.train
        return bool(t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps or is_best

    def restore(self) -> tuple[Path, dict]:
        """Load the latest checkpoint into the model, optimizer and generators: (its path, its state)."""
        path = latest_checkpoint(self.run_dir)
        if path is None:
            raise ConfigError(f"--resume: no checkpoint in {self.run_dir / 'checkpoints'}")
        state = load_checkpoint(path)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self.sampler.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and state.get("cuda_rng") is not None:
            # the CUDA generator draws the sdpa backend's dropout masks (flash and math seed theirs
            # from the CPU generator above); a checkpoint from a CPU run has none to restore
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        return path, state

    @staticmethod
    def watch_state(state: dict) -> dict:
        """The divergence watch's state in a checkpoint; one from before the initial-loss and gradient
        tests kept only the running minimum (those tests stay off)."""
        return state.get("divergence_watch") or {"best": state.get("loss_min", math.inf)}

    def save(self, done: int, *, best_val: float | None, watch, is_best: bool) -> Path | None:
        """Write the state after ``done`` steps (main process; the others wait): its path, None elsewhere."""
        path = None
        if self.main:
            state = {"step": done, "model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                     "data_rng": self.sampler.get_state(), "torch_rng": torch.get_rng_state(),
                     "cuda_rng": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
                     "best_val": best_val, "divergence_watch": watch.state_dict(),
                     "config": config_to_dict(self.cfg), "world_size": self.world}
            path = save_checkpoint(self.run_dir, done, state, self.cfg.train.keep_last, best=is_best)
        if self.world > 1:
            dist.barrier()
        return path
