"""The one capture of ``torch.nn.functional.scaled_dot_product_attention`` calls: q, k, v and dO.

Any model that calls ``F.scaled_dot_product_attention`` at run time (Hugging Face models
with ``attn_implementation="sdpa"``, nanoGPT, flashguard's GPT with the ``sdpa`` backend)
can be read this way, without knowing its classes: ``SdpaCapture.install()`` replaces the
function in ``torch.nn.functional`` by a wrapper that calls the original unchanged, keeps
the (detached) inputs of the calls it is asked to keep and hooks each kept call's output for
its gradient dO; ``remove()`` puts the original back.

Two users, one mechanism: the lab's ``record_sdpa()`` (``flashguard.experiments.lab.captured``,
every call of a block) and ``flashguard.watch`` (``flashguard.diagnostics.watch``: on probe steps
only, the calls of chosen layers, selected by ``select``).

What is not seen: a model that bound the function before installation
(``from torch.nn.functional import scaled_dot_product_attention`` at import time) or that was
compiled with ``torch.compile`` before it (the compiled graph calls the kernel directly).
"""
from __future__ import annotations

import warnings

import torch.nn.functional as F

__all__ = ["SdpaCapture"]


class SdpaCapture:
    """Keep the inputs of ``F.scaled_dot_product_attention`` calls and their output gradients.

    ``calls``: one dict per kept call, in call order: ``q``, ``k``, ``v`` ((B, H, T, D), detached;
    grouped-query k and v repeated to the query heads), ``do`` (None until the backward reaches
    the call's output, and for an output that needs no gradient), ``causal``, ``scale``,
    ``attn_mask``, ``dropout_p`` and ``label``.

    ``limit``: keep at most this many calls. ``select``: called once per 4-dimensional call, in
    call order, with no argument; it returns the call's label (kept) or None (not kept); without
    it every call is kept, labelled by its number. ``sequences``: keep only the first this many
    batch entries of each kept call (less memory; the rows of a sequence stay together).
    """

    def __init__(self, limit: int | None = None, *, select=None, sequences: int | None = None):
        self.calls: list[dict] = []
        self.limit = limit
        self.select = select
        self.sequences = sequences
        self._original = None
        self._wrapper = None

    # ---- installation ---------------------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._wrapper is not None

    def install(self) -> "SdpaCapture":
        if self._wrapper is None:
            self._original = F.scaled_dot_product_attention
            self._wrapper = self._wrap(self._original)
            F.scaled_dot_product_attention = self._wrapper
        return self

    def remove(self) -> None:
        if self._wrapper is None:
            return
        if F.scaled_dot_product_attention is self._wrapper:
            F.scaled_dot_product_attention = self._original
        else:
            # someone replaced the function after us (another capture, override_sdpa) and has not
            # restored it yet: putting ours back would undo theirs, so leave it; our wrapper stays in
            # their chain but keeps nothing once removed
            warnings.warn("SdpaCapture.remove(): F.scaled_dot_product_attention was replaced after this capture "
                          "was installed; it is left as it is", RuntimeWarning, stacklevel=2)
        self._wrapper = None

    def __enter__(self) -> "SdpaCapture":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()

    # ---- the wrapper ----------------------------------------------------------------------
    def _wrap(self, original):
        def recording(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False, **kw):
            out = original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa, **kw)
            # a wrapper still in someone else's chain after remove() keeps nothing
            if recording is not self._wrapper or query.dim() != 4:
                return out
            if self.limit is not None and len(self.calls) >= self.limit:
                return out
            label = len(self.calls) if self.select is None else self.select()
            if label is None:
                return out
            n = self.sequences
            cut = (lambda t: t) if n is None else (lambda t: t[:n] if t is not None and t.dim() == 4 and
                                                   t.shape[0] > 1 else t)
            q, k, v = cut(query), cut(key), cut(value)
            if enable_gqa and k.shape[1] != q.shape[1]:
                rep = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            mask = None if attn_mask is None else cut(attn_mask).detach()
            rec = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "do": None, "causal": bool(is_causal),
                   "scale": scale, "attn_mask": mask, "dropout_p": dropout_p, "label": label}
            self.calls.append(rec)
            if out.requires_grad:
                out.register_hook(lambda g, rec=rec: rec.__setitem__("do", cut(g).detach()))
            return out
        recording.__wrapped__ = original
        return recording
