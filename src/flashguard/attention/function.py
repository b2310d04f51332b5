"""Public API: ``flash_attention`` (SDPA layout), an SDPA-compatible function, ``override_sdpa``.

NaN / Inf inputs propagate as in torch SDPA: a NaN anywhere in a row's scores or in a V row
that row attends to gives NaN in that output row (and in the gradients it reaches).
Fully masked rows give 0 (SDPA's math backend gives NaN there; flash kernels give 0).

The PyTorch implementation runs as an autograd.Function in eager mode and, while torch.compile
traces a model, as the torch custom operators of ``.ops`` (opaque to the compiler, so
``torch.compile(model, fullgraph=True)`` captures it). Both call the same flash_forward /
flash_backward with the same arguments, so compiled and eager numbers are bit-identical; eager
keeps the Function because the operators' dispatch costs about 0.5 ms a call, noticeable on
small CPU models. ``flash_attention_with_delta_hook`` (a Python callable in backward, which an
operator cannot take) always runs as the Function.
``dropout_p > 0`` drops attention probabilities as SDPA does (``.dropout``: a counter-based
mask, regenerated in backward, seeded from torch's default generator).

Names: the ``kernel`` (``auto`` | ``pytorch`` | ``triton``) is the implementation that runs the
arithmetic. It used to be called ``backend``, the word now kept for a model layer's attention
choice (sdpa | flash | math, flashguard.model.AttentionSpec): ``backend=`` is still accepted by
``flash_attention``, ``scaled_dot_product_attention`` and ``override_sdpa`` with a
DeprecationWarning naming ``kernel=`` (both at once is a TypeError), and ``KERNEL_BACKENDS`` /
``choose_backend`` still work, with a DeprecationWarning, as ``KERNELS`` / ``choose_kernel``.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import warnings

import torch
import torch.nn.functional as F

from ..numerics.arith import cast, rounding
from ..numerics.policy import PrecisionPolicy, get_policy
from .dropout import TileDropout, check_dropout_p, draw_seed
from .flash import flash_backward, flash_forward
from .ops import encode_policy, encode_stabilizer, flash_attention_op
from .stabilizers import Stabilizer, get_stabilizer
from .triton_flash import triton_available, triton_flash_attention, triton_unsupported

__all__ = ["flash_attention", "scaled_dot_product_attention", "override_sdpa", "DEFAULT_BLOCK", "KERNELS",
           "choose_kernel", "flash_attention_with_delta_hook"]

# Tile edge used when block_q / block_k are not given: the study's reference code uses 512,
# and on CPU large tiles keep the Python loop short. Production GPU kernels use 64-128.
DEFAULT_BLOCK = 512

# The kernel, which implementation runs: "pytorch" (the tiled PyTorch FA2 of .flash: any policy,
# any device, every intermediate rounded as the policy says), "triton" (fused kernels of
# .triton_flash: fa2-structured policies, no masks or soft-capping), or "auto": triton when
# q is on CUDA, triton imports and the call is one the kernels support, else pytorch.
KERNELS = ("auto", "pytorch", "triton")


class _KernelDefault:
    """The default of ``kernel=`` ("auto"), an object of its own so that an explicit ``kernel=``
    next to its old name ``backend=`` can be told from the default and refused."""

    __slots__ = ()

    def __repr__(self):  # what help() and inspect.signature show
        return "'auto'"


class _Unset:
    """The default of the deprecated ``backend=``: not given."""

    __slots__ = ()

    def __repr__(self):
        return "<deprecated: use kernel=>"


_AUTO = _KernelDefault()
_UNSET = _Unset()


def _deprecated_backend(where: str, kernel, backend, stacklevel: int):
    """``kernel=`` from a call that may use its old name ``backend=`` (_UNSET: not given): the old
    name with a DeprecationWarning naming the new one; both given is a TypeError. The default
    (_AUTO) becomes "auto"."""
    if backend is not _UNSET:
        if kernel is not _AUTO:
            raise TypeError(f"{where} got both kernel={kernel!r} and backend={backend!r}; backend= is the old "
                            "name of kernel=: pass kernel= only")
        warnings.warn(f"{where}: backend= is now called kernel= (auto | pytorch | triton; 'backend' names a "
                      f"model layer's attention, sdpa | flash | math): write kernel={backend!r}",
                      DeprecationWarning, stacklevel=stacklevel + 1)
        return backend
    return "auto" if kernel is _AUTO else kernel


def _renamed_options(where: str, options: dict, stacklevel: int) -> dict:
    """``options`` (flash_attention's keywords) with the old name ``backend`` given as ``kernel``
    (a DeprecationWarning; TypeError when both are there)."""
    if "backend" not in options:
        return options
    options = dict(options)
    backend = options.pop("backend")
    options["kernel"] = _deprecated_backend(where, options.pop("kernel", _AUTO), backend, stacklevel + 1)
    return options


def __getattr__(name):  # the old names of KERNELS and choose_kernel, with a DeprecationWarning
    new = {"KERNEL_BACKENDS": "KERNELS"}.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"flashguard.attention.function.{name} is now called {new}", DeprecationWarning, stacklevel=2)
    return globals()[new]


class _FlashAttentionFn(torch.autograd.Function):
    """The eager path (and the delta-hook path): what the operators of .ops compute."""

    @staticmethod
    def forward(ctx, q, k, v, keep, bias, causal, scale, policy, stabilizer, block_q, block_k, softcap,
                delta_hook, dropout):
        with torch.autocast(q.device.type, enabled=False), rounding(policy.rounding):
            qc, kc, vc = (cast(t.detach(), policy.inputs) for t in (q, k, v))
            o, lse, o_hp = flash_forward(
                qc, kc, vc, keep=keep, bias=bias, causal=causal, scale=scale, policy=policy,
                stabilizer=stabilizer, block_q=block_q, block_k=block_k,
                keep_highp_o=policy.delta_source == "o_highp", softcap=softcap, dropout=dropout)
        ctx.save_for_backward(qc, kc, vc, o, lse, o_hp, keep, bias)
        ctx.meta = (causal, scale, policy, block_q, block_k, softcap, q.dtype, k.dtype, v.dtype, delta_hook, dropout)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        qc, kc, vc, o, lse, o_hp, keep, bias = ctx.saved_tensors
        causal, scale, policy, block_q, block_k, softcap, qdt, kdt, vdt, delta_hook, dropout = ctx.meta
        with torch.autocast(do.device.type, enabled=False), rounding(policy.rounding):
            dq, dk, dv = flash_backward(
                qc, kc, vc, o, lse, do, o_hp, keep=keep, bias=bias, causal=causal, scale=scale,
                policy=policy, block_q=block_q, block_k=block_k, softcap=softcap, delta_hook=delta_hook,
                dropout=dropout)
        return (dq.to(qdt), dk.to(kdt), dv.to(vdt)) + (None,) * 11


def _check_block(name, value):
    if value is None:
        return DEFAULT_BLOCK
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def _check_inputs(q, k, v, attn_mask):
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq_len, head_dim), got shape {tuple(t.shape)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):  # refused as torch's scaled_dot_product_attention refuses it
        raise TypeError(f"query, key and value must have the same dtype, got query {q.dtype}, key {k.dtype}, "
                        f"value {v.dtype}")
    if q.shape[0] != k.shape[0] or k.shape[0] != v.shape[0]:
        raise ValueError(f"batch sizes differ: query {q.shape[0]}, key {k.shape[0]}, value {v.shape[0]}")
    if q.shape[1] != k.shape[1] or k.shape[1] != v.shape[1]:
        raise ValueError(f"head counts differ: query {q.shape[1]}, key {k.shape[1]}, value {v.shape[1]}"
                         " (for grouped-query attention use scaled_dot_product_attention(..., enable_gqa=True))")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query and key head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key and value sequence lengths differ: {k.shape[-2]} vs {v.shape[-2]}")
    if attn_mask is None:
        return
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, query on {q.device}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (added to scores), got {attn_mask.dtype}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        ok = attn_mask.dim() <= 4 and torch.broadcast_shapes(attn_mask.shape, target) == torch.Size(target)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                         f"(batch, heads, T_q, T_k) = {target}")


def _check_kernel(kernel):
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; known: {', '.join(KERNELS)}")
    return kernel


def choose_kernel(q, k, v, *, attn_mask=None, precision="fa2", stabilizer="none", block_q=None,
                  block_k=None, softcap=None, kernel="auto", dropout_p=0.0) -> str:
    """The kernel ``flash_attention`` runs for these arguments: "pytorch" or "triton"."""
    _check_kernel(kernel)
    if kernel != "auto":
        return kernel
    if not q.is_cuda or not triton_available():
        return "pytorch"
    reason = triton_unsupported(q, k, v, attn_mask=attn_mask, softcap=softcap, precision=precision,
                                stabilizer=stabilizer, block_q=block_q, block_k=block_k, dropout_p=dropout_p)
    return "pytorch" if reason else "triton"


def choose_backend(q, k, v, *, backend="auto", **kwargs) -> str:
    """Deprecated: the old name of ``choose_kernel`` (and ``backend=`` of its ``kernel=``)."""
    warnings.warn("flashguard.attention.choose_backend is now called choose_kernel, and its backend= argument "
                  f"kernel=: write choose_kernel(..., kernel={backend!r})", DeprecationWarning, stacklevel=2)
    return choose_kernel(q, k, v, kernel=backend, **kwargs)


def flash_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None,
                    precision: "str | PrecisionPolicy" = "fa2",
                    stabilizer: "str | Stabilizer" = "none",
                    block_q: int | None = None, block_k: int | None = None,
                    softcap: float | None = None, kernel: str = _AUTO, dropout_p: float = 0.0,
                    backend=_UNSET) -> torch.Tensor:
    """Flash attention with a chosen arithmetic.

    q: (B, H, T_q, D), k: (B, H, T_k, D), v: (B, H, T_k, D_v) -> (B, H, T_q, D_v) in q's dtype.
    ``attn_mask``: bool (True = attend) or float (added to the scores), broadcastable to
    (B, H, T_q, T_k). ``is_causal``: top-left aligned, as torch SDPA. ``scale`` defaults to
    1/sqrt(D). ``precision``: a preset name (``fp32``, ``paper``, ``fa2``, ``fa2-fp16``,
    ``fa2-e4m3``, ``fa2-e5m2``, ``fp64``) or a PrecisionPolicy. ``stabilizer``: ``none``,
    ``paper`` (``paper:beta=7,tol=1e-3``), ``safe`` or a Stabilizer. Unset tiles: 512 (pytorch), the kernels' own (triton).
    ``softcap``: attention-logit soft-capping, scores -> softcap * tanh(scores / softcap)
    (after scaling, before masks), as in Gemma 2.
    ``kernel``: ``"pytorch"`` (the tiled PyTorch implementation: every policy and feature),
    ``"triton"`` (fused Triton kernels: fa2-structured policies - ``fa2``, ``fa2-fp16``,
    ``fp32`` - without attn_mask or softcap; tiles ``block_q`` / ``block_k`` powers of two in
    [16, 128], None = the kernels' own; NotImplementedError otherwise) or ``"auto"`` (triton
    when q is on CUDA, triton imports and the call is supported, else pytorch; ``choose_kernel``
    says which). ``backend=`` is its old name: accepted with a DeprecationWarning, TypeError
    together with ``kernel=``.
    ``dropout_p``: attention dropout as SDPA's, O = dropout(softmax(S)) V with kept probabilities
    scaled by 1 / (1 - p); applied whenever > 0, so pass 0 when not training (as with SDPA). The
    mask is a hash of (seed, batch, head, row, column), regenerated in backward; the seed is drawn
    from torch's default generator at each call (``torch.manual_seed`` reproduces it).
    """
    if backend is _UNSET:
        kernel = "auto" if kernel is _AUTO else kernel
    else:
        kernel = _deprecated_backend("flash_attention()", kernel, backend, stacklevel=2)
    return _flash_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, precision=precision,
                            stabilizer=stabilizer, block_q=block_q, block_k=block_k, softcap=softcap,
                            kernel=kernel, delta_hook=None, dropout_p=dropout_p)


def flash_attention_with_delta_hook(q, k, v, *, delta_hook, attn_mask=None, is_causal=False, scale=None,
                                    precision: "str | PrecisionPolicy" = "fa2",
                                    stabilizer: "str | Stabilizer" = "none",
                                    block_q: int | None = None, block_k: int | None = None,
                                    softcap: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """``flash_attention`` (PyTorch kernel) whose backward pass hands its delta to ``delta_hook``
    and uses the delta it returns (see ``flash.flash_backward``): the error-injection experiment's
    entry (flashguard.attention.injection.DeltaHook), reached from a model layer whose
    AttentionSpec carries the hook. The forward pass and everything else are flash_attention's."""
    if not callable(delta_hook):
        raise TypeError(f"delta_hook must be callable, got {type(delta_hook).__name__}")
    return _flash_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, precision=precision,
                            stabilizer=stabilizer, block_q=block_q, block_k=block_k, softcap=softcap,
                            kernel="pytorch", delta_hook=delta_hook, dropout_p=dropout_p)


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result without its import of torch._dynamo (which imports
    triton: seconds, on every `import flashguard` that touches attention). That decorator only
    sets this attribute (torch 2.13, torch/_dynamo/decorators.py). On torch 2.13 dynamo also
    traces _option_keys without it (test_compile passes either way); the mark spares it the
    string parsing and the guards on it."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _option_keys(precision, stabilizer) -> tuple[str, str]:
    """The operators' strings for these options, validated. Run by torch.compile at trace time
    as a constant: resolving and encoding a policy (string parsing, dataclasses.fields) is
    Python that dynamo does not trace."""
    return encode_policy(get_policy(precision)), encode_stabilizer(get_stabilizer(stabilizer))


