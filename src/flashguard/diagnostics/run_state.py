"""A run folder's model at a checkpoint, and the batches the run logged: what ``diagnose`` and
the lab's captured problems read."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunState", "load_run_state", "pick_checkpoint", "logged_batches"]


def pick_checkpoint(run_dir: Path, step: int | None) -> tuple[int, Path]:
    """(step, path) of the checkpoint after ``step`` completed steps (None: the latest)."""
    from ..train.checkpoint import list_checkpoints
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {run_dir / 'checkpoints'}")
    if step is None:
        return found[-1]
    for s, p in found:
        if s == step:
            return s, p
    raise ValueError(f"no checkpoint at step {step} in {run_dir / 'checkpoints'}; "
                     f"available: {', '.join(str(s) for s, _ in found)}")


def logged_batches(run_dir: Path, step: int, n: int = 1) -> list[tuple[int, list[int]]]:
    """The ``n`` latest batches logged at or before ``step``, newest first: (step, indices)."""
    from ..utils.jsonl import read_jsonl
    if n < 1:
        raise ValueError(f"number of batches must be >= 1, got {n}")
    logged = {r["step"]: r["indices"] for r in read_jsonl(run_dir / "batches.jsonl") if "step" in r}
    earlier = sorted((s for s in logged if s <= step), reverse=True)
    if not earlier:
        raise ValueError(f"{run_dir / 'batches.jsonl'} has no batch at or before step {step}")
    return [(s, logged[s]) for s in earlier[:n]]


@dataclass
class RunState:
    model: object            # flashguard.model.GPT, weights of the checkpoint, eval mode
    config: object           # the run's resolved TrainConfig
    data: object             # flashguard.data.TokenDataset
    step: int
    checkpoint: Path


def load_run_state(run_dir, step: int | None = None, *, data_dir=None, device: str = "cpu") -> RunState:
    """Rebuild the model of ``run_dir`` from the configuration stored in its checkpoint."""
    from ..data import TokenDataset
    from ..train.checkpoint import load_checkpoint
    from ..train.config import config_from_dict
    from ..train.loop import build_model

    run_dir = Path(run_dir)
    ckpt_step, ckpt_path = pick_checkpoint(run_dir, step)
    state = load_checkpoint(ckpt_path)
    cfg = config_from_dict(state["config"])
    data = TokenDataset(data_dir or cfg.data.dir)
    model = build_model(cfg, data.vocab_size)
    model.load_state_dict(state["model"])
    model.to(device).eval()
    return RunState(model, cfg, data, ckpt_step, ckpt_path)
