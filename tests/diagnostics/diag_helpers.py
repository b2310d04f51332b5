"""Constructed attention problems with known answers (shared by the diagnostics tests)."""
from __future__ import annotations

import torch


def tied_problem(seed=0, B=2, H=2, T=64, D=64, neg=0.9, top=3.0, dtype=torch.bfloat16, sink=False):
    """Every query row i has its own pair of tied maximal keys; every other key scores 9 to 14
    below them (Pbar = exp(-9..-14): the rest of the row only sets sticky bits of the PV sum).
    With ``sink`` one key of every pair is key 0 (an attention sink: half of every row's mass).

    q_i = 8 e_i and scale = 1/sqrt(64), so S[i, j] = k_j[i] exactly (one non-zero product).
    V is mostly negative (a fraction ``neg`` of entries in (-2, -1], the rest in [1, 2)), and
    dO of row i is the mean V of its two tied keys plus noise: dO correlates positively with V.
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, H, T, D)
    q[..., torch.arange(T), torch.arange(T)] = 8.0
    s = top - 9.0 - 5.0 * torch.rand(B, H, T, T, generator=g)
    pairs = torch.stack([torch.randperm(T, generator=g)[:2] for _ in range(B * H * T)]).view(B, H, T, 2)
    if sink:
        pairs = torch.stack([torch.zeros(B, H, T, dtype=torch.long),
                             torch.randint(1, T, (B, H, T), generator=g)], dim=-1)
    s.scatter_(-1, pairs, top)
    k = torch.zeros(B, H, T, D)
    k[..., :T] = s.transpose(-2, -1)
    v = -(1.0 + torch.rand(B, H, T, D, generator=g))
    v = v * torch.where(torch.rand(B, H, T, D, generator=g) < neg, 1.0, -1.0)
    v_pair = torch.gather(v.unsqueeze(2).expand(B, H, T, T, D), 3,
                          pairs.unsqueeze(-1).expand(B, H, T, 2, D)).mean(3)
    do = v_pair + 0.3 * torch.randn(B, H, T, D, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]


def distinct_problem(B=1, H=2, T=32, D=64, seed=0, dtype=torch.bfloat16):
    """Scores S[i, :] = a permutation of T values 0.4 apart in [-10, 3): no two equal in bf16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.zeros(B, H, T, D)
    q[..., torch.arange(T), torch.arange(T)] = 8.0  # S = k_j[i] with scale 1/sqrt(64)
    levels = 3.0 - 0.40625 * torch.arange(T, dtype=torch.float32)   # multiples of 1/32: exact in bf16
    s = torch.stack([levels[torch.randperm(T, generator=g)] for _ in range(B * H * T)]).view(B, H, T, T)
    k = torch.zeros(B, H, T, D)
    k[..., :T] = s.transpose(-2, -1)
    v = torch.randn(B, H, T, D, generator=g)
    do = torch.randn(B, H, T, D, generator=g)
    return [t.to(dtype) for t in (q, k, v, do)]
