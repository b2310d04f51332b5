"""The cost of each fix: forward + backward time against the kernel that ran, same inputs.

One captured problem (a layer's q, k, v, dO, its mask, causality and scale): each candidate and
the kernel run forward and backward (``o.backward(dO)``) in turn, ``repeats`` rounds, one
warm-up round first; the rounds interleave the candidates, so that a machine busy with other
work slows them alike. The cost is the median time of the fix over the median of the kernel.
"""
from __future__ import annotations

import statistics
import time

import torch

__all__ = ["time_ratios"]


def _once(fn, q, k, v, do) -> float:
    q, k, v = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    t0 = time.perf_counter()
    o = fn(q, k, v)                        # (B, H, T_q, D_v)
    o.backward(do.to(o.dtype))
    if o.device.type == "cuda":
        torch.cuda.synchronize(o.device)
    return time.perf_counter() - t0


def time_ratios(runners: dict, problem, *, repeats: int = 3) -> dict:
    """{name: {"seconds": median, "ratio": median / kernel's median}} for ``runners`` (name ->
    ``fn(q, k, v) -> o``), whose first entry is the kernel."""
    q, k, v, do = problem.inputs()
    times: dict = {name: [] for name in runners}
    for r in range(repeats + 1):
        for name, fn in runners.items():
            t = _once(fn, q, k, v, do)
            if r:                          # round 0 warms caches and allocators up
                times[name].append(t)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    base = med[next(iter(runners))]
    return {name: {"seconds": s, "ratio": s / base if base > 0 else float("nan")} for name, s in med.items()}
