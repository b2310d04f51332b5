"""Attention dropout (flashguard.attention.dropout): the mask, its use in forward and backward,
determinism from torch's generator, expectation equal to attention without dropout."""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from flashguard.attention import flash_attention, override_sdpa, reference_attention, scaled_dot_product_attention
from flashguard.attention.dropout import TileDropout, draw_seed, dropout_keep_mask
from flashguard.attention.function import flash_attention_with_hooks
from flashguard.numerics import get_policy


def _qkv(shape, dtype=torch.float64, seed=0, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape, generator=g, dtype=dtype)
    k = torch.randn(*shape, generator=g, dtype=dtype)
    v = torch.randn(*shape[:-1], dv or shape[-1], generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _seeded(seed, fn, *args, **kwargs):
    """fn under torch.manual_seed(seed), and the dropout seed words it drew."""
    torch.manual_seed(seed)
    words = draw_seed()
    torch.manual_seed(seed)
    return fn(*args, **kwargs), words


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_is_binomial_within_5_sigma(p):
    n_total = 0
    kept = 0
    for s in range(4):
        m = dropout_keep_mask(draw_seed(), p, 2, 3, 128, 96)
        kept += int(m.sum())
        n_total += m.numel()
    sigma = math.sqrt(n_total * p * (1 - p))
    assert abs(kept - n_total * (1 - p)) < 5 * sigma


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_seen_through_the_attention_output(p):
    """q = 0 gives uniform attention and v = identity puts P_ij * Z_ij in O[i, j]: the share of
    non-zero outputs is the kernel's keep rate, and each kept one is 1 / (T (1 - p))."""
    B, H, T = 2, 2, 64
    q = torch.zeros(B, H, T, 8, dtype=torch.float64)
    v = torch.eye(T, dtype=torch.float64).expand(B, H, T, T)
    o = flash_attention(q, q, v, precision="fp64", block_q=16, block_k=32, dropout_p=p)
    nonzero = o != 0
    n = o.numel()
    assert abs(int(nonzero.sum()) - n * (1 - p)) < 5 * math.sqrt(n * p * (1 - p))
    torch.testing.assert_close(o[nonzero], torch.full_like(o[nonzero], 1 / (T * (1 - p))), rtol=1e-14, atol=0)


def test_mask_does_not_depend_on_tiles_and_mixes_its_inputs():
    d = TileDropout((3, 4), 0.3, 2, 3, 50)
    full = d.keep(0, 50, 0, 40)
    assert torch.equal(full[..., 10:20, 5:33], d.keep(10, 20, 5, 33))
    m = dropout_keep_mask((0, 0), 0.5, 2, 2, 128, 128).double()
    x = m - m.mean()
    for a, b in ((x[..., 1:], x[..., :-1]), (x[..., 1:, :], x[..., :-1, :]), (x[:, 1:], x[:, :-1]), (x[1:], x[:-1])):
        corr = (a * b).mean() / x.var()
        assert abs(corr) < 5 / math.sqrt(a.numel())   # neighbours in column, row, head, batch: uncorrelated
    for other in ((1, 0), (0, 1)):  # a one-bit change of either seed word gives an unrelated mask
        agree = (dropout_keep_mask(other, 0.5, 2, 2, 128, 128) == m.bool()).double().mean()
        assert abs(agree - 0.5) < 5 * 0.5 / math.sqrt(m.numel())


@pytest.mark.parametrize("kwargs", [dict(is_causal=True), dict(attn_mask="bool"), dict(attn_mask="float", softcap=4.0)])
@pytest.mark.parametrize("precision", ["fp64", get_policy("fp64").replace(delta_source="dp_p"),
                                       get_policy("fp64").replace(delta_source="o_highp")])
def test_matches_the_fp64_reference_with_the_regenerated_mask(kwargs, precision):
    B, H, Tq, Tk, p = 2, 2, 13, 11, 0.3
    q, _, _ = _qkv((B, H, Tq, 8))
    _, k, v = _qkv((B, H, Tk, 8), seed=1, dv=5)
    g = torch.Generator().manual_seed(2)
    kw = dict(kwargs)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = torch.rand(Tq, Tk, generator=g) > 0.3
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(B, 1, Tq, Tk, generator=g, dtype=torch.float64)
    o, seed = _seeded(5, flash_attention, q, k, v, precision=precision, block_q=4, block_k=3, dropout_p=p, **kw)
    keep = dropout_keep_mask(seed, p, B, H, Tq, Tk)
    ref = reference_attention(q, k, v, dropout_keep=keep, dropout_p=p, **kw)
    do = torch.randn_like(ref)
    grads = torch.autograd.grad(o, (q, k, v), do)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    torch.testing.assert_close(o, ref, rtol=1e-12, atol=1e-13)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck_in_fp64_with_the_mask_fixed(is_causal):
    q, k, v = _qkv((1, 2, 6, 4))

    def f(q, k, v):
        torch.manual_seed(3)  # the same seed, hence the same mask, at every evaluation
        return flash_attention(q, k, v, is_causal=is_causal, precision="fp64", block_q=4, block_k=4, dropout_p=0.4)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("precision", ["fa2", "paper", "paper-fp32fwd", "fa2-e4m3"])
def test_same_seed_same_bits_other_seed_other_bits(precision):
    q, k, v = _qkv((2, 2, 24, 8), dtype=torch.bfloat16)

    def run(seed):
        torch.manual_seed(seed)
        o = flash_attention(q, k, v, is_causal=True, precision=precision, block_q=8, block_k=16, dropout_p=0.2)
        return (o.detach(), *torch.autograd.grad(o.float().square().sum(), (q, k, v)))

    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(not torch.equal(x, y) for x, y in zip(a, c))
    assert all(torch.isfinite(x).all() for x in a)


@pytest.mark.parametrize("precision", ["fa2", "paper"])
def test_low_precision_dropout_is_close_to_the_reference_with_its_mask(precision):
    B, H, T, p = 1, 2, 40, 0.25
    q, k, v = _qkv((B, H, T, 16), dtype=torch.bfloat16)
    o, seed = _seeded(9, flash_attention, q, k, v, is_causal=True, precision=precision, block_q=16, block_k=8,
                      dropout_p=p)
    ref = reference_attention(q, k, v, is_causal=True, dropout_keep=dropout_keep_mask(seed, p, B, H, T, T),
                              dropout_p=p)
    torch.testing.assert_close(o.double(), ref, rtol=0.05, atol=0.05)   # bf16 arithmetic


def test_dropout_zero_is_todays_attention_and_draws_nothing():
    q, k, v = _qkv((2, 2, 17, 8), dtype=torch.bfloat16)
    torch.manual_seed(4)
    a = flash_attention(q, k, v, is_causal=True, precision="paper", block_q=8, block_k=8)
    after_a = torch.rand(4)
    torch.manual_seed(4)
    b = flash_attention(q, k, v, is_causal=True, precision="paper", block_q=8, block_k=8, dropout_p=0.0)
    after_b = torch.rand(4)
    assert torch.equal(a, b) and torch.equal(after_a, after_b)   # and the generator is where it was


def test_dropout_one_drops_everything():
    q, k, v = _qkv((1, 2, 5, 4))
    o = flash_attention(q, k, v, precision="fp64", dropout_p=1.0)
    assert torch.equal(o, torch.zeros_like(o))
    assert all(torch.equal(g, torch.zeros_like(g)) for g in torch.autograd.grad(o.sum(), (q, k, v)))


def test_bad_dropout_p_is_refused():
    q, k, v = _qkv((1, 1, 4, 4))
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match=f"dropout_p.*{re.escape(repr(bad))}"):
            flash_attention(q, k, v, dropout_p=bad)


