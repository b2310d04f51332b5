"""Where a model keeps its query and key projections: W_Q / W_K per head for the weight probes of any model.

The weight probes (``probes.weight_probe``: per-head spectral norms of W_Q and W_K and their
growth, which the early-warning monitor's growth signals read) need, per layer, the
(n_head, head_dim, n_embd) slices of the query and key projections. flashguard's own GPT has
them (``wq_heads`` / ``wk_heads``); for another model ``find_projections`` looks for them:

* automatically, the attention modules of Hugging Face architectures, in module order (the
  order of their SDPA calls in a forward, so the i-th found is the watch's L<i>):
  ``q_proj`` / ``k_proj`` children (Llama, Mistral, Qwen, Gemma, OPT, Phi, ...), ``query`` /
  ``key`` (BERT-style), or a packed ``c_attn`` (GPT-2's ``Conv1D``, weight (C, 3C); nanoGPT's
  ``nn.Linear``, weight (3C, C)), q the first third and k the second;
* by names the user passes: attention module names (each searched as above), or
  ``(query_name, key_name)`` pairs of projection modules (the same name twice: a packed
  q, k, v projection split in thirds).

Heads: ``n_head`` if given, else the attention module's ``num_heads`` / ``n_head`` /
``num_attention_heads`` or its ``config`` / the model's ``config``; the head dim is the query
projection's rows over the heads, and the key heads (grouped-query attention) the key rows over
the head dim.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn

__all__ = ["Projections", "find_projections"]

_PAIRS = (("q_proj", "k_proj"), ("query", "key"))
_PACKED = ("c_attn",)
_HEAD_ATTRS = ("num_heads", "n_head", "num_attention_heads", "n_heads")


def _weight(mod: nn.Module) -> torch.Tensor | None:
    """The module's weight as (out, in): transposed for GPT-2's Conv1D."""
    w = getattr(mod, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        return None
    return w.t() if type(mod).__name__ == "Conv1D" else w


def _heads_attr(*objs) -> int | None:
    for obj in objs:
        for src in (obj, getattr(obj, "config", None)):
            for a in _HEAD_ATTRS:
                v = getattr(src, a, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v
    return None


class Projections:
    """Per layer, how to read W_Q and W_K as (heads, head_dim, n_embd) views; shaped like the
    part of flashguard's GPT that ``weight_probe`` reads (``config.n_layer``, ``wq_heads``,
    ``wk_heads``). ``where`` says, per layer, which modules they come from."""

    def __init__(self, parts: dict[int, tuple], where: dict[int, str]):
        self._parts = parts            # layer -> (q weight fn, k weight fn, n_head, n_kv_head)
        self.where = where
        self.layers = sorted(parts)
        self.config = SimpleNamespace(n_layer=(max(parts) + 1) if parts else 0)

    def __len__(self) -> int:
        return len(self._parts)

    def _heads(self, layer: int, which: int) -> torch.Tensor:
        qf, kf, h, hk = self._parts[layer]
        wq = qf()
        d = wq.shape[0] // h
        w = (wq if which == 0 else kf()).detach()
        return w.reshape(w.shape[0] // d, d, w.shape[1])

    def wq_heads(self, layer: int) -> torch.Tensor:
        return self._heads(layer, 0)

    def wk_heads(self, layer: int) -> torch.Tensor:
        return self._heads(layer, 1)


def _from_attention(model: nn.Module, attn: nn.Module, n_head: int | None):
    """(q fn, k fn, heads, kv heads, where) of an attention module's projections, or None."""
    children = dict(attn.named_children())
    heads = n_head or _heads_attr(attn, model)
    if heads is None:
        return None
    for qn, kn in _PAIRS:
        q, k = children.get(qn), children.get(kn)
        if q is not None and k is not None and _weight(q) is not None and _weight(k) is not None:
            if _weight(q).shape[0] % heads:
                return None
            return (lambda q=q: _weight(q)), (lambda k=k: _weight(k)), heads, f"{qn}, {kn}"
    for pn in _PACKED:
        p = children.get(pn)
        if p is not None and _weight(p) is not None and _weight(p).shape[0] % (3 * heads) == 0:
            return _packed(p, heads) + (f"{pn} (packed q, k, v)",)
    return None


def _packed(p: nn.Module, heads: int):
    def part(i):
        w = _weight(p)
        c = w.shape[0] // 3
        return w[i * c:(i + 1) * c]
    return (lambda: part(0)), (lambda: part(1)), heads


def find_projections(model: nn.Module, spec=None, *, n_head: int | None = None,
                     modules: dict | None = None) -> Projections | None:
    """The model's W_Q / W_K per layer, or None when none is found.

    ``spec``: None (automatic: within ``modules`` - {layer: module name}, the watch's named
    layers - if given, else the model's attention modules in order), or the user's names: a list
    (layer = position) or a dict {layer: name} whose entries are attention module names or
    (query, key) projection name pairs. A name that is not a module, or a module without
    recognisable projections, is a ValueError."""
    named = dict(model.named_modules())
    parts, where = {}, {}
    if spec is None and modules:
        spec, strict = dict(modules), False
    else:
        strict = spec is not None
    if spec is None:
        i = 0
        for name, mod in model.named_modules():
            found = _from_attention(model, mod, n_head)
            if found is not None:
                parts[i] = (found[0], found[1], found[2], None)
                where[i] = f"{name}: {found[3]}"
                i += 1
        return Projections(parts, where) if parts else None
    items = spec.items() if isinstance(spec, dict) else enumerate([spec] if isinstance(spec, (str, tuple)) else spec)
    for i, entry in items:
        if isinstance(entry, str):
            if entry not in named:
                raise ValueError(f"flashguard.watch: projections: no module named {entry!r} in the model")
            found = _from_attention(model, named[entry], n_head)
            if found is None:
                if strict:
                    raise ValueError(f"flashguard.watch: projections: {entry!r} has no q_proj / k_proj, query / key or "
                                     "c_attn child with a 2-d weight (or its heads are unknown: pass n_head=); give "
                                     "(query, key) module name pairs instead")
                continue
            parts[int(i)] = (found[0], found[1], found[2], None)
            where[int(i)] = f"{entry}: {found[3]}"
        elif isinstance(entry, (tuple, list)) and len(entry) == 2 and all(isinstance(n, str) for n in entry):
            qn, kn = entry
            for n in (qn, kn):
                if n not in named or _weight(named[n]) is None:
                    raise ValueError(f"flashguard.watch: projections: {n!r} is not a module of the model with a 2-d "
                                     "weight")
            heads = n_head or _heads_attr(model)
            if heads is None:
                raise ValueError("flashguard.watch: projections: the number of heads is not in the model's config; "
                                 "pass n_head=")
            if qn == kn:
                qf, kf, _ = _packed(named[qn], heads)
                parts[int(i)] = (qf, kf, heads, None)
                where[int(i)] = f"{qn} (packed q, k, v)"
            else:
                parts[int(i)] = ((lambda m=named[qn]: _weight(m)), (lambda m=named[kn]: _weight(m)), heads, None)
                where[int(i)] = f"{qn}, {kn}"
        else:
            raise ValueError(f"flashguard.watch: projections entries are attention module names or (query, key) "
                             f"name pairs, got {entry!r}")
    return Projections(parts, where) if parts else None
