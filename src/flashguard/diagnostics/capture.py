"""What a probe reads: one layer's attention inputs, its output gradient and its weights.

``LayerCapture`` holds, for one attention layer and one batch, the tensors the layer's
attention received (q, k, v as (B, H, T, D)), the gradient of the loss with respect to the
attention output (dO), the input of the fused qkv projection (x, needed to map a dQ error
onto W_Q), the per-head query weights and how the layer computes attention (its
AttentionSpec, scale, soft-cap, causal mask, optional query LayerNorm).

``CaptureHooks`` records these during a forward/backward that runs anyway (the trainer's own
training step): it wraps ``attn.attend`` of the chosen layers to keep (detached) q, k, v and
hooks the attention output for dO, and a forward pre-hook on ``attn.c_attn`` keeps x. Only
the first forward after installation is recorded (with gradient accumulation: the first
micro-batch). Nothing is changed: hooks return nothing and the wrapped call is the original.

``capture_batch`` runs a forward and backward of its own (``flashguard diagnose``).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["LayerCapture", "CaptureHooks", "capture_batch", "resolve_layers"]


@dataclass
class LayerCapture:
    """One layer's attention on one batch. ``do`` and ``x`` may be None (forward-only probes)."""

    layer: int
    q: torch.Tensor                    # (B, H, T, D) as the attention received it
    k: torch.Tensor                    # (B, H, T, D)
    v: torch.Tensor                    # (B, H, T, D)
    do: torch.Tensor | None = None     # (B, H, T, D) dLoss / dO
    x: torch.Tensor | None = None      # (B, T, C) input of the fused qkv projection
    w_q: torch.Tensor | None = None    # (H, D, C) query weights per head (q_h = x @ w_q[h].T)
    spec: object | None = None         # flashguard.model.AttentionSpec (None: unknown; the numerics
                                       # probes then need an explicit precision, as for a non-flash layer)
    backend: str = "flash"             # the backend that actually ran (effective_backend)
    causal: bool = True
    scale: float | None = None         # None: 1 / sqrt(D)
    softcap: float | None = None
    q_ln: tuple | None = None          # (weight, bias, eps) of a query LayerNorm, or None

    @property
    def n_head(self) -> int:
        return self.q.shape[1]

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.q.shape[-1]) if self.scale is None else float(self.scale)


def resolve_layers(n_layer: int, layers) -> list[int]:
    """``layers`` (None / empty = all, or indices) checked against the model's depth."""
    if not layers:
        return list(range(n_layer))
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layer:
            raise ValueError(f"diagnostics layer {i!r} is not in 0..{n_layer - 1}")
        if i not in out:
            out.append(i)
    return sorted(out)


def _raw(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and hasattr(model.module, "transformer") else model


class CaptureHooks:
    """Record LayerCaptures of ``layers`` during the next forward (and backward) of ``model``.

        hooks = CaptureHooks(model, [0, 1]).install()
        loss = model(x, y)[1]; loss.backward()
        hooks.remove()
        caps = hooks.captures(grad_scale=1.0)

    ``grad_scale`` multiplies the recorded dO (the trainer divides the loss by the number of
    gradient-accumulation micro-batches; passing that number back gives dO of the mean loss).
    """

    def __init__(self, model: nn.Module, layers):
        self.model = _raw(model)
        self.layers = resolve_layers(self.model.config.n_layer, layers)
        self._handles = []
        self._wrapped = []
        self._data: dict[int, dict] = {}

    def install(self) -> "CaptureHooks":
        for i in self.layers:
            attn = self.model.transformer.h[i].attn
            self._data[i] = {}
            self._handles.append(attn.c_attn.register_forward_pre_hook(self._x_hook(i)))
            original = attn.attend  # the bound method
            attn.attend = self._attend_wrapper(i, original)
            self._wrapped.append(attn)
        return self

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for attn in self._wrapped:
            if "attend" in attn.__dict__:
                del attn.__dict__["attend"]
        self._wrapped.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.remove()

    def _x_hook(self, i):
        def hook(module, args):
            d = self._data[i]
            if "x" not in d:
                d["x"] = args[0].detach()
        return hook

    def _attend_wrapper(self, i, original):
        def attend(q, k, v):
            y = original(q, k, v)
            d = self._data[i]
            if "q" not in d:
                d.update(q=q.detach(), k=k.detach(), v=v.detach())
                if y.requires_grad:
                    def grad_hook(g, d=d):
                        if "do" not in d:
                            d["do"] = g.detach()
                    y.register_hook(grad_hook)
            return y
        return attend

    @property
    def captured(self) -> bool:
        return any("q" in d for d in self._data.values())

    def captures(self, grad_scale: float = 1.0) -> dict[int, LayerCapture]:
        out = {}
        for i, d in self._data.items():
            if "q" not in d:
                continue
            attn = self.model.transformer.h[i].attn
            do = d.get("do")
            if do is not None and grad_scale != 1.0:
                do = do * grad_scale
            q_ln = None
            if attn.q_ln is not None:
                w = attn.q_ln.weight.detach().clone() if attn.q_ln.weight is not None else None
                b = attn.q_ln.bias.detach().clone() if attn.q_ln.bias is not None else None
                q_ln = (w, b, attn.q_ln.eps)
            out[i] = LayerCapture(
                layer=i, q=d["q"], k=d["k"], v=d["v"], do=do, x=d.get("x"),
                w_q=self.model.wq_heads(i).clone(), spec=attn.spec, backend=attn.effective_backend,
                causal=True, scale=None, softcap=attn.softcap, q_ln=q_ln)
        return out


def capture_batch(model: nn.Module, x: torch.Tensor, y: torch.Tensor, layers=None, *,
                  autocast: str = "bf16") -> tuple[dict[int, LayerCapture], float]:
    """Forward and backward of ``model`` on (x, y) recording ``layers``; returns (captures, loss).

    Runs under bf16 autocast when ``autocast == "bf16"`` (as the trainer does). Parameter
    gradients are accumulated into ``.grad`` (and left there: the caller owns the model).
    """
    model = _raw(model)
    dev = next(model.parameters()).device
    ctx = (torch.autocast(dev.type, dtype=torch.bfloat16) if autocast == "bf16"
           else contextlib.nullcontext())
    with CaptureHooks(model, layers) as hooks:
        with ctx:
            _, loss = model(x.to(dev), y.to(dev))
        loss.backward()
    return hooks.captures(), float(loss.detach())