def _flash_attention(q, k, v, *, attn_mask, is_causal, scale, precision, stabilizer, block_q, block_k, softcap,
                     kernel, delta_hook, dropout_p=0.0):
    _check_inputs(q, k, v, attn_mask)
    compiling = delta_hook is None and torch.compiler.is_compiling()
    if compiling:
        keys = _option_keys(precision, stabilizer)
        # The Triton kernels are not captured by torch.compile yet: "auto" runs the PyTorch
        # operators there, and an explicit "triton" is refused.
        if _check_kernel(kernel) == "triton":
            raise NotImplementedError("torch.compile: kernel='triton' is not supported under torch.compile "
                                      "(use kernel='pytorch' or 'auto', which compile the PyTorch kernel)")
        which = "pytorch"
    else:
        policy = get_policy(precision)
        stab = get_stabilizer(stabilizer)
    dropout_p = check_dropout_p(dropout_p)
    tiles = _check_block("block_q", block_q), _check_block("block_k", block_k)
    if not compiling:
        which = choose_kernel(q, k, v, attn_mask=attn_mask, precision=policy, stabilizer=stab, block_q=block_q,
                              block_k=block_k, softcap=softcap, kernel=kernel, dropout_p=dropout_p)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not softcap > 0):
        raise ValueError(f"softcap must be a positive float or None, got {softcap!r}")
    # drawn only when used, so that dropout_p=0 leaves the generator where it was
    seed = draw_seed() if dropout_p > 0 else None
    if which == "triton":
        return triton_flash_attention(q, k, v, is_causal=bool(is_causal), scale=float(scale), stabilizer=stab,
                                      precision=policy, attn_mask=attn_mask, softcap=softcap,
                                      block_m=block_q, block_n=block_k,  # None: the kernels' tiles
                                      dropout_p=dropout_p, dropout_seed=seed)
    keep = bias = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            keep = attn_mask
        else:
            bias = attn_mask.detach()
    softcap = None if softcap is None else float(softcap)
    if compiling:
        return flash_attention_op(q, k, v, keep=keep, bias=bias, seed=seed, causal=bool(is_causal),
                                  scale=float(scale), precision=keys[0], stabilizer=keys[1], block_q=tiles[0],
                                  block_k=tiles[1], softcap=softcap, dropout_p=dropout_p)
    dropout = None if seed is None else TileDropout(seed, dropout_p, q.shape[0], q.shape[1], q.shape[2], q.device)
    return _FlashAttentionFn.apply(q, k, v, keep, bias, bool(is_causal), float(scale), policy, stab,
                                   *tiles, softcap, delta_hook, dropout)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, **options):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Accepts SDPA's (..., L, E) inputs with any number of leading dims and ``enable_gqa``;
    ``options`` are ``flash_attention``'s (precision, stabilizer, block_q, block_k, softcap, kernel;
    the old name ``backend`` of ``kernel`` with a DeprecationWarning).
    ``dropout_p`` as SDPA's (applied whenever > 0; see ``flash_attention``).
    """
    options = _renamed_options("scaled_dot_product_attention()", options, stacklevel=2)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dims (..., seq_len, head_dim), got shape {tuple(t.shape)}")
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        lead = query.shape[:-2]
        q4 = query.reshape(-1, 1, *query.shape[-2:])
        k4 = key.expand(*lead, *key.shape[-2:]).reshape(-1, 1, *key.shape[-2:])
        v4 = value.expand(*lead, *value.shape[-2:]).reshape(-1, 1, *value.shape[-2:])
        m4 = None
        if attn_mask is not None:
            m4 = attn_mask.expand(*lead, query.shape[-2], key.shape[-2]).reshape(-1, 1, query.shape[-2], key.shape[-2])
        out = flash_attention(q4, k4, v4, attn_mask=m4, is_causal=is_causal, scale=scale, dropout_p=dropout_p,
                              **options)
        return out.reshape(*lead, *out.shape[-2:])
    if enable_gqa and key.shape[1] != query.shape[1]:
        if query.shape[1] % key.shape[1]:
            raise ValueError(f"enable_gqa: query heads {query.shape[1]} not a multiple of key heads {key.shape[1]}")
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return flash_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                           dropout_p=dropout_p, **options)


@contextlib.contextmanager
def override_sdpa(**options):
    """Route every ``torch.nn.functional.scaled_dot_product_attention`` call through flashguard.

    Works for any code that looks the function up at call time (nanoGPT, Hugging Face
    transformers' sdpa attention, torch.nn.MultiheadAttention's fast path is *not* included).
    Code that bound the function to another name before entering is not affected. The
    original is restored on exit, also when the body raises.

        with override_sdpa(precision="paper", stabilizer="safe"):
            loss = model(x).loss

    ``kernel="triton"`` / ``"pytorch"`` / ``"auto"`` (the default) as in ``flash_attention``
    (``backend=``, its old name, with a DeprecationWarning).
    """
    # stacklevel 3: past this generator and contextlib's __enter__, at the `with`
    options = _renamed_options("override_sdpa()", options, stacklevel=3)
    # validate eagerly so that a typo fails at the `with`, not at the first attention call
    get_policy(options.get("precision", "fa2"))
    get_stabilizer(options.get("stabilizer", "none"))
    _check_kernel(options.get("kernel", "auto"))
    unknown = set(options) - {"precision", "stabilizer", "block_q", "block_k", "softcap", "kernel"}
    if unknown:
        raise TypeError(f"override_sdpa got unknown option(s) {sorted(unknown)}; "
                        "expected precision, stabilizer, block_q, block_k, softcap, kernel")
    original = F.scaled_dot_product_attention

    def patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                            enable_gqa, **options)

    patched.__wrapped__ = original
    F.scaled_dot_product_attention = patched
    try:
        yield patched
    finally:
        F.scaled_dot_product_attention = original