def test_expectation_equals_attention_without_dropout_and_sdpa():
    """E[dropout(P) V] = P V. The mean of N independent masks differs from it by a normal error
    whose per-element variance is sum_j P_ij^2 v_j^2 * p / (1 - p) / N (from the reference P):
    every element lies within 5 of its standard errors, and so does SDPA's own dropout mean."""
    B, H, T, p, N = 1, 2, 8, 0.3, 400
    q, k, v = (t.detach() for t in _qkv((B, H, T, 4)))
    ref = reference_attention(q, k, v, is_causal=True)
    probs = reference_attention(q, k, torch.eye(T, dtype=torch.float64).expand(B, H, T, T), is_causal=True)
    se = ((probs.square() @ v.square()) * p / (1 - p) / N).sqrt()
    torch.manual_seed(0)
    ours = sum(flash_attention(q, k, v, is_causal=True, precision="fp64", block_q=4, block_k=4, dropout_p=p)
               for _ in range(N)) / N
    theirs = sum(F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p) for _ in range(N)) / N
    assert ((ours - ref).abs() <= 5 * se + 1e-12).all()
    assert ((theirs - ref).abs() <= 5 * se + 1e-12).all()
    torch.testing.assert_close(ref, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-12, atol=1e-13)


class _DropoutAttention(torch.nn.Module):
    """Calls SDPA the way models do: dropout only in training."""

    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)


