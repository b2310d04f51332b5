"""A tiny causal LM whose attention calls F.scaled_dot_product_attention (or computes attention
itself, eager), and a planted leaning SDPA kernel, for the check's tests."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, T, D_MODEL, HEADS = 64, 64, 64, 4

_TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


class TinyLM(nn.Module):
    """Embeddings, ``layers`` attention blocks (no MLP), a head: logits (B, T, VOCAB)."""

    def __init__(self, layers: int = 2, eager: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.eager = eager
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(T, D_MODEL)
        self.qkv = nn.ModuleList(nn.Linear(D_MODEL, 3 * D_MODEL) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(D_MODEL, D_MODEL) for _ in range(layers))
        self.head = nn.Linear(D_MODEL, VOCAB)

    def attend(self, q, k, v):                                    # (B, H, T, Dh) each
        if not self.eager:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)   # looked up at call time
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])     # (B, H, T, T)
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
        return s.softmax(-1) @ v

    def forward(self, x):                                         # x: (B, T) token ids
        B, n = x.shape
        h = self.emb(x) + self.pos(torch.arange(n))               # (B, T, C)
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (t.view(B, n, HEADS, -1).transpose(1, 2) for t in qkv(h).split(D_MODEL, dim=2))
            o = self.attend(q, k, v)                              # (B, H, T, Dh)
            h = h + proj(o.transpose(1, 2).reshape(B, n, D_MODEL))
        return self.head(h)


def batches(steps: int = 2, batch: int = 8, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, T), generator=g) for _ in range(steps)]


def planted_lean(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch's SDPA in fp32 with a one-signed error on O: minus 0.1 % of the call's mean |O|
    (a quarter of a bf16 half-ulp: invisible to a max-abs tolerance), rounded to the inputs' dtype."""
    o = _TORCH_SDPA(query.float(), key.float(), value.float(), attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, scale=scale)
    return (o - 1e-3 * o.detach().abs().mean()).to(query.dtype)
