"""flashguard as a Hugging Face transformers attention implementation.

    import flashguard.integrations.hf as fg_hf
    name = fg_hf.register(precision="paper", stabilizer="none")     # name "fguard"
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=name)

``register`` puts an attention function into transformers' ``AttentionInterface`` (the registry
every model written in its functional style looks its attention up in, at each call, by the name
in ``config._attn_implementation``) with the options bound, and tells transformers' mask
builder (``AttentionMaskInterface``) to make SDPA's masks for that name: boolean, True = attend,
or None where ``is_causal`` suffices. Without that second registration transformers builds no
mask at all for an unknown name, and padding would be silently ignored.

Per-model arithmetic is per name: register each set of options under its own name and pass that
name as ``attn_implementation`` (or switch a loaded model with
``model.set_attn_implementation(name)``). There is no other way to set options (no config
attribute), so what a model computes is named by the one string transformers already records.

A name must not contain "flash": transformers 5 takes any ``attn_implementation`` containing
"flash" for a flash-attention kernel to load from the Hugging Face hub (``ValueError: Could not
find the currently requested flash attention implementation``), whatever is registered under it.
Hence the default name ``fguard``, and ``register`` refuses such a name at once.

The other way in needs no registration: a model loaded with ``attn_implementation="sdpa"``
calls ``torch.nn.functional.scaled_dot_product_attention``, which ``flashguard.override_sdpa``
reroutes. Both ways call the same ``flashguard.attention.scaled_dot_product_attention`` with the
same arguments, so with the same options they give bit-identical results
(tests/integrations/test_hf.py).

transformers is imported by ``register`` only; this module itself needs torch alone.
"""
from __future__ import annotations

import functools

from ..attention import function as _function
from ..attention.options import FlashOptions, flash_options

__all__ = ["register", "attention_forward", "DEFAULT_NAME"]

# no "flash" in it: transformers 5 reads any attn_implementation containing "flash" as a hub kernel
DEFAULT_NAME = "fguard"

# names transformers passes that change what attention computes and that flashguard does not do;
# refused rather than dropped, so that a model never runs a different attention than it asked for
_UNSUPPORTED = ("position_bias", "s_aux", "sinks")


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *,
                      is_causal=None, softcap=None, options=None, **kwargs):
    """transformers' attention-function signature, computed by flashguard's SDPA drop-in.

    query (B, H, T_q, D), key / value (B, H_kv, T_k, D) with H a multiple of H_kv (grouped-query
    attention: key and value heads are repeated as transformers' ``repeat_kv`` does);
    ``attention_mask``: None, or a 4D boolean (True = attend) or additive float mask
    broadcastable to (B, H, T_q, T_k); ``is_causal`` (None: the module's ``is_causal``, default
    True) applies only where no mask is given and T_q > 1, as in transformers' own sdpa path;
    ``scaling``: the score scale (None: 1/sqrt(D)); ``dropout``: passed on as ``dropout_p``
    (transformers passes 0 outside training), where flashguard's SDPA raises if it cannot honour
    it; ``softcap``: logit soft-capping (the model's, added to ``options``). ``options``: the
    ``FlashOptions`` a registration binds (None: the defaults). Returns (output in (B, T_q, H, D) layout, None): attention
    weights are never materialised.
    """
    used = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if used:
        raise NotImplementedError(f"flashguard attention does not support {', '.join(used)} "
                                  f"(module {type(module).__name__}); use attn_implementation='eager' or 'sdpa'")
    q_len = query.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # transformers' sdpa convention: a given mask already holds the causal pattern, and a single
    # query token (decoding) attends to every cached key
    is_causal = bool(is_causal) and attention_mask is None and q_len > 1
    if is_causal and key.shape[-2] > q_len:
        # prefill into a longer (static) cache: causal alignment is top-left, so the keys past
        # T_q are never attended; dropped as transformers' sdpa path drops them
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    # looked up at call time (not bound at import) so that the function is the one module
    # attribute to wrap, as override_sdpa's path also reaches it
    options = (FlashOptions() if options is None else options).capped(softcap)
    out = _function.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=is_causal, scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1], options=options)
    return out.transpose(1, 2).contiguous(), None


def _check_name(name: str) -> None:
    """Refuse a name transformers would not look up in its registry (see the module docstring)."""
    if "flash" in name:
        suggestion = name.replace("flash", "f") if len(name.replace("flash", "f").strip("-_")) > 1 else DEFAULT_NAME
        raise ValueError(
            f"attn_implementation name {name!r} contains 'flash': transformers (5.x) treats any such name as a "
            f"request for a flash-attention kernel from the Hugging Face hub and never calls the function "
            f"registered under it; choose a name without 'flash', e.g. {suggestion!r} (the default is "
            f"{DEFAULT_NAME!r})")


def register(options: FlashOptions | None = None, *, name: str = DEFAULT_NAME, **fields) -> str:
    """Register flashguard attention with these options under ``name`` in transformers; returns ``name``.

    ``name`` (default ``"fguard"``) must not contain "flash" (ValueError): transformers 5 would
    take it for a hub flash-attention kernel and never call this registration.

    ``options`` (a FlashOptions; None: the defaults) and the keyword ``fields`` that build or
    change it (precision, stabilizer, block_q, block_k, kernel) are flash_attention's, checked
    here. Not ``softcap``: a property of the model (Gemma 2's attn_logit_softcapping), which
    transformers passes to the attention function per call. Registering a
    name again replaces its options for every model that uses it, from its next forward pass
    on. Then ``from_pretrained(..., attn_implementation=name)``, ``from_config(cfg,
    attn_implementation=name)`` or ``model.set_attn_implementation(name)``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty string, got {name!r}")
    _check_name(name)
    if "softcap" in fields or (options is not None and options.softcap is not None):
        raise TypeError("register: softcap is not an option of a registration: transformers passes the model's "
                        "own (attn_logit_softcapping) to the attention function at each call")
    # built (and checked) here, so that a typo fails at registration and not at the first forward pass
    options = flash_options(options, fields, where="register()")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as err:
        raise ImportError("flashguard.integrations.hf.register needs transformers "
                          "(pip install 'flashguard[hf]')") from err
    fn = functools.partial(attention_forward, options=options)
    fn.__name__ = f"flashguard_attention[{name}]"  # named in transformers' logs and reprs
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
