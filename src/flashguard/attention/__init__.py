"""Flash attention with controlled arithmetic, its stabilizers and the one reference attention."""
from .flash import flash_backward, flash_forward
from .function import choose_kernel, flash_attention, override_sdpa, scaled_dot_product_attention
from .options import DEFAULT_BLOCK, KERNELS, FlashOptions, OptionError
from .reference import reference_attention
from .stabilizers import (STABILIZERS, NoStabilizer, PaperStabilizer, SafeStabilizer, Stabilizer,
                          get_stabilizer)
from .triton_flash import triton_available, triton_flash_attention

__all__ = ["flash_attention", "scaled_dot_product_attention", "override_sdpa", "FlashOptions", "OptionError",
           "reference_attention", "flash_forward", "flash_backward", "Stabilizer", "NoStabilizer",
           "PaperStabilizer", "SafeStabilizer", "get_stabilizer", "STABILIZERS", "DEFAULT_BLOCK", "KERNELS",
           "choose_kernel", "triton_available", "triton_flash_attention"]
