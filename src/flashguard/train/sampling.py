"""The batches of a training run: drawn by a seeded generator, or replayed from another run's
batches.jsonl, and logged to this run's batches.jsonl (what ``--replay`` reads)."""
from __future__ import annotations

from pathlib import Path

import torch

from ..utils.jsonl import read_jsonl
from .config import ConfigError, load_config

__all__ = ["Batches", "load_replay", "batch_sampler"]


def batch_sampler(cfg) -> torch.Generator:
    """The generator a run draws its batches from: seeded from train.seed (+ 1, apart from the
    model's initialisation), so every run of a seed sees the same batches."""
    return torch.Generator().manual_seed(cfg.train.seed + 1)


def load_replay(replay: str | Path, cfg) -> dict[int, list[int]]:
    """step -> the start offsets another run logged, refused when empty or of another batch size."""
    replay = Path(replay)
    replayed = {r["step"]: r["indices"] for r in read_jsonl(replay / "batches.jsonl")}
    if not replayed:
        raise ConfigError(f"--replay: {replay / 'batches.jsonl'} has no batches")
    other = load_config(replay / "config.toml") if (replay / "config.toml").exists() else None
    if other is not None and other.data.batch_size != cfg.data.batch_size:
        raise ConfigError(f"--replay: data.batch_size {cfg.data.batch_size} differs from the replayed run's "
                          f"{other.data.batch_size}")
    return replayed


class Batches:
    """Each step's global batch of start offsets (``data.batch_size`` of them), written to batches.jsonl."""

    def __init__(self, cfg, data, sampler: torch.Generator, block: int, log, replayed: dict | None = None):
        self.cfg, self.data, self.sampler, self.block = cfg, data, sampler, block
        self.log, self.replayed = log, replayed

    def indices(self, step: int) -> torch.Tensor:
        if self.replayed is not None:
            if step not in self.replayed:
                raise ConfigError(f"--replay: the replayed run has no batch for step {step}")
            return torch.tensor(self.replayed[step], dtype=torch.long)
        d = self.cfg.data
        return self.data.sample_indices("train", d.batch_size, self.block, self.sampler, doc_starts=d.doc_starts)

    def record(self, step: int, indices: torch.Tensor) -> None:
        self.log.write({"step": step, "indices": indices.tolist()})

    def close(self) -> None:
        self.log.close()
