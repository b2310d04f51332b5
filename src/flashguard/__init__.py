"""flashguard: find, explain and fix the loss explosions of low-precision flash attention.

    import flashguard
    o = flashguard.flash_attention(q, k, v, is_causal=True, precision="fa2", stabilizer="none")
    opts = flashguard.FlashOptions(precision="paper", stabilizer="safe")   # or the options, made once
    o = flashguard.flash_attention(q, k, v, is_causal=True, options=opts)
    with flashguard.override_sdpa(precision="paper-fp32fwd"):
        loss = model(x).loss                       # any model calling F.scaled_dot_product_attention
    t = flashguard.trace(q, k, v, do, flashguard.Arithmetic.of("paper", "safe"))   # errors against fp64
    with flashguard.watch(model, every=50, log_dir="runs/x") as w:   # the probes on any SDPA model
        ...; w.step()                              # once per optimizer step
    result = flashguard.check(model, batches, out="check")   # at risk? what to switch on (check.md)

The names below are loaded on first use, so ``import flashguard`` does not import torch
(and never matplotlib or triton); the subpackages (flashguard.attention, .numerics, .train,
...) hold the rest.
"""
import importlib as _importlib
from typing import TYPE_CHECKING

__version__ = "0.2.0"

# public name -> the module that defines it
_EXPORTS = {
    "flash_attention": "flashguard.attention.function",
    "scaled_dot_product_attention": "flashguard.attention.function",
    "override_sdpa": "flashguard.attention.function",
    "FlashOptions": "flashguard.attention.options",
    "get_policy": "flashguard.numerics.policy",
    "POLICIES": "flashguard.numerics.policy",
    "get_stabilizer": "flashguard.attention.stabilizers",
    "STABILIZERS": "flashguard.attention.stabilizers",
    "trace": "flashguard.attention.trace",
    "Arithmetic": "flashguard.attention.trace",
    "watch": "flashguard.diagnostics.watch",
    "check": "flashguard.check.api",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names are loaded by __getattr__
    from .attention.function import flash_attention, override_sdpa, scaled_dot_product_attention
    from .attention.options import FlashOptions
    from .attention.stabilizers import STABILIZERS, get_stabilizer
    from .attention.trace import Arithmetic, trace
    from .check.api import check
    from .diagnostics.watch import watch
    from .numerics.policy import POLICIES, get_policy
del TYPE_CHECKING


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(_importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value   # later lookups skip this function
        return value
    raise AttributeError(f"module 'flashguard' has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | {k for k in globals() if k.startswith("__")})
