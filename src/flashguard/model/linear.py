"""The model's linear layer: nn.Linear, whose bf16 autocast products on CPUs where torch's own
are ATen's scalar gemm (AVX2) run through numerics.bf16_gemm instead - the same bits, a tiny-cpu
training step 5-7x faster there (benchmarks/results/README.md; tests/train/test_loss_hash.py pins
the training bits on each platform)."""
from __future__ import annotations

import torch
from torch import nn

from ..numerics import bf16_gemm


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bf16_gemm.autocast_linear_applies(x, self.weight, self.bias):
            return bf16_gemm.autocast_linear(x, self.weight)
        return super().forward(x)
