"""The one reference attention: plain softmax(Q K^T * scale + mask) V in fp64 (or fp32).

Every test of every other attention in flashguard compares against this function, so it is
kept as short and obviously correct as possible: no tiling, no online softmax, autograd for
the gradients. Conventions follow torch's scaled_dot_product_attention: (B, H, T, D) layout,
a boolean mask is True where a key takes part, a float mask is added to the scores, and
``is_causal`` aligns the mask top-left (query i sees keys j <= i). Rows whose keys are all
masked return 0 (and a log-sum-exp of -inf) instead of NaN.
"""
from __future__ import annotations

import math

import torch

__all__ = ["reference_attention", "causal_mask"]


def causal_mask(t_q: int, t_k: int, device=None) -> torch.Tensor:
    """Boolean (t_q, t_k) mask, True where query i may see key j (j <= i, top-left aligned)."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril()


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dtype: torch.dtype = torch.float64,
    return_lse: bool = False,
    softcap: float | None = None,
    dropout_keep: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    return_scores: bool = False,
):
    """softmax(q k^T * scale + mask) v computed in ``dtype`` (fp64 by default).

    q: (..., T_q, D), k: (..., T_k, D), v: (..., T_k, D_v). Returns (..., T_q, D_v) in ``dtype``
    (and the row log-sum-exp (..., T_q) if ``return_lse``). Differentiable. ``softcap``
    replaces the scores by softcap * tanh(scores / softcap) before masking.
    ``dropout_keep`` (bool, broadcastable to (..., T_q, T_k); True = kept) applies an explicit
    dropout mask after normalisation, O = (softmax * keep / (1 - dropout_p)) v, as SDPA's dropout
    does: the tests pass the mask flashguard's dropout regenerates (attention.dropout).
    ``return_scores`` also returns, last, the scores the softmax read (..., T_q, T_k): after the
    scale, soft-cap and masks, hidden entries -inf, detached (the probes' logit metrics read them).
    """
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale  # (..., T_q, T_k)
    if softcap is not None:  # attention-logit soft-capping (Gemma 2), before the masks
        s = softcap * torch.tanh(s / softcap)
    keep = None
    if is_causal:
        keep = causal_mask(q.shape[-2], k.shape[-2], q.device)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask if keep is None else keep & attn_mask
        else:
            s = s + attn_mask.to(dtype)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m).detach()  # fully masked rows
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    empty = l == 0
    if dropout_keep is not None:  # the row sum l stays the undropped one: dropout follows the softmax
        p = p * (dropout_keep.to(dtype) * (0.0 if dropout_p >= 1 else 1.0 / (1.0 - dropout_p)))
    o = (p @ v) / torch.where(empty, torch.ones_like(l), l)
    o = o.masked_fill(empty, 0.0)
    out = (o,)
    if return_lse:
        out += ((torch.log(l) + m).squeeze(-1),)
    if return_scores:
        out += (s.detach(),)
    return out[0] if len(out) == 1 else out
