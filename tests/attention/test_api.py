"""Public API: argument checking, the SDPA drop-in and override_sdpa."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from flashguard.attention import flash_attention, override_sdpa, scaled_dot_product_attention
from flashguard.numerics import PrecisionPolicy

X = torch.randn(2, 3, 10, 8)


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(q=torch.randn(3, 10, 8)), ValueError, "query must be 4-D"),
    (dict(k=torch.randn(2, 3, 10)), ValueError, "key must be 4-D"),
    (dict(k=torch.randn(1, 3, 10, 8)), ValueError, "batch sizes differ"),
    (dict(v=torch.randn(2, 2, 10, 8)), ValueError, "head counts differ"),
    (dict(k=torch.randn(2, 3, 10, 7)), ValueError, "head dims differ"),
    (dict(v=torch.randn(2, 3, 11, 8)), ValueError, r"key and value.*\b10\b.*\b11\b"),   # who differs, and how
    (dict(q=torch.ones(2, 3, 10, 8, dtype=torch.int32)), TypeError, "^query.*int32"),      # the argument, what it got
    (dict(v=[1.0]), TypeError, "^value.*list"),
    (dict(k=torch.randn(2, 3, 10, 8, device="meta")), ValueError, "one device"),
    (dict(k=X.to(torch.bfloat16)), TypeError, "query torch.float32, key torch.bfloat16"),
    (dict(v=X.to(torch.float64)), TypeError, "same dtype"),
    (dict(attn_mask=torch.ones(10, 9, dtype=torch.bool)), ValueError, "attn_mask of shape"),
    (dict(attn_mask=torch.ones(2, 3, 10, 10, 1, dtype=torch.bool)), ValueError, "attn_mask of shape"),
    (dict(attn_mask=torch.ones(10, 10, dtype=torch.int64)), TypeError, "^attn_mask.*int64"),
    (dict(block_q=0), ValueError, r"^block_q.*\b0$"),
    (dict(block_k=2.5), ValueError, r"^block_k.*2\.5$"),
    (dict(precision="bf17"), ValueError, "^precision.*'bf17'"),
    (dict(stabilizer="magic"), ValueError, "^stabilizer.*'magic'"),
    (dict(scale="big"), TypeError, "^scale.*str"),
])
def test_bad_input_names_the_problem(kwargs, exc, msg):
    args = dict(q=X, k=X, v=X)
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=msg):
        flash_attention(q, k, v, **args)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32, torch.float32),
                                    (torch.float32, torch.float32, torch.bfloat16),
                                    (torch.float16, torch.bfloat16, torch.bfloat16)])
def test_mixed_dtypes_are_refused_where_sdpa_refuses_them(dtypes):
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=dt) for dt in dtypes)
    with pytest.raises(RuntimeError, match="same dtype"):
        F.scaled_dot_product_attention(q, k, v)   # torch's own refusal, on CPU
    with pytest.raises(TypeError, match="same dtype"):
        flash_attention(q, k, v)
    with pytest.raises(TypeError, match="same dtype"):
        scaled_dot_product_attention(q, k, v)
    with override_sdpa(precision="fa2"), pytest.raises(TypeError, match="same dtype"):
        F.scaled_dot_product_attention(q, k, v)


def test_policy_fields_are_validated():
    with pytest.raises(ValueError, match="PrecisionPolicy.scores"):
        PrecisionPolicy(scores="fp7")
    with pytest.raises(ValueError, match="delta_source"):
        PrecisionPolicy(delta_source="magic")
    with pytest.raises(ValueError, match="row_sum_floor"):
        PrecisionPolicy(row_sum_floor=0.0)


def test_sdpa_dropin_matches_torch_on_3d_gqa_and_masks():
    q, k, v = torch.randn(4, 10, 8), torch.randn(4, 12, 8), torch.randn(4, 12, 8)
    mask = torch.rand(10, 12) > 0.3
    ours = scaled_dot_product_attention(q, k, v, attn_mask=mask, precision="fp32")
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-5, atol=1e-6)
    q4, k4 = torch.randn(2, 6, 10, 8), torch.randn(2, 2, 10, 8)
    ours = scaled_dot_product_attention(q4, k4, k4, is_causal=True, enable_gqa=True, precision="fp32")
    ref = F.scaled_dot_product_attention(q4, k4, k4, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"dropout_p.*1\.5"):  # dropout itself: test_dropout.py
        scaled_dot_product_attention(q, k, v, dropout_p=1.5)


class TinyAttention(torch.nn.Module):
    """Looks the function up at call time, as nanoGPT and Hugging Face do."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum()


