"""Attention dropout whose mask is a pure function of (seed, batch, head, row, column).

Flash attention never holds the T_q x T_k probability matrix, so it cannot hold a T_q x T_k
dropout mask either: the backward pass must regenerate exactly the mask the forward pass used,
tile by tile, in whatever tile order it walks. A counter-based generator gives that: the
keep/drop bit of entry (b, h, i, j) is ``hash(seed, b, h, i, j) >= threshold``, computed from
the indices alone, so it does not depend on the tiles, on the order they are visited, or on the
implementation (the PyTorch tiles here and the Triton kernels compute the same bits).

The hash works on 32-bit words held in int64 tensors (torch has no uint32 arithmetic on every
device): every multiplier is below 2^31, so a product of a 32-bit word and a multiplier stays
below 2^63 and the int64 product is exact; ``& 0xFFFFFFFF`` then reduces it mod 2^32, which is
what a uint32 multiply in a GPU kernel does. Right shifts of non-negative values are logical.

    row word   r = mix((b * H + h) * T_q + i  xor  s0)          one per (b, h, i)
    col word   c = mix(j  xor  s1)                              one per j
    entry      u = mix(r  xor  c)                               kept iff u >= round(p * 2^32)

``mix`` is an xor-shift / odd-multiply finaliser (bijective on 32-bit words, so distinct
counters within a row never collide); the constants are odd numbers drawn once for this file.
The seed (s0, s1) is two 32-bit words drawn from torch's default (CPU) generator when the
forward pass runs, so ``torch.manual_seed`` makes dropout reproducible and restoring the
generator's state (resume) restores the masks that follow. Each call draws a fresh seed, so no
separate offset counter is needed.

Kept probabilities are scaled by 1 / (1 - p), as torch's scaled_dot_product_attention does:
O = dropout(softmax(S)) V. The statistics (m, l, lse) are those of the undropped softmax.
"""
from __future__ import annotations

import numbers

import torch

__all__ = ["TileDropout", "draw_seed", "dropout_keep_mask", "check_dropout_p", "mix32", "MASK32"]

MASK32 = 0xFFFFFFFF
_C1 = 0x6E237517   # odd multipliers < 2^31 (see the module docstring)
_C2 = 0x61A6A55B
_C3 = 0x590BBF03


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective mix of 32-bit words held in an int64 tensor (values in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = (x * _C1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _C2) & MASK32
    x = x ^ (x >> 13)
    x = (x * _C3) & MASK32
    return x ^ (x >> 16)


def check_dropout_p(dropout_p) -> float:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1], got {dropout_p!r}")
    return float(dropout_p)


def draw_seed() -> torch.Tensor:
    """Two 32-bit seed words (an int64 CPU tensor of shape (2,)) from torch's default generator.

    A tensor rather than Python ints so that ``torch.compile`` keeps the draw in the graph
    (compiled code draws it with the compiler's own generator, seeded from torch's default
    one: reproducible from ``torch.manual_seed`` too, but not the same bits as eager)."""
    return torch.randint(0, 1 << 32, (2,), dtype=torch.int64)


def threshold(dropout_p: float) -> int:
    """The 32-bit words below this are dropped: P(drop) = threshold / 2^32 = p to within 2^-33."""
    return min(1 << 32, max(0, round(dropout_p * (1 << 32))))


def keep_scale(dropout_p: float) -> float:
    """1 / (1 - p), applied to the kept probabilities; 0 at p = 1 (everything dropped)."""
    return 0.0 if dropout_p >= 1.0 else 1.0 / (1.0 - dropout_p)


class TileDropout:
    """The keep mask of one attention call, handed out tile by tile.

    ``seed``: the two words (ints, or the (2,) tensor of ``draw_seed``); ``batch``, ``heads``,
    ``t_q``: the call's shape (the row counter runs over (b, h, i)); ``p``: the drop rate."""

    def __init__(self, seed, p: float, batch: int, heads: int, t_q: int, device=None):
        s0, s1 = (int(s) & MASK32 for s in (seed.tolist() if isinstance(seed, torch.Tensor) else seed))
        self.seed = (s0, s1)
        self.p = float(p)
        self.scale = keep_scale(self.p)
        self.threshold = threshold(self.p)
        self.shape = (batch, heads, t_q)
        self.device = device
        bh = torch.arange(batch * heads, dtype=torch.int64, device=device).view(batch, heads, 1, 1)
        self._row_base = bh * t_q  # (B, H, 1, 1): the first row counter of each (b, h)

    def keep(self, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
        """(B, H, q1 - q0, k1 - k0) bool, True where the probability is kept."""
        s0, s1 = self.seed
        rows = torch.arange(q0, q1, dtype=torch.int64, device=self.device).view(-1, 1)
        cols = torch.arange(k0, k1, dtype=torch.int64, device=self.device).view(1, -1)
        r = mix32(((self._row_base + rows) & MASK32) ^ s0)          # (B, H, n, 1)
        c = mix32(cols ^ s1)                                         # (1, bk)
        return mix32(r ^ c) >= self.threshold


def dropout_keep_mask(seed, p: float, batch: int, heads: int, t_q: int, t_k: int, device=None) -> torch.Tensor:
    """The whole (B, H, T_q, T_k) keep mask of a call with this seed: what the tiles compute,
    for tests and for the fp64 reference (``reference_attention(..., dropout_keep=, dropout_p=)``)."""
    return TileDropout(seed, p, batch, heads, t_q, device).keep(0, t_q, 0, t_k)
