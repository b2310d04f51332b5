"""Public API: ``flash_attention`` (SDPA layout), an SDPA-compatible function, ``override_sdpa``.

NaN / Inf inputs propagate as in torch SDPA: a NaN anywhere in a row's scores or in a V row
that row attends to gives NaN in that output row (and in the gradients it reaches).
Fully masked rows give 0 (SDPA's math backend gives NaN there; flash kernels give 0).

Every entry point takes its options as a ``FlashOptions`` (``options=``; .options), or as
keywords that build one (``precision="paper"``) or change the given one's fields.

The PyTorch implementation runs as an autograd.Function in eager mode and, while torch.compile
traces a model, as the torch custom operators of ``.ops`` (opaque to the compiler, so
``torch.compile(model, fullgraph=True)`` captures it). Both run ``options.run_forward`` /
``options.run_backward`` with the same arguments, so compiled and eager numbers are
bit-identical; eager keeps the Function because the operators' dispatch costs about 0.5 ms a
call, noticeable on small CPU models. ``flash_attention_with_hooks`` (a Python callable in
backward, which an operator cannot take) always runs as the Function.
``dropout_p > 0`` drops attention probabilities as SDPA does (``.dropout``: a counter-based
mask, regenerated in backward, seeded from torch's default generator).

Names: the ``kernel`` (``auto`` | ``pytorch`` | ``triton``) is the implementation that runs the
arithmetic; ``backend`` is a model layer's attention choice (sdpa | flash | math,
flashguard.model.AttentionSpec).
"""
from __future__ import annotations

import contextlib
import math
import numbers

import torch
import torch.nn.functional as F

from .dropout import TileDropout, check_dropout_p, draw_seed
from .ops import encode_policy, encode_stabilizer, flash_attention_op
from .options import (DEFAULT_BLOCK, KERNELS, FlashOptions, Forward, flash_options, run_backward, run_forward,
                      split_mask)
from .triton_flash import triton_available, triton_flash_attention, triton_unsupported

__all__ = ["flash_attention", "scaled_dot_product_attention", "override_sdpa", "DEFAULT_BLOCK", "KERNELS",
           "FlashOptions", "choose_kernel", "flash_attention_with_hooks"]


class _FlashAttentionFn(torch.autograd.Function):
    """The eager path (and the delta-hook path): what the operators of .ops compute."""

    @staticmethod
    def forward(ctx, q, k, v, keep, bias, causal, scale, options, delta_hook, output_hook, dropout):
        fwd = run_forward(q.detach(), k.detach(), v.detach(), options, keep=keep, bias=bias, causal=causal,
                          scale=scale, dropout=dropout)
        if output_hook is not None:  # the injection's O: what the next layer and delta both read
            fwd = fwd._replace(o=output_hook(fwd.o, q=fwd.q, k=fwd.k, v=fwd.v, keep=keep, bias=bias, causal=causal,
                                             scale=scale, softcap=options.softcap, fmt=options.precision.output))
        ctx.save_for_backward(fwd.q, fwd.k, fwd.v, fwd.o, fwd.lse, fwd.o_highp, keep, bias)
        ctx.meta = (causal, scale, options, q.dtype, k.dtype, v.dtype, delta_hook, dropout)
        return fwd.o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        qc, kc, vc, o, lse, o_hp, keep, bias = ctx.saved_tensors
        causal, scale, options, qdt, kdt, vdt, delta_hook, dropout = ctx.meta
        grads = run_backward(Forward(qc, kc, vc, None, o, lse, o_hp), do, options, keep=keep, bias=bias,
                             causal=causal, scale=scale, dropout=dropout, delta_hook=delta_hook,
                             dtypes=(qdt, kdt, vdt))
        return grads + (None,) * 8


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


def choose_kernel(q, k, v, options: FlashOptions | None = None, *, attn_mask=None, dropout_p: float = 0.0,
                  **fields) -> str:
    """The kernel ``flash_attention`` runs for these arguments: "pytorch" or "triton". ``options``
    and ``fields`` as flash_attention's."""
    opts = flash_options(options, fields, where="choose_kernel()")
    if opts.kernel != "auto":
        return opts.kernel
    if not q.is_cuda or not triton_available():
        return "pytorch"
    reason = triton_unsupported(q, k, v, attn_mask=attn_mask, softcap=opts.softcap, precision=opts.precision,
                                stabilizer=opts.stabilizer, block_q=opts.block_q, block_k=opts.block_k,
                                dropout_p=dropout_p)
    return "pytorch" if reason else "triton"