def test_override_routes_calls_and_restores():
    original = F.scaled_dot_product_attention
    model, x = TinyAttention(), torch.randn(2, 7, 16)
    calls = []
    import flashguard.attention.function as fn
    real = fn.flash_attention

    def spy(*a, **kw):
        calls.append(kw["options"].precision.name)
        return real(*a, **kw)

    fn.flash_attention = spy
    try:
        with override_sdpa(precision="paper", stabilizer="safe"):
            assert F.scaled_dot_product_attention is not original
            loss = model(x)
            loss.backward()
    finally:
        fn.flash_attention = real
    assert calls == ["paper"]
    assert F.scaled_dot_product_attention is original
    assert model.qkv.weight.grad is not None and torch.isfinite(model.qkv.weight.grad).all()
    # same result as calling flashguard directly
    q, k, v = model.qkv(x).view(2, 7, 3, 2, 8).permute(2, 0, 3, 1, 4)
    with override_sdpa(precision="paper", stabilizer="safe"):
        via = model(x)
    direct = flash_attention(q, k, v, is_causal=True, precision="paper", stabilizer="safe").sum()
    assert torch.equal(via, direct)


def test_override_restores_on_exception_and_rejects_bad_options():
    original = F.scaled_dot_product_attention
    with pytest.raises(RuntimeError, match="boom"):
        with override_sdpa(precision="fa2"):
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is original
    with pytest.raises(ValueError, match="unknown precision"):
        with override_sdpa(precision="nope"):
            pass
    with pytest.raises(TypeError, match="unknown option"):
        with override_sdpa(precison="fa2"):
            pass
    assert F.scaled_dot_product_attention is original


def test_override_reaches_multihead_attention():
    # torch.nn.MultiheadAttention calls the module-level name inside torch.nn.functional
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    x = torch.randn(2, 5, 16)
    plain = mha(x, x, x, need_weights=False)[0]
    with override_sdpa(precision="fa2-e5m2"):
        coarse = mha(x, x, x, need_weights=False)[0]
    assert not torch.equal(plain, coarse)  # went through the fp8 emulation
    torch.testing.assert_close(coarse, plain, rtol=0.3, atol=0.3)


def test_autocast_does_not_leak_into_the_fp32_policy():
    q, k, v = (torch.randn(1, 2, 33, 16) for _ in range(3))
    plain = flash_attention(q, k, v, precision="fp32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = flash_attention(q, k, v, precision="fp32")
    assert inside.dtype == torch.float32 and torch.equal(plain, inside)


def test_kernel_argument():
    """kernel="pytorch" is the tiled implementation; "auto" picks it on CPU (triton needs
    CUDA); unknown names fail in flash_attention and at override_sdpa's `with`."""
    from flashguard.attention import KERNELS, choose_kernel, triton_available

    assert KERNELS == ("auto", "pytorch", "triton")
    q = torch.randn(1, 2, 16, 8)
    assert choose_kernel(q, q, q) == "pytorch"
    assert choose_kernel(q, q, q, kernel="triton") == "triton"
    assert isinstance(triton_available(), bool)
    a = flash_attention(q, q, q, is_causal=True, stabilizer="safe")
    b = flash_attention(q, q, q, is_causal=True, stabilizer="safe", kernel="pytorch")
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="'cuda'") as e:
        flash_attention(q, q, q, kernel="cuda")
    assert e.value.field == "kernel"
    with pytest.raises(ValueError, match="unknown kernel"):
        with override_sdpa(kernel="fast"):
            pass
    with override_sdpa(kernel="pytorch"):
        assert torch.equal(F.scaled_dot_product_attention(q, q, q, is_causal=True),
                           flash_attention(q, q, q, is_causal=True))


