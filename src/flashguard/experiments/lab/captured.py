"""Captured problems: the q, k, v and dO a real model's attention saw, measured like the lab's.

Two sources:

* ``from_run(run_dir)``: a training run's checkpoint and the batches it logged (the last
  ``batches`` of them, the model of the checkpoint), one problem per layer, through the
  diagnostics' capture hooks under the run's autocast;
* ``record_sdpa()``: any model that calls ``torch.nn.functional.scaled_dot_product_attention``
  (Hugging Face models with ``attn_implementation="sdpa"``, nanoGPT, ...): a context manager
  that records the inputs of every call and, after ``backward()``, its output gradient.

The rows of one sequence share its keys and values, so a captured problem's unit is the
sequence (one value per batch entry and head; ``error_stats``). ``run_captured`` measures
each arithmetic on each problem against its paired floor, as the lab does.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...diagnostics.sdpa_capture import SdpaCapture
from .candidates import judge_candidates
from .measure import Bench, Measurement

__all__ = ["CapturedProblem", "from_run", "record_sdpa", "SdpaRecorder", "run_captured"]


@dataclass(eq=False)  # hashed by identity: the Bench caches per problem object
class CapturedProblem:
    name: str
    q: torch.Tensor                 # (B, H, T_q, D) as the attention received them
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor | None
    causal: bool = True
    scale: float | None = None
    softcap: float | None = None
    attn_mask: torch.Tensor | None = None
    unit: str = field(default="sequence")
    seed: int = 0

    def label(self) -> str:
        return self.name

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.q.shape), "causal": self.causal, "unit": self.unit,
                "softcap": self.softcap}

    def inputs(self):
        return self.q, self.k, self.v, self.do

    @property
    def trace_kwargs(self) -> dict:
        return {"causal": self.causal, "scale": self.scale, "softcap": self.softcap, "attn_mask": self.attn_mask}


def from_run(run_dir, *, step: int | None = None, layers=None, batches: int = 1, sequences: int | None = None,
             device: str = "cpu") -> list[CapturedProblem]:
    """One problem per layer from a run's checkpoint and the last ``batches`` logged batches."""
    from ...diagnostics.capture import capture_batch, resolve_layers
    from ...diagnostics.run_state import load_run_state, logged_batches

    run_dir = Path(run_dir)
    rs = load_run_state(run_dir, step, device=device)
    layers = resolve_layers(rs.model.config.n_layer, layers)
    parts: dict[int, list] = {i: [] for i in layers}
    softcap = {}
    for _, indices in logged_batches(run_dir, rs.step, batches):
        if sequences is not None:
            indices = indices[:sequences]
        x, y = rs.data.batch("train", torch.tensor(indices, dtype=torch.long), rs.model.config.block_size)
        caps, _ = capture_batch(rs.model, x, y, layers, autocast=rs.config.train.autocast)
        rs.model.zero_grad(set_to_none=True)
        for i, c in caps.items():
            parts[i].append((c.q, c.k, c.v, c.do))
            softcap[i] = c.softcap
    out = []
    for i in layers:
        q, k, v, do = (torch.cat([p[j] for p in parts[i]]) for j in range(4))
        out.append(CapturedProblem(f"{run_dir.name} step {rs.step} L{i}", q, k, v, do, causal=True,
                                   softcap=softcap[i]))
    return out


class SdpaRecorder(SdpaCapture):
    """Records the inputs of ``F.scaled_dot_product_attention`` calls and their output gradients
    (the one SDPA capture, ``flashguard.diagnostics.sdpa_capture``), as captured problems."""

    def __init__(self, limit: int | None = None):
        super().__init__(limit)

    def problems(self, prefix: str = "sdpa") -> list[CapturedProblem]:
        out = []
        for i, r in enumerate(self.calls):
            if r["dropout_p"]:
                raise ValueError(f"{prefix} call {i} used dropout_p={r['dropout_p']}: its output is not "
                                 "deterministic; record in eval mode")
            out.append(CapturedProblem(f"{prefix} call {i}", r["q"], r["k"], r["v"], r["do"], causal=r["causal"],
                                       scale=r["scale"], attn_mask=r["attn_mask"]))
        return out


@contextlib.contextmanager
def record_sdpa(limit: int | None = None):
    """Record every ``F.scaled_dot_product_attention`` call inside the block (up to ``limit``).

        with record_sdpa() as rec:
            loss = model(x).loss
            loss.backward()
        problems = rec.problems()
    """
    with SdpaRecorder(limit) as rec:
        yield rec


def run_captured(problems: list[CapturedProblem], policies, *, bench: Bench | None = None, progress=None) -> dict:
    """Each policy without a fix and with the lab's candidate fixes on each captured problem."""

    bench = bench or Bench()
    say = progress or (lambda msg: None)
    rows, answers = [], {}

    def measure(p, a) -> Measurement:
        m = bench.measure(p, a)
        rows.append({"experiment": "captured", **m.to_dict()})
        return m

    for pol in policies:
        say(f"  captured: {pol}")
        plain, removed_by, failures = judge_candidates(pol, problems, measure)
        leaning = [p.name for p, m in plain.items() if m.leans]
        answers[pol] = {"leaning": leaning, "removed_by": removed_by, "failures": failures,
                        "line": (f"leans beyond the floor on {len(leaning)} of {len(problems)} captured problems"
                                 + (f"; removed by: {', '.join(removed_by) or 'nothing the lab tried'}" if leaning
                                    else "; harmless candidates: " + (", ".join(removed_by) or "none")))}
    return {"problems": [p.to_dict() for p in problems], "rows": rows, "answers": answers}

