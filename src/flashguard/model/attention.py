"""Which attention a layer runs: AttentionSpec, the per-layer choice, and the call itself.

A layer's attention is an AttentionSpec. Its ``backend`` says what computes softmax(Q K^T / sqrt(D)) V:

* ``sdpa``   torch.nn.functional.scaled_dot_product_attention (whatever kernel torch picks).
* ``flash``  flashguard's flash_attention with a PrecisionPolicy and a stabilizer: the study's
             object, emulating a chosen low-precision FA2 arithmetic; its ``kernel``
             (auto | pytorch | triton) and tiles say which implementation runs it.
* ``math``   the plain composite formula in fp32 with ordinary torch ops and autograd (autocast
             disabled inside), cast back to the input dtype: "standard attention in high
             precision". torch calls its own such SDPA path "math" too.

Attention-logit soft-capping (GPTConfig.attn_softcap) replaces the scores S by
cap * tanh(S / cap) before the mask and the softmax. torch SDPA cannot do this, so a layer
whose backend is ``sdpa`` runs ``math`` instead when a cap is set (``effective_backend``).

Attention dropout (GPTConfig.attn_dropout, default 0: none) drops attention probabilities while
the model trains, O = dropout(softmax(S)) V with kept entries scaled by 1 / (1 - p), in every
backend: ``sdpa`` and ``flash`` by their own ``dropout_p``, ``math`` with the keep mask
flashguard's flash kernels draw (attention.dropout), from the same generator state. Every backend
computes the same function in expectation, and exactly the same one at p = 0 (evaluation), so one
layer's backend can be swapped for another on the same weights.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
import torch.nn.functional as F

from ..attention import flash_attention, reference_attention
from ..attention.dropout import check_dropout_p, draw_seed, dropout_keep_mask
from ..attention.function import choose_kernel, flash_attention_with_hooks
from ..attention.options import (DEFAULT_KERNEL, DEFAULT_PRECISION, DEFAULT_STABILIZER, KERNELS, FlashOptions,
                                 OptionError)
from ..attention.stabilizers import Stabilizer
from ..attention.triton_flash import triton_unsupported_settings
from ..numerics.policy import PrecisionPolicy
from .checks import is_int

__all__ = ["BACKENDS", "KERNELS", "SpecError", "AttentionSpec", "FIELDS", "SETTINGS", "FLASH_ONLY", "layer_specs",
           "layer_index", "effective_backend", "check_layer_spec", "attend"]


# --------------------------------------------------------------------------------------------
# names

BACKENDS = ("sdpa", "flash", "math")
# KERNELS (from flashguard.attention): which implementation runs a flash layer, flash_attention's
# kernel= (auto | pytorch | triton)


# --------------------------------------------------------------------------------------------
# the spec

# field metadata: "flash" = used by the flash backend only; "setting" = False for a field that is
# not a configuration value (the injection's hook, set by code)
_FLASH = {"flash": True}


class SpecError(ValueError):
    """A bad AttentionSpec value; ``field`` names it (a config names it by its own key)."""

    def __init__(self, field_name: str, problem: str):
        super().__init__(f"AttentionSpec.{field_name}: {problem}")
        self.field, self.problem = field_name, problem


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer computes attention: the one definition of the attention choice (a training
    config's [attention] section holds one and names its keys after these fields).

    ``backend`` is ``sdpa``, ``flash`` or ``math`` (module docstring). The ``flash`` backend's
    options are named as a config names them: ``precision`` (a flashguard preset name or a
    PrecisionPolicy), ``stabilizer`` (``none``, ``paper``, ``paper:beta=7``, ``safe`` or a
    Stabilizer), the tile sizes ``block_q`` / ``block_k`` (None = the kernel's default: 512 on the
    PyTorch path, the Triton kernels' own) and ``kernel`` (flash_attention's kernel=: ``auto`` =
    Triton on CUDA when it supports the call, else PyTorch; ``pytorch``; ``triton``, refused here
    for settings it cannot run), checked and resolved once into ``options``, the
    ``FlashOptions`` the layer runs (its soft-cap is the model's, GPTConfig.attn_softcap, added
    per layer). ``delta_hook`` and ``output_hook`` are the flash backend's too: callables the
    layer's backward pass hands its delta to (the forward pass its O) and takes the value to use
    from (the error-injection experiment, flashguard.attention.injection; the PyTorch kernel then
    runs, so ``kernel`` may not be ``triton``).
    """

    backend: str = "sdpa"
    precision: str | PrecisionPolicy = dataclasses.field(default=DEFAULT_PRECISION, metadata=_FLASH)
    stabilizer: str | Stabilizer = dataclasses.field(default=DEFAULT_STABILIZER, metadata=_FLASH)
    block_q: int | None = dataclasses.field(default=None, metadata=_FLASH)
    block_k: int | None = dataclasses.field(default=None, metadata=_FLASH)
    kernel: str = dataclasses.field(default=DEFAULT_KERNEL, metadata=_FLASH)
    delta_hook: Callable | None = dataclasses.field(default=None, metadata={"flash": True, "setting": False})
    output_hook: Callable | None = dataclasses.field(default=None, metadata={"flash": True, "setting": False})
    # the flash fields above, resolved (not a field a spec is made with, compared or saved by)
    options: FlashOptions = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise SpecError("backend", f"unknown backend {self.backend!r}; known: {', '.join(BACKENDS)}")
        try:
            options = FlashOptions(precision=self.precision, stabilizer=self.stabilizer, block_q=self.block_q,
                                   block_k=self.block_k, kernel=self.kernel)
        except OptionError as e:
            raise SpecError(e.field, e.problem) from None
        # frozen: the one sanctioned way to set a field is object.__setattr__ in __post_init__
        object.__setattr__(self, "options", options)
        for name in ("delta_hook", "output_hook"):
            hook = getattr(self, name)
            if hook is not None and not callable(hook):
                raise SpecError(name, f"must be None or callable, got {hook!r}")
            if hook is not None and self.backend != "flash":
                raise SpecError(name, f"applies to the flash backend only, not {self.backend!r}")
        if self.backend == "flash" and self.kernel == "triton":
            if self.hooked:
                raise SpecError("kernel", "the injection's hooks run on the pytorch kernel, not triton")
            reason = triton_unsupported_settings(precision=options.precision, stabilizer=options.stabilizer,
                                                 block_q=options.block_q, block_k=options.block_k)
            if reason:
                raise SpecError("kernel", f"the triton kernel cannot run {reason}")

    def with_changes(self, change: Mapping[str, Any]) -> "AttentionSpec":
        """This spec with the fields in ``change`` set (SpecError for an unknown field, a bad value,
        or a flash-only field set where the backend is not flash: it would be silently ignored)."""
        unknown = sorted(set(change) - set(FIELDS))
        if unknown:
            raise SpecError(unknown[0], f"unknown field(s) {unknown}; known: {', '.join(FIELDS)}")
        spec = dataclasses.replace(self, **change)
        misplaced = sorted(set(change) & set(FLASH_ONLY)) if spec.backend != "flash" else []
        if misplaced:
            raise SpecError(misplaced[0], f"{misplaced} only apply to the flash backend, but this layer's "
                                          f"backend is {spec.backend!r}")
        return spec

    @property
    def hooked(self) -> bool:
        """Whether the injection's hooks ride on this layer (then the PyTorch kernel runs it)."""
        return self.delta_hook is not None or self.output_hook is not None

    def settings(self) -> dict:
        """The fields a configuration sets (all but the hooks), by name."""
        return {name: getattr(self, name) for name in SETTINGS}

    def kernel_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softcap: float | None = None) -> str:
        """The flash kernel this spec runs on these inputs, ``pytorch`` or ``triton``: ``kernel``
        resolved as flash_attention resolves it (choose_kernel); the delta hook's path is PyTorch."""
        if self.hooked:
            return "pytorch"
        return choose_kernel(q, k, v, self.options.capped(softcap))

    def short_str(self) -> str:
        """For run names and logs: ``sdpa``, ``math``, ``flash[paper,safe]``, ``flash[fa2,none,128x128]``,
        ``flash[fa2,none,triton]`` (the kernel when it is not ``auto``)."""
        if self.backend != "flash":
            return self.backend
        prec = self.precision if isinstance(self.precision, str) else self.precision.short_str()
        stab = self.stabilizer if isinstance(self.stabilizer, str) else self.stabilizer.name
        parts = [prec, stab]
        if self.block_q is not None or self.block_k is not None:
            parts.append(f"{self.block_q or 'default'}x{self.block_k or 'default'}")
        if self.kernel != "auto":
            parts.append(self.kernel)
        return f"flash[{','.join(parts)}]"


