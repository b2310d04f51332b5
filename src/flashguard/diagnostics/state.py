"""State that spans probes, saved as JSON so that a resumed run or ``flashguard diagnose``
continues where the last probe stopped.

What a probe needs from earlier probes:

* the previous spectral norm of every W_Q / W_K head slice and the step it was measured at
  (growth rates);
* per layer, the running sum and count of the mean delta error (``numerics/delta_err_cumsum``);
* per layer, the previous W_Q gradient-error matrix and the running sum of all earlier ones
  (``grad/wq_err_cos_prev`` and ``grad/wq_err_cos_sum``).

Matrices are stored as base64 of little-endian float32 bytes: a 768 x 768 error matrix takes
3 MB of JSON, a tiny-cpu one 350 kB.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..utils.atomic import atomic_write_text

__all__ = ["ProbeState", "STATE_VERSION"]

STATE_VERSION = 1


def _encode(t: torch.Tensor) -> dict:
    a = t.detach().to(torch.float32).cpu().contiguous().numpy().astype("<f4", copy=False)
    return {"shape": list(a.shape), "f32": base64.b64encode(a.tobytes()).decode("ascii")}


def _decode(d: dict) -> torch.Tensor:
    a = np.frombuffer(base64.b64decode(d["f32"]), dtype="<f4").reshape(d["shape"])
    return torch.from_numpy(a.astype(np.float32))


@dataclass
class ProbeState:
    """Everything a probe carries over to the next one. ``step`` is the last probe's step."""

    step: int | None = None
    # metric key (e.g. "weights/wq_spectral_norm/L1H7") -> (step, value) of the last probe
    norms: dict[str, tuple[int, float]] = field(default_factory=dict)
    # layer -> running sum / number of probes of numerics/delta_err_mean
    delta_sum: dict[int, float] = field(default_factory=dict)
    delta_count: dict[int, int] = field(default_factory=dict)
    # layer -> previous W_Q gradient-error matrix (C, C) and the sum of all earlier ones
    grad_err_prev: dict[int, torch.Tensor] = field(default_factory=dict)
    grad_err_sum: dict[int, torch.Tensor] = field(default_factory=dict)
    grad_err_count: dict[int, int] = field(default_factory=dict)

    # ---- serialisation ----

    def to_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "norms": {k: [int(s), float(v)] for k, (s, v) in self.norms.items()},
            "delta_sum": {str(k): float(v) for k, v in self.delta_sum.items()},
            "delta_count": {str(k): int(v) for k, v in self.delta_count.items()},
            "grad_err_prev": {str(k): _encode(v) for k, v in self.grad_err_prev.items()},
            "grad_err_sum": {str(k): _encode(v) for k, v in self.grad_err_sum.items()},
            "grad_err_count": {str(k): int(v) for k, v in self.grad_err_count.items()},
        }

    @classmethod
    def from_dict(cls, d: dict) -> "ProbeState":
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"probe state version {d.get('version')!r} is not {STATE_VERSION}")
        return cls(
            step=d.get("step"),
            norms={k: (int(s), float(v)) for k, (s, v) in d.get("norms", {}).items()},
            delta_sum={int(k): float(v) for k, v in d.get("delta_sum", {}).items()},
            delta_count={int(k): int(v) for k, v in d.get("delta_count", {}).items()},
            grad_err_prev={int(k): _decode(v) for k, v in d.get("grad_err_prev", {}).items()},
            grad_err_sum={int(k): _decode(v) for k, v in d.get("grad_err_sum", {}).items()},
            grad_err_count={int(k): int(v) for k, v in d.get("grad_err_count", {}).items()},
        )

    def save(self, path: str | Path) -> Path:
        """Write atomically as JSON."""
        return atomic_write_text(Path(path), json.dumps(self.to_dict()) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "ProbeState":
        return cls.from_dict(json.loads(Path(path).read_text()))

    # ---- snapshots in a run folder ----

    @staticmethod
    def snapshot_dir(run_dir: str | Path) -> Path:
        return Path(run_dir) / "diagnostics"

    @staticmethod
    def snapshots(run_dir: str | Path) -> list[tuple[int, Path]]:
        """(step, path) of the saved snapshots ``diagnostics/state_XXXXXXX.json``, oldest first."""
        d = ProbeState.snapshot_dir(run_dir)
        if not d.is_dir():
            return []
        out = []
        for p in d.glob("state_*.json"):
            tail = p.stem.removeprefix("state_")
            if tail.isdigit():
                out.append((int(tail), p))
        return sorted(out)

    @classmethod
    def load_before(cls, run_dir: str | Path, step: int) -> "ProbeState | None":
        """The state left by the last probe at a step < ``step`` (None if none was kept)."""
        found = [(s, p) for s, p in cls.snapshots(run_dir) if s < step]
        if not found:
            return None
        try:
            return cls.load(found[-1][1])
        except (OSError, ValueError, KeyError):
            return None
