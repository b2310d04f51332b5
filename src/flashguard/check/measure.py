"""Per layer: the lean of the kernel that ran and of each candidate fix, and the census.

Nothing here is a new measurement: the lab's ``Bench`` measures each (problem, arithmetic) cell
(``attention.trace`` against the fp64 reference ``attention.reference.reference_attention``,
``attention.error_stats`` statistics, paired against the noise floor ``floor_arithmetic`` of the
dtype: fp32 arithmetic with the kernel's input and output formats, on the same inputs), and
``Measurement.o_leans`` / ``delta_leans`` apply the one rule, ``leans_beyond_floor``.

The kernel that ran is a black box: the SDPA function the model called (``CheckCapture.kernel_fn``),
called again on the captured q, k, v with the call's mask, causality and scale, under
``sdpa_kernel`` of the backend torch dispatched the call to.

Unit of independence: one (sequence, head) pair, ``CapturedProblem``'s default: the error of O
(delta) is averaged over the pair's rows and features (rows) before the test across pairs,
because the rows of one sequence share its keys and values and are not independent.

The census (``diagnostics.census.tied_keys``): of the (row, key tile) pairs, the share whose
maximum score is tied bit for bit in the production arithmetic of the dtype (``watch``'s
``default_precision``: ``fa2`` for bf16), of those the share tied at key 0 (the sink) and the
share of V features of one sign at the tied keys.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from ..attention.trace import Arithmetic
from ..diagnostics.census import tied_keys
from ..diagnostics.watch import _mask_as_causal, default_precision
from ..experiments.lab.measure import Bench, BlackBox, Measurement
from .dispatch import backend_enum
from .fixes import Fix
from .verdict import layer_verdict

__all__ = ["LayerResult", "kernel_runner", "measure_layer", "census"]


@dataclass
class LayerResult:
    index: int
    backend: str
    shape: list | None                       # q's (B, H, T_q, D) as measured
    kernel: Measurement | None
    fixes: dict = field(default_factory=dict)   # fix name -> Measurement (or an error string)
    census: dict | None = None
    risk: str = "unmeasured"
    reason: str = ""
    note: str = ""


def kernel_runner(kernel_fn, backend: str, problem):
    """``fn(q, k, v) -> o``: the SDPA function the model called, on the backend torch picked."""
    enum = backend_enum(backend)
    mask, causal, scale = problem.attn_mask, problem.causal, problem.scale

    def run(q, k, v):
        ctx = contextlib.nullcontext() if enum is None else _sdpa_kernel(enum)
        with ctx:
            return kernel_fn(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return run


def _sdpa_kernel(enum):
    from torch.nn.attention import sdpa_kernel
    return sdpa_kernel(enum)


def census(problem, dtype: torch.dtype) -> dict | None:
    """The preconditions of the mechanism on the layer's inputs (module docstring); None for a
    mask other than the causal pattern (the census models none other)."""
    q, k, v = problem.q, problem.k, problem.v
    causal = _mask_as_causal(problem.attn_mask, problem.causal, q.shape[-2], k.shape[-2])
    if causal is None:
        return None
    scale = problem.scale if problem.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    c = tied_keys(q, k, v, Arithmetic.of(default_precision(dtype)), causal=causal, scale=scale)

    def share(num, den):
        return float(num / den) if float(den) > 0 else 0.0
    tied = c.tied.sum()
    return {"arithmetic": default_precision(dtype), "exact_tie_rate": share(tied, c.pairs.sum()),
            "tie_at_sink": share(c.at_sink.sum(), tied), "tie_at_sink_chance": share(c.at_sink_chance.sum(), tied),
            "v_sign_agree": share(c.agree.sum(), tied)}


def measure_layer(bench: Bench, layer, kernel_fn, fixes: list[Fix]) -> LayerResult:
    """The kernel's measurement, each fix's and the census on one layer, and its verdict, in the
    dtype the kernel received (``fixes``: the candidates of that dtype, ``fixes.fixes_for``)."""
    p = layer.problem
    res = LayerResult(index=layer.index, backend=layer.backend, shape=None if p is None else list(p.q.shape),
                      kernel=None)
    if layer.dropped:
        res.note = f"{layer.dropped} step(s) with another shape not measured"
    if p is None:
        res.risk, res.reason = layer_verdict(None, None)
        return res
    dtype = p.q.dtype           # the dtype the kernel received (autocast's), which the floor and fixes take
    floor = default_precision(dtype)
    box = BlackBox("kernel", kernel_runner(kernel_fn, layer.backends[0], p), dtype=dtype, floor_policy=floor)
    res.kernel = bench.measure(p, box)
    for fix in fixes:
        try:
            res.fixes[fix.name] = bench.measure(p, fix.measured(kernel_fn, p, dtype))
        except (RuntimeError, ValueError, NotImplementedError) as e:   # a fix that refuses this call
            res.fixes[fix.name] = f"{type(e).__name__}: {e}"
    res.census = census(p, dtype)
    res.risk, res.reason = layer_verdict(res.kernel, None if res.census is None else res.census["exact_tie_rate"])
    return res
