"""Checkpoints: atomic writes, the last N kept plus the best (lowest validation loss).

A checkpoint named ckpt_0000100.pt holds the state after 100 completed steps: model,
optimizer, the data sampler's generator, torch's RNG, the step and the best loss so far.
Written to a temporary file and renamed, so a kill -9 at any moment leaves either the old
or the new file, never half of one.
"""
from __future__ import annotations

import io
import re
from pathlib import Path

import torch

from ..utils.atomic import atomic_write_bytes

_NAME = re.compile(r"ckpt_(\d{7})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of the numbered checkpoints, oldest first."""
    d = checkpoint_dir(run_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.search(p.name))]
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def save_checkpoint(run_dir: Path, step: int, state: dict, keep_last: int, best: bool = False) -> Path:
    d = checkpoint_dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = d / f"ckpt_{step:07d}.pt"
    atomic_write_bytes(path, data)
    if best:
        atomic_write_bytes(d / "best.pt", data)
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)
