"""PyTorch's fused CPU flash attention (bf16) leans: a standalone reproduction (torch only).

The kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) computes P = exp(S - max) with
the fast exponential fexp_u20 on each row's vectorised columns, sums the unrounded values into
the row sum l, and rounds P to bf16 for P @ V. fexp_u20(0) = 0.99994659, not 1: the row's
maximum enters l as 0.99994659 but P @ V as bf16(0.99994659) = 1. Every row's output is then
divided by an l that is 5.3e-5 too small, so O = (P @ V) / l is inflated by a relative 5.3e-5,
towards the sign of V. Rows are independent here, so the mean error over rows is a bias.

    python torch_cpu_lean_repro.py
"""
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

torch.manual_seed(0)
torch.set_num_threads(1)
n, T, D = 256, 512, 64                      # 256 independent instances of one query row

# 1. the exponential at 0, read through the kernel's logsumexp: 16 keys (one SIMD vector)
#    that all score 0 give l = 16 * fexp_u20(0), exact in fp32
q = torch.zeros(1, 1, 1, D)
k = torch.zeros(1, 1, 16, D)
_, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q.bfloat16(), k.bfloat16(), k.bfloat16())
print(f"exp(0) inside the kernel: {math.exp(lse.item()) / 16:.8f}  (exact: 1)")

# 2. the lean: independent rows whose maximum dominates (as under attention sinks or ties), V
#    mostly negative. Each path's O error against an fp64 softmax on the same bf16 inputs, one
#    value per row (the mean over its features); the bf16 rounding of O leans on its own, so the
#    kernel is judged against the fp32 path rounded to bf16 once (the noise floor), paired by row.
n = 4096
q = (8 * torch.randn(n, 1, 1, D)).bfloat16()
k = torch.randn(n, 1, T, D).bfloat16()
v = (-0.75 + 0.25 * torch.randn(n, 1, T, D)).bfloat16()
ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) / math.sqrt(D), -1) @ v.double()


def row_errors(backend, dtype):
    with sdpa_kernel(backend):
        o = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype)).bfloat16()
    return (o.double() - ref).mean(-1).flatten()


floor = row_errors(SDPBackend.FLASH_ATTENTION, torch.float32)
for name, backend, dtype in (("flash, bf16 (the kernel)", SDPBackend.FLASH_ATTENTION, torch.bfloat16),
                             ("math,  bf16", SDPBackend.MATH, torch.bfloat16)):
    d = row_errors(backend, dtype) - floor
    z = d.mean() / (d.std() / math.sqrt(n))
    print(f"{name}: mean O error beyond the fp32 floor {d.mean().item() * 1e6:+7.2f}e-6 over {n} rows, z = {z.item():+6.1f}")
