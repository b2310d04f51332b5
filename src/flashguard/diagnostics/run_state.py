"""A run folder's model at a checkpoint, and the batches the run logged: what ``diagnose`` and
the lab's captured problems read; and what kind of folder it is: a flashguard training run
(checkpoints, config.toml) or a watch folder of the user's own model (``flashguard.watch``:
watch.json and metrics.jsonl, no checkpoint: its probes were run while the user's model trained)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunState", "load_run_state", "pick_checkpoint", "logged_batches", "watch_meta", "is_watch_folder",
           "WATCH_LABEL"]

WATCH_LABEL = "a watch folder of your model (flashguard.watch), not a flashguard training run"


def watch_meta(folder) -> dict | None:
    """watch.json of a watch folder (``flashguard.watch``'s ``log_dir``), or None for another folder.
    A watch.json written before it said its kind (no ``kind``) counts when it has the watch's fields."""
    import json
    path = Path(folder) / "watch.json"
    if not path.is_file():
        return None
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    if meta.get("kind") == "flashguard.watch" or ("kind" not in meta and "every" in meta and "layers" in meta):
        return meta
    return None


def is_watch_folder(folder) -> bool:
    return watch_meta(folder) is not None


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