def flash_attention(q, k, v, *, attn_mask=None, is_causal=False, scale=None, dropout_p: float = 0.0,
                    options: FlashOptions | None = None, **fields) -> torch.Tensor:
    """Flash attention with a chosen arithmetic.

    q: (B, H, T_q, D), k: (B, H, T_k, D), v: (B, H, T_k, D_v) -> (B, H, T_q, D_v) in q's dtype.
    ``attn_mask``: bool (True = attend) or float (added to the scores), broadcastable to
    (B, H, T_q, T_k). ``is_causal``: top-left aligned, as torch SDPA. ``scale`` defaults to
    1/sqrt(D).

    ``options``: a ``FlashOptions`` (None: the defaults); keyword ``fields`` build one, or change
    the given one's: ``precision`` (a preset name - ``fp32``, ``paper``, ``fa2``, ``fa2-fp16``,
    ``fa2-e4m3``, ``fa2-e5m2``, ``fp64``, ... - or a PrecisionPolicy; default ``fa2``),
    ``stabilizer`` (``none``, ``paper`` - ``paper:beta=7,tol=1e-3`` -, ``safe`` or a Stabilizer),
    ``block_q`` / ``block_k`` (unset: 512 on the PyTorch kernel, the kernels' own on Triton),
    ``softcap`` (attention-logit soft-capping, scores -> softcap * tanh(scores / softcap), after
    scaling, before masks, as in Gemma 2) and ``kernel``: ``"pytorch"`` (the tiled PyTorch
    implementation: every policy and feature), ``"triton"`` (fused Triton kernels:
    fa2-structured policies - ``fa2``, ``fa2-fp16``, ``fp32`` - without attn_mask or softcap;
    tiles powers of two in [16, 128]; NotImplementedError otherwise) or ``"auto"`` (the
    default: triton when q is on CUDA, triton imports and the call is supported, else pytorch;
    ``choose_kernel`` says which).

    ``dropout_p``: attention dropout as SDPA's, O = dropout(softmax(S)) V with kept probabilities
    scaled by 1 / (1 - p); applied whenever > 0, so pass 0 when not training (as with SDPA). The
    mask is a hash of (seed, batch, head, row, column), regenerated in backward; the seed is drawn
    from torch's default generator at each call (``torch.manual_seed`` reproduces it).
    """
    opts = flash_options(options, fields, where="flash_attention()")
    return _flash_attention(q, k, v, opts, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                            dropout_p=dropout_p)


