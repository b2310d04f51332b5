"""Which kernel torch dispatches an SDPA call to, decided by torch's own selection function.

``torch.nn.functional.scaled_dot_product_attention`` picks a backend per call from the inputs
(dtype, shapes, mask, dropout, strides) and from the backends enabled (``sdpa_kernel`` / the
``torch.backends.cuda.enable_*_sdp`` flags). torch exposes that decision as
``torch._fused_sdp_choice`` (the function the Python-level SDPA decompositions call), so the
check asks it with the call's own arguments, inside the caller's own enable flags, rather than
restating the rules. On CPU (torch 2.13, ``sdp_utils_cpp``) they are: the fused flash kernel for
float, double, bf16 and half when flash is enabled, no dropout, 4-dimensional dense inputs, one
head dim for q, k and v, a mask of a broadcastable shape and a unit last-dim stride; else math.
On CUDA the order is flash, memory-efficient, cuDNN, math, each with its own constraints.
"""
from __future__ import annotations

import torch

__all__ = ["BACKEND_NAMES", "torch_choice", "is_torch_sdpa", "kernel_label", "backend_enum"]

# torch.nn.attention.SDPBackend values -> the names the report uses
BACKEND_NAMES = {-1: "error", 0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def torch_choice(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False) -> str:
    """The backend torch would run this call on: flash, efficient, cudnn or math (BACKEND_NAMES)."""
    try:
        code = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                       enable_gqa=enable_gqa)
    except (RuntimeError, TypeError):  # a call torch itself would refuse: reported, not raised here
        return "error"
    return BACKEND_NAMES.get(int(code), f"backend {int(code)}")


def is_torch_sdpa(fn) -> bool:
    """``fn`` is torch's own SDPA (not a wrapper someone installed in its place)."""
    return fn is torch._C._nn.scaled_dot_product_attention


def kernel_label(fn, backend: str, device: str) -> str:
    """How the report names the kernel that ran, e.g. ``torch sdpa: flash (cpu)``, or for a
    replaced ``F.scaled_dot_product_attention`` its name with what torch would have picked."""
    if is_torch_sdpa(fn):
        return f"torch sdpa: {backend} ({device})"
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{name} (replaces F.scaled_dot_product_attention; torch would pick {backend} on {device})"


def backend_enum(name: str):
    """The ``SDPBackend`` of a name of BACKEND_NAMES (for ``sdpa_kernel``); None for none."""
    from torch.nn.attention import SDPBackend
    return {"math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}.get(name)
