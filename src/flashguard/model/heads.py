"""Per-head views of the attention weights, for the diagnostics probes.

The fused projection ``attn.c_attn.weight`` is (3C, C), rows q | k | v; head h of each part owns
rows [h*D, (h+1)*D) of it. The probes read W_Q and W_K per head (spectral norms, the W_Q
gradient error), so the model hands out those slices as views that follow training.

The other things the probes read are the attention modules' own: ``attn.spec``,
``attn.effective_backend``, ``attn.softcap``, ``attn.q_ln``, and ``attn.attend``, the method
flashguard.diagnostics.capture wraps to record q, k, v (B, H, T, D) and dO.
"""
from __future__ import annotations

import torch

from .checks import is_int

__all__ = ["HeadWeights"]


class HeadWeights:
    """The accessors GPT mixes in; they read ``self.config`` and ``self.transformer.h``."""

    def _check_layer(self, layer: int) -> None:
        if not is_int(layer) or not 0 <= layer < self.config.n_layer:
            raise ValueError(f"layer must be in 0..{self.config.n_layer - 1}, got {layer!r}")

    def _qkv_heads(self, layer: int, part: int, grad: bool) -> torch.Tensor | None:
        self._check_layer(layer)
        w = self.transformer.h[layer].attn.c_attn.weight                     # (3C, C)
        if grad:
            w = w.grad
            if w is None:
                return None
        C, H = self.config.n_embd, self.config.n_head
        return w.detach()[part * C:(part + 1) * C].view(H, C // H, C)        # (H, D, C)

    def wq_heads(self, layer: int, grad: bool = False) -> torch.Tensor | None:
        """Per-head slices of layer ``layer``'s query projection, (n_head, head_dim, n_embd).

        Head h computes q_h = x @ wq_heads(layer)[h].T. A detached view of the weight (no copy:
        it follows training); ``grad=True`` gives the same slices of ``.grad`` (None if unset).
        """
        return self._qkv_heads(layer, 0, grad)

    def wk_heads(self, layer: int, grad: bool = False) -> torch.Tensor | None:
        """As wq_heads, for the key projection."""
        return self._qkv_heads(layer, 1, grad)

    def wv_heads(self, layer: int, grad: bool = False) -> torch.Tensor | None:
        """As wq_heads, for the value projection."""
        return self._qkv_heads(layer, 2, grad)