_INIT_FIELDS = [f for f in dataclasses.fields(AttentionSpec) if f.init]
FIELDS = tuple(f.name for f in _INIT_FIELDS)
SETTINGS = tuple(f.name for f in _INIT_FIELDS if f.metadata.get("setting", True))
FLASH_ONLY = tuple(f.name for f in _INIT_FIELDS if f.metadata.get("flash", False))


# --------------------------------------------------------------------------------------------
# one spec per layer

def layer_specs(default: AttentionSpec, overrides: Mapping[Any, Mapping[str, Any] | AttentionSpec] | None,
                n_layer: int) -> list[AttentionSpec]:
    """One AttentionSpec per layer: ``default`` everywhere, changed where ``overrides`` says.

    ``overrides`` maps a layer index (0-based; an int or a string of digits, as TOML keys are
    strings) to the fields to change, or to a whole AttentionSpec:

        layer_specs(AttentionSpec("flash", precision="paper"), {1: {"precision": "fp32"}}, 12)
        layer_specs(AttentionSpec("sdpa"), {1: {"backend": "flash", "precision": "paper"}}, 12)

    Raises ValueError for an index outside [0, n_layer), an unknown field, or a flash-only
    field (precision, stabilizer, block_q, block_k, kernel) set on a layer whose backend is not
    flash (it would be silently ignored).
    """
    if not isinstance(default, AttentionSpec):
        raise TypeError(f"default must be an AttentionSpec, got {type(default).__name__}")
    if not is_int(n_layer) or n_layer < 1:
        raise ValueError(f"n_layer must be an integer >= 1, got {n_layer!r}")
    specs = [default] * n_layer
    for key, change in (overrides or {}).items():
        index = layer_index(key)
        if not 0 <= index < n_layer:
            raise ValueError(f"attention override for layer {index}: the model has layers "
                             f"0..{n_layer - 1} (n_layer={n_layer})")
        if isinstance(change, AttentionSpec):
            specs[index] = change
            continue
        if not isinstance(change, Mapping):
            raise ValueError(f"attention override for layer {index} must be a dict of fields or an "
                             f"AttentionSpec, got {type(change).__name__}")
        try:
            specs[index] = default.with_changes(change)
        except SpecError as e:
            raise ValueError(f"attention override for layer {index}: {e}") from None
    return specs