def test_override_sdpa_applies_dropout_in_training_only():
    q, k, v = _qkv((1, 2, 12, 8))
    module = _DropoutAttention(0.5)
    with override_sdpa(precision="fp64", block_q=4, block_k=4):
        module.eval()
        plain = flash_attention(q, k, v, is_causal=True, precision="fp64", block_q=4, block_k=4)
        assert torch.equal(module(q, k, v), plain)
        module.train()
        train, seed = _seeded(1, module, q, k, v)
    keep = dropout_keep_mask(seed, 0.5, 1, 2, 12, 12)
    torch.testing.assert_close(train, reference_attention(q, k, v, is_causal=True, dropout_keep=keep, dropout_p=0.5),
                               rtol=1e-12, atol=1e-13)


def test_sdpa_dropin_with_gqa_and_3d_inputs_takes_dropout():
    q, _, _ = _qkv((1, 4, 6, 8))
    _, k, v = _qkv((1, 2, 6, 8), seed=1)
    out, seed = _seeded(2, scaled_dot_product_attention, q, k, v, dropout_p=0.3, is_causal=True, enable_gqa=True,
                        precision="fp64")
    kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    ref = reference_attention(q, kr, vr, is_causal=True, dropout_keep=dropout_keep_mask(seed, 0.3, 1, 4, 6, 6),
                              dropout_p=0.3)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-13)
    q3 = q.detach()[0]   # (4, 6, 8): SDPA's (..., L, E) with one leading dim, reshaped to (4, 1, 6, 8) inside
    out3, seed3 = _seeded(2, scaled_dot_product_attention, q3, q3, q3, dropout_p=0.3, precision="fp64")
    ref3 = reference_attention(q3, q3, q3, dropout_keep=dropout_keep_mask(seed3, 0.3, 4, 1, 6, 6)[:, 0], dropout_p=0.3)
    torch.testing.assert_close(out3, ref3, rtol=1e-12, atol=1e-13)


def test_delta_hook_path_takes_the_same_dropout():
    q, k, v = _qkv((1, 2, 10, 4))
    torch.manual_seed(6)
    a = flash_attention(q, k, v, is_causal=True, precision="fp64", block_q=4, block_k=4, dropout_p=0.3)
    ga = torch.autograd.grad(a.sum(), (q, k, v))
    torch.manual_seed(6)
    b = flash_attention_with_hooks(q, k, v, delta_hook=lambda d, **_: d, is_causal=True, precision="fp64",
                                        block_q=4, block_k=4, dropout_p=0.3)
    gb = torch.autograd.grad(b.sum(), (q, k, v))
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