def test_flash_options_are_the_one_shape_of_the_options():
    """Every entry point takes a FlashOptions (options=) or keywords that build one: the same bits
    either way; keywords change the given options' fields; defaults and checks are FlashOptions'
    own, with errors naming the option; a keyword that is not an option is a TypeError."""
    from flashguard.attention import FlashOptions, OptionError
    from flashguard.attention.options import DEFAULT_BLOCK, flash_options
    from flashguard.numerics import get_policy

    q = torch.randn(1, 2, 16, 8)
    opts = FlashOptions(precision="paper", stabilizer="safe", block_q=8, kernel="pytorch")
    assert opts.precision == get_policy("paper") and opts.stabilizer.name == "safe"  # resolved once
    assert opts.tiles() == (8, DEFAULT_BLOCK) and FlashOptions().tiles() == (DEFAULT_BLOCK, DEFAULT_BLOCK)
    assert repr(opts) == "FlashOptions(precision='paper', stabilizer='safe', block_q=8, kernel='pytorch')"
    by_kw = flash_attention(q, q, q, is_causal=True, precision="paper", stabilizer="safe", block_q=8,
                            kernel="pytorch")
    assert torch.equal(flash_attention(q, q, q, is_causal=True, options=opts), by_kw)
    assert torch.equal(scaled_dot_product_attention(q, q, q, is_causal=True, options=opts), by_kw)
    with override_sdpa(opts):
        assert torch.equal(F.scaled_dot_product_attention(q, q, q, is_causal=True), by_kw)
    changed = flash_attention(q, q, q, is_causal=True, options=opts, precision="fp32")
    assert torch.equal(changed, flash_attention(q, q, q, is_causal=True, precision="fp32", stabilizer="safe",
                                                block_q=8))
    assert flash_options(opts, {"block_k": 4}) == opts.replace(block_k=4) != opts
    assert flash_options(None, {"precision": "paper"}) is flash_options(None, {"precision": "paper"})  # cached
    assert opts.capped(None) is opts and opts.capped(30.0).softcap == 30.0 and opts.capped(30.0) is opts.capped(30.0)
    assert opts.capped(30) == opts.capped(30.0) and flash_options(None, {}) is flash_options(None, {})
    flash_options(None, {"block_q": 64})
    for bad in (64.0, True):  # equal to a cached 64 or 1, but not a tile
        with pytest.raises(OptionError, match=f"^block_q.*{bad!r}$") as e:
            flash_options(None, {"block_q": bad})
        assert e.value.field == "block_q"
    flash_options(None, {"block_q": 1})
    with pytest.raises(OptionError, match="^block_q.*True$"):
        flash_options(None, {"block_q": True})
    for kwargs in (dict(block_q=0), dict(kernel="cuda"), dict(softcap=0.0), dict(precision="bf17"),
                   dict(stabilizer="magic")):
        ((key, value),) = kwargs.items()
        with pytest.raises(OptionError, match=f"^{key}.*{re.escape(repr(value))}") as e:   # names the key and value
            FlashOptions(**kwargs)
        assert e.value.field == key
    with pytest.raises(TypeError, match=r"^flash_attention\(\).*\['backend'\]"):
        flash_attention(q, q, q, backend="pytorch")
    with pytest.raises(TypeError, match="FlashOptions.*str"):   # what it takes, what it got
        flash_attention(q, q, q, options="paper")
    with pytest.raises(TypeError, match="unknown option"):
        opts.replace(precison="fa2")


def test_keywords_do_not_warn(recwarn):
    q = torch.randn(1, 1, 8, 4)
    flash_attention(q, q, q, kernel="pytorch")
    flash_attention(q, q, q)
    scaled_dot_product_attention(q, q, q, kernel="auto")
    with override_sdpa(kernel="pytorch"):
        F.scaled_dot_product_attention(q, q, q)
    assert not [w for w in recwarn if issubclass(w.category, DeprecationWarning)]


def test_triton_backend_refuses_unsupported_features_without_running():
    """The checks come before any kernel is loaded, so they hold with or without triton."""
    from flashguard.attention.triton_flash import fa2_structured, triton_unsupported

    q = torch.randn(1, 1, 8, 16)
    for name in ("fa2", "fa2-fp16", "fp32", "fa2[row_sum_rounded=true]"):
        assert fa2_structured(name) is None, name
    for name in ("paper", "fp64", "fa2-e5m2", "fa2[pv=bf16]"):
        assert fa2_structured(name), name
    assert "attn_mask" in triton_unsupported(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool), need_device=False)
    assert "softcap" in triton_unsupported(q, q, q, softcap=5.0, need_device=False)
    assert "head dim" in triton_unsupported(torch.randn(1, 1, 8, 256), torch.randn(1, 1, 8, 256),
                                            torch.randn(1, 1, 8, 256), need_device=False)
    assert triton_unsupported(q, q, q, stabilizer="paper:beta=7", block_q=64, need_device=False) is None
    with pytest.raises(NotImplementedError, match="softcap"):
        flash_attention(q, q, q, softcap=5.0, kernel="triton")
