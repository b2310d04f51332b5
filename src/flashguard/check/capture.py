"""The check's capture: every SDPA call of the model's forwards, with the kernel torch picked.

The one SDPA capture (``flashguard.diagnostics.sdpa_capture.SdpaCapture``) keeps q, k, v and
dO; this subclass adds two things: each call's backend as torch's own selection decides it
(``dispatch.torch_choice``, asked with the call's arguments just before the call runs), and a
label ``(step, call)`` where ``call`` counts the SDPA calls of one forward of the model from 0
(for a decoder stack: the block index, as ``flashguard.watch`` numbers layers). Calls outside
the model's forward (a recomputation under gradient checkpointing in the backward) are not kept.

``layer_problems`` turns the kept calls into one lab ``CapturedProblem`` per layer, the steps'
batch entries concatenated, so that a layer is measured once on all the sequences it saw.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..diagnostics.sdpa_capture import SdpaCapture
from ..experiments.lab.captured import CapturedProblem
from .dispatch import torch_choice

__all__ = ["CheckCapture", "Layer", "layer_problems"]


class CheckCapture(SdpaCapture):
    """``SdpaCapture`` of every call inside ``model``'s forward, labelled (step, call), with
    ``backends[label]`` (torch's dispatch) and ``kernel_fn`` (the SDPA function the model called)."""

    def __init__(self, model: torch.nn.Module, *, sequences: int | None = None):
        super().__init__(select=self._label, sequences=sequences)
        self.model = model
        self.step = 0
        self.backends: dict = {}
        self.dtypes: dict = {}        # label -> the dtype the kernel received
        self.kernel_fn = None
        self.other_calls = 0          # 4-d calls made outside the model's forward (not kept)
        self._depth = 0               # > 0 while inside model.forward
        self._calls_in_forward = 0
        self._choice = "error"
        self._dtype = None
        self._hooks: list = []

    def install(self) -> "CheckCapture":
        if not self.installed:
            super().install()
            self.kernel_fn = self._original
            self._hooks = [self.model.register_forward_pre_hook(self._enter),
                           self.model.register_forward_hook(self._exit, always_call=True)]
        return self

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        super().remove()

    def _enter(self, module, args):
        if self._depth == 0:
            self._calls_in_forward = 0
        self._depth += 1

    def _exit(self, module, args, output):
        self._depth -= 1

    def _wrap(self, original):
        # torch's choice is asked before the call, with its arguments as the kernel receives them
        # (autocast casts them first) and under the caller's sdpa_kernel flags; then the call runs
        # unchanged (SdpaCapture's wrapper records it)
        def dispatching(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                        enable_gqa=False, **kw):
            q, k, v, m = _as_received(query, key, value, attn_mask)
            self._choice = torch_choice(q, k, v, m, dropout_p, is_causal, scale, enable_gqa)
            self._dtype = q.dtype
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa, **kw)
        return super()._wrap(dispatching)

    def _label(self):
        if self._depth == 0:
            self.other_calls += 1
            return None
        label = (self.step, self._calls_in_forward)
        self._calls_in_forward += 1
        self.backends[label] = self._choice
        self.dtypes[label] = self._dtype
        return label


def _as_received(*tensors):
    """The SDPA arguments as the kernel receives them: under autocast (CPU and CUDA list SDPA among
    their lower-precision ops) every floating one is cast to the autocast dtype first. A Llama's
    RoPE, for one, hands SDPA fp32 q and k next to a bf16 v."""
    dev = tensors[0].device.type
    if not torch.is_autocast_enabled(dev):
        return tensors
    low = torch.get_autocast_dtype(dev)
    return tuple(t.to(low) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


@dataclass
class Layer:
    """One layer's calls, merged: the problem to measure and what ran."""

    index: int                       # the call's position in a forward (L<index>)
    problem: CapturedProblem | None  # None when no gradient reached the call's output
    backends: list = field(default_factory=list)   # torch's dispatch per step (usually one name)
    steps: int = 0                   # steps whose call was merged
    dropped: int = 0                 # steps whose call had another shape (not merged)
    dropout_p: float = 0.0

    @property
    def backend(self) -> str:
        return "/".join(dict.fromkeys(self.backends)) or "none"


def _mask_for(rec: dict, batch: int):
    m = rec["attn_mask"]
    if m is None or m.dim() < 4:
        return m
    return m.expand(batch, *m.shape[1:])     # (B, H or 1, T_q, T_k): one per sequence, to concatenate


def _merge(recs: list[dict]) -> tuple[list[dict], int]:
    """The calls with the first one's shapes, mask rank and causal flag; and how many differ."""
    first = recs[0]

    def key(r):
        m = r["attn_mask"]
        return (r["q"].shape[1:], r["k"].shape[1:], r["v"].shape[1:], r["causal"], r["scale"],
                None if m is None else (m.dim(), tuple(m.shape[-2:])))
    same = [r for r in recs if key(r) == key(first)]
    if first["attn_mask"] is not None and first["attn_mask"].dim() < 4:
        # a mask without a batch dim is shared by the call's sequences: kept only if every step had it
        same = [r for r in same if torch.equal(r["attn_mask"], first["attn_mask"])]
    return same, len(recs) - len(same)


def layer_problems(cap: CheckCapture, prefix: str = "L") -> list[Layer]:
    """One Layer per call index, its steps' sequences concatenated (B, H, T, D) into one problem."""
    by_index: dict[int, list[dict]] = {}
    for rec in cap.calls:
        by_index.setdefault(rec["label"][1], []).append(rec)
    out = []
    for i in sorted(by_index):
        recs, dropped = _merge(by_index[i])
        layer = Layer(index=i, problem=None, backends=[cap.backends[r["label"]] for r in recs], steps=len(recs),
                      dropped=dropped, dropout_p=max(float(r["dropout_p"]) for r in recs))
        if all(r["do"] is not None for r in recs):
            # the inputs as the kernel received them (autocast's casts), batch entries of every step
            dt = cap.dtypes[recs[0]["label"]]
            q, k, v = (torch.cat([r[n].to(dt) for r in recs]) for n in ("q", "k", "v"))   # (B, H, T, D)
            do = torch.cat([r["do"] for r in recs])                                        # (B, H, T, D_v)
            masks = [_mask_for(r, r["q"].shape[0]) for r in recs]
            masks = [m.to(dt) if m is not None and m.is_floating_point() else m for m in masks]
            mask = None if masks[0] is None else (masks[0] if masks[0].dim() < 4 else torch.cat(masks))
            layer.problem = CapturedProblem(f"{prefix}{i}", q, k, v, do, causal=recs[0]["causal"],
                                            scale=recs[0]["scale"], attn_mask=mask)
        out.append(layer)
    return out
