"""The candidate fixes the check measures, and the line each one is switched on with.

Per dtype of the attention inputs:

* bf16: flashguard's ``flash_attention`` in production arithmetic (``fa2``: fp32 scores,
  statistics and accumulators; no tie bias in the lab or the audit), in the study's reference
  code with its fix (``paper-fp32fwd``), and torch's own SDPA on inputs upcast to fp32 (O
  rounded back to bf16: the noise floor itself, as a kernel);
* fp16: ``fa2-fp16`` and torch's SDPA in fp32;
* fp32: none (there is no lower precision to leave).

A flashguard fix is measured as an ``Arithmetic`` (white box, every rounding known) and
switched on with ``override_sdpa`` (any model calling SDPA) or ``integrations.hf.register``
(transformers' attention registry); torch's fp32 SDPA is a black box and has no flashguard
switch (upcast q, k, v before the call).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.trace import Arithmetic
from ..experiments.lab.measure import BlackBox

__all__ = ["Fix", "fixes_for", "TORCH_FP32"]

TORCH_FP32 = "torch sdpa, fp32 inputs"


@dataclass(frozen=True)
class Fix:
    name: str                # a flashguard precision, or TORCH_FP32
    precision: str | None    # the flashguard precision; None for torch's fp32 SDPA

    @property
    def switch(self) -> dict:
        """The lines to copy: {"plain": ..., "hf": ...} (None where there is none)."""
        if self.precision is None:
            return {"plain": None, "hf": None,
                    "note": "no flashguard switch: cast q, k and v to float32 before calling "
                            "scaled_dot_product_attention and O back to the model's dtype"}
        p = self.precision
        return {"plain": f'with flashguard.override_sdpa(precision="{p}"):  # around the forward and backward',
                "hf": f'model.set_attn_implementation(flashguard.integrations.hf.register(precision="{p}"))',
                "note": None}

    def measured(self, kernel_fn, problem, dtype: torch.dtype):
        """What the lab's Bench measures for this fix on ``problem``: an Arithmetic, or a BlackBox."""
        if self.precision is not None:
            return Arithmetic.of(self.precision)
        floor = {torch.bfloat16: "fa2", torch.float16: "fa2-fp16"}[dtype]
        return BlackBox(TORCH_FP32, self.runner(kernel_fn, problem), dtype=dtype, floor_policy=floor)

    def runner(self, kernel_fn, problem):
        """``fn(q, k, v) -> o`` with autograd, the problem's mask, causality and scale applied."""
        mask, causal, scale = problem.attn_mask, problem.causal, problem.scale
        if self.precision is not None:
            from ..attention.function import flash_attention
            return lambda q, k, v: flash_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                   precision=self.precision)

        def upcast(q, k, v):
            m = mask if mask is None or mask.dtype == torch.bool else mask.float()
            return kernel_fn(q.float(), k.float(), v.float(), attn_mask=m, is_causal=causal,
                             scale=scale).to(q.dtype)
        return upcast


_BY_DTYPE = {torch.bfloat16: ("fa2", "paper-fp32fwd", None), torch.float16: ("fa2-fp16", None),
             torch.float32: ()}


def fixes_for(dtype: torch.dtype) -> list[Fix]:
    """The candidates of the attention inputs' dtype (module docstring)."""
    return [Fix(p or TORCH_FP32, p) for p in _BY_DTYPE.get(dtype, ())]