def flash_attention_with_hooks(q, k, v, *, delta_hook=None, output_hook=None, attn_mask=None, is_causal=False,
                               scale=None, dropout_p: float = 0.0, options: FlashOptions | None = None,
                               **fields) -> torch.Tensor:
    """``flash_attention`` on the PyTorch kernel (whatever ``kernel`` says) with the error-injection
    experiment's hooks (flashguard.attention.injection), reached from a model layer whose
    AttentionSpec carries them: the backward pass hands its delta to ``delta_hook`` and uses the
    delta it returns (see ``flash.flash_backward``); the forward pass hands its O to
    ``output_hook`` and returns (and saves for the backward) the O it returns. Everything else is
    flash_attention's."""
    for name, hook in (("delta_hook", delta_hook), ("output_hook", output_hook)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{name} must be callable, got {type(hook).__name__}")
    if delta_hook is None and output_hook is None:
        raise TypeError("flash_attention_with_hooks() needs a delta_hook or an output_hook (else: flash_attention)")
    opts = flash_options(options, fields, where="flash_attention_with_hooks()")
    return _flash_attention(q, k, v, opts, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                            dropout_p=dropout_p, hooks=(delta_hook, output_hook))


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
    """The operators' strings for these (resolved) options. Run by torch.compile at trace time as
    a constant: encoding a policy (dataclasses.fields, string formatting) is Python that dynamo
    does not trace."""
    return encode_policy(precision), encode_stabilizer(stabilizer)


def _flash_attention(q, k, v, opts: FlashOptions, *, attn_mask, is_causal, scale, dropout_p, hooks=(None, None)):
    _check_inputs(q, k, v, attn_mask)
    dropout_p = check_dropout_p(dropout_p)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    hooked = hooks != (None, None)
    compiling = not hooked and torch.compiler.is_compiling()
    if compiling:
        # The Triton kernels are not captured by torch.compile yet: "auto" runs the PyTorch
        # operators there, and an explicit "triton" is refused.
        if opts.kernel == "triton":
            raise NotImplementedError("torch.compile: kernel='triton' is not supported under torch.compile "
                                      "(use kernel='pytorch' or 'auto', which compile the PyTorch kernel)")
        which = "pytorch"
    elif hooked:
        which = "pytorch"
    else:
        which = choose_kernel(q, k, v, opts, attn_mask=attn_mask, dropout_p=dropout_p)
    # drawn only when used, so that dropout_p=0 leaves the generator where it was
    seed = draw_seed() if dropout_p > 0 else None
    if which == "triton":
        return triton_flash_attention(q, k, v, is_causal=bool(is_causal), scale=float(scale),
                                      stabilizer=opts.stabilizer, precision=opts.precision, attn_mask=attn_mask,
                                      softcap=opts.softcap, block_m=opts.block_q, block_n=opts.block_k,
                                      dropout_p=dropout_p, dropout_seed=seed)  # None tiles: the kernels' own
    keep, bias = split_mask(attn_mask)
    if compiling:
        keys = _option_keys(opts.precision, opts.stabilizer)
        block_q, block_k = opts.tiles()
        return flash_attention_op(q, k, v, keep=keep, bias=bias, seed=seed, causal=bool(is_causal),
                                  scale=float(scale), precision=keys[0], stabilizer=keys[1], block_q=block_q,
                                  block_k=block_k, softcap=opts.softcap, dropout_p=dropout_p)
    dropout = None if seed is None else TileDropout(seed, dropout_p, q.shape[0], q.shape[1], q.shape[2], q.device)
    return _FlashAttentionFn.apply(q, k, v, keep, bias, bool(is_causal), float(scale), opts, *hooks, dropout)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, options: FlashOptions | None = None, **fields):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

    Accepts SDPA's (..., L, E) inputs with any number of leading dims and ``enable_gqa``;
    ``options`` / ``fields`` are ``flash_attention``'s. ``dropout_p`` as SDPA's (applied whenever
    > 0; see ``flash_attention``).
    """
    options = flash_options(options, fields, where="scaled_dot_product_attention()")
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
                              options=options)
        return out.reshape(*lead, *out.shape[-2:])
    if enable_gqa and key.shape[1] != query.shape[1]:
        if query.shape[1] % key.shape[1]:
            raise ValueError(f"enable_gqa: query heads {query.shape[1]} not a multiple of key heads {key.shape[1]}")
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    return flash_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                           dropout_p=dropout_p, options=options)


@contextlib.contextmanager
def override_sdpa(options: FlashOptions | None = None, **fields):
    """Route every ``torch.nn.functional.scaled_dot_product_attention`` call through flashguard.

    Works for any code that looks the function up at call time (nanoGPT, Hugging Face
    transformers' sdpa attention, torch.nn.MultiheadAttention's fast path is *not* included).
    Code that bound the function to another name before entering is not affected. The
    original is restored on exit, also when the body raises.

        with override_sdpa(precision="paper", stabilizer="safe"):
            loss = model(x).loss
        with override_sdpa(FlashOptions(precision="paper", kernel="pytorch")):
            ...

    ``options`` / ``fields`` as ``flash_attention``'s, checked at the ``with``; each call's own
    ``dropout_p``, ``is_causal``, ``scale`` and mask are used.
    """
    # built (and checked) here, so that a typo fails at the `with`, not at the first attention call
    options = flash_options(options, fields, where="override_sdpa()")
    original = F.scaled_dot_product_attention

    def patched(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False):
        return scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                            enable_gqa, options=options)

    patched.__wrapped__ = original
    F.scaled_dot_product_attention = patched
    try:
        yield patched
    finally:
        F.scaled_dot_product_attention = original