def layer_index(key) -> int:
    """A layer override's key as an index: an int, or a string of digits (TOML keys are strings)."""
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    if is_int(key):
        return int(key)
    raise ValueError(f"attention override key {key!r} is not a layer index")


# --------------------------------------------------------------------------------------------
# running it

def effective_backend(spec: AttentionSpec, softcap: float | None) -> str:
    """The backend that actually runs: ``sdpa`` falls back to ``math`` under a softcap."""
    if spec.backend == "sdpa" and softcap is not None:
        return "math"
    return spec.backend


def check_layer_spec(spec: AttentionSpec, softcap: float | None) -> None:
    """What a spec must satisfy on a layer beyond its own checks: the model's soft-cap."""
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an AttentionSpec, got {type(spec).__name__}")
    if spec.backend == "flash" and spec.kernel == "triton" and softcap is not None:
        raise SpecError("kernel", "the triton kernel cannot run softcap (GPTConfig.attn_softcap); "
                                  "use kernel auto or pytorch")


def attend(spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
           softcap: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of (B, H, T, D) tensors as ``spec`` says -> (B, H, T, D).

    ``dropout_p``: attention dropout, applied whenever > 0 (the model passes its attn_dropout while
    training, else 0), by every backend (module docstring)."""
    backend = effective_backend(spec, softcap)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if backend == "flash":
        options = spec.options.capped(softcap)
        if spec.hooked:
            return flash_attention_with_hooks(q, k, v, delta_hook=spec.delta_hook, output_hook=spec.output_hook,
                                              is_causal=True,
                                                   options=options, dropout_p=dropout_p)
        return flash_attention(q, k, v, is_causal=True, options=options, dropout_p=dropout_p)
    # math: the formula in fp32, whatever autocast would do to its matmuls; dropout with the keep
    # mask of attention.dropout, its seed drawn from torch's generator as flash_attention draws it
    drop = {}
    if check_dropout_p(dropout_p) > 0:
        B, H, T_q, T_k = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        drop = {"dropout_keep": dropout_keep_mask(draw_seed(), dropout_p, B, H, T_q, T_k, q.device),
                "dropout_p": dropout_p}
    with torch.autocast(q.device.type, enabled=False):
        y = reference_attention(q, k, v, is_causal=True, dtype=torch.float32, softcap=softcap, **drop)
    return y.to(v.dtype)
