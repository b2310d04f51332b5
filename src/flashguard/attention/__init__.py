"""Flash attention with controlled arithmetic, its stabilizers and the one reference attention."""
from .flash import flash_backward, flash_forward
from .function import (DEFAULT_BLOCK, KERNELS, choose_backend, choose_kernel, flash_attention, override_sdpa,
                       scaled_dot_product_attention)
from .reference import reference_attention
from .stabilizers import (STABILIZERS, NoStabilizer, PaperStabilizer, SafeStabilizer, Stabilizer,
                          get_stabilizer)
from .triton_flash import triton_available, triton_flash_attention

__all__ = ["flash_attention", "scaled_dot_product_attention", "override_sdpa", "reference_attention",
           "flash_forward", "flash_backward", "Stabilizer", "NoStabilizer", "PaperStabilizer",
           "SafeStabilizer", "get_stabilizer", "STABILIZERS", "DEFAULT_BLOCK", "KERNELS",
           "choose_kernel", "triton_available", "triton_flash_attention"]


def __getattr__(name):  # KERNEL_BACKENDS, the old name of KERNELS (choose_backend warns when called)
    if name == "KERNEL_BACKENDS":
        import warnings
        warnings.warn("flashguard.attention.KERNEL_BACKENDS is now called KERNELS", DeprecationWarning, stacklevel=2)
        return KERNELS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
