"""The probes of a layer that trains through torch's SDPA: they measure the kernel itself (a black
box on the captured inputs, its gradients by autograd) against fp64. Its O, delta and dQ errors
equal the errors computed here independently; it runs the layer's own call bit for bit; a planted
lean is found and an unbiased kernel is not (known answers both ways)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashguard import keys
from flashguard.diagnostics import LayerCapture, probe_layer, shadow
from flashguard.diagnostics.across_probes import lean_across_probes
from flashguard.diagnostics.capture import capture_batch
from flashguard.diagnostics.probes import KERNEL_DELTA_SOURCE, KERNEL_LABEL
from flashguard.model import GPT, AttentionSpec, model_config

# what the probes write for an SDPA layer (per layer L0), and what they leave out (the kernel's tiles)
WRITTEN = (keys.O_ERR_BIAS, keys.O_ERR_ABS, keys.O_ERR_BIAS_ABSMAX, keys.O_ERR_BIAS_VSIGN, keys.O_ERR_Z,
           keys.DELTA_ERR_MEAN, keys.DELTA_ERR_ABS, keys.DELTA_ERR_REL, keys.DELTA_ERR_POS_FRAC,
           keys.DELTA_ERR_CUMSUM, keys.DELTA_ERR_Z, keys.O_ERR_Z_ROW, keys.O_ERR_RATIO_ROW, keys.DELTA_ERR_Z_ROW,
           keys.DELTA_ERR_RATIO_ROW, keys.DELTA_FROM_O_MEAN, keys.DELTA_FROM_O_Z, keys.DELTA_OWN_MEAN,
           keys.DELTA_OWN_Z, keys.WQ_ERR_NORM, keys.WQ_ERR_REL, keys.WQ_ERR_RANK1_FRAC, *keys.WQ_ERR_SV)
LEFT_OUT = (keys.TIE_RATE, keys.PBAR_ONE, keys.PBAR_ONE_MULTI, keys.EXACT_TIE_RATE, keys.TIE_AT_SINK,
            keys.TIE_AT_SINK_CHANCE, keys.V_SIGN_AGREE, keys.TIED_ROW_FRAC, keys.DELTA_FROM_O_TIED,
            keys.DELTA_OWN_TIED)


def _inputs(seed=0, B=2, H=2, T=16, D=8, C=12):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(4))
    x = torch.randn(B, T, C, generator=g)
    w_q = torch.randn(H, D, C, generator=g)
    return q, k, v, do, x, w_q


def _sdpa_cap(q, k, v, do, **kw):
    return LayerCapture(layer=0, q=q, k=k, v=v, do=do, spec=AttentionSpec(backend="sdpa"), backend="sdpa",
                        causal=True, **kw)


def _fp64_attention(q, k, v):
    """Causal softmax(q k^T / sqrt(D)) v in fp64, written out (not flashguard's reference)."""
    q, k, v = (t.double() for t in (q, k, v))
    T = q.shape[-2]
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def test_the_sdpa_probe_writes_the_numerics_keys_and_leaves_the_tile_keys_out():
    q, k, v, do, x, w_q = _inputs()
    m = probe_layer(_sdpa_cap(q, k, v, do, x=x, w_q=w_q))
    for metric in WRITTEN:
        assert metric.key(0) in m, metric
    assert not any(metric.key(0) in m or (metric.per_head and metric.key(0, 0) in m) for metric in LEFT_OUT
                   if metric.per_layer)
    assert all(keys.metric(key) is not None for key in m)   # every key in the schema


def test_the_sdpa_probe_errors_are_the_kernels_own_against_fp64():
    q, k, v, do, x, w_q = _inputs()
    m = probe_layer(_sdpa_cap(q, k, v, do, x=x, w_q=w_q))
    # the kernel, run here as the model runs it, and fp64 on the same bf16 inputs
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    o = F.scaled_dot_product_attention(*leaves, is_causal=True)
    (dq,) = torch.autograd.grad(o, leaves[:1], do)
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ref = _fp64_attention(*ref_leaves)
    (dq_ref,) = torch.autograd.grad(ref, ref_leaves[:1], do.double())
    err = o.detach().double() - ref.detach()
    assert m[keys.O_ERR_BIAS.key(0)] == pytest.approx(float(err.mean()), rel=1e-9, abs=1e-15)
    assert m[keys.O_ERR_ABS.key(0)] == pytest.approx(float(err.abs().mean()), rel=1e-9)
    assert m[keys.O_ERR_BIAS_ABSMAX.key(0)] == pytest.approx(float(err.mean(dim=(0, 2)).abs().max()), rel=1e-9)
    # delta from the kernel's O, product and sum in fp32; fp64's from fp64 O
    d_err = (do.float() * o.detach().float()).sum(-1).double() - (do.double() * ref.detach()).sum(-1)
    assert m[keys.DELTA_ERR_MEAN.key(0)] == pytest.approx(float(d_err.mean()), rel=1e-6, abs=1e-15)
    assert m[keys.DELTA_ERR_ABS.key(0)] == pytest.approx(float(d_err.abs().mean()), rel=1e-6)
    # the W_Q gradient error from the kernel's dQ
    e = torch.einsum("bhtd,btc->hdc", dq.double() - dq_ref, x.double())
    assert m[keys.WQ_ERR_NORM.key(0)] == pytest.approx(float(e.norm()), rel=1e-9)
    assert float(err.abs().max()) > 0 and float(e.norm()) > 0   # a real error, not a zero compared with zero


def test_the_probe_runs_the_layers_own_sdpa_call_bit_for_bit():
    torch.manual_seed(0)
    model = GPT(model_config("micro"), AttentionSpec(backend="sdpa"))
    seen = {}
    attn = model.transformer.h[1].attn
    original = attn.attend

    def recording(q, k, v):
        y = original(q, k, v)
        seen.setdefault("y", y.detach())
        return y
    attn.attend = recording
    x = torch.randint(0, 256, (2, 32))
    caps, _ = capture_batch(model, x, x, [1])   # bf16 autocast, as the trainer
    cap = caps[1]
    assert cap.backend == "sdpa" and cap.q.dtype == torch.bfloat16 and cap.do is not None
    sh = shadow(cap)
    assert (sh.kernel, sh.delta_source, sh.policy, sh.arithmetic) == (KERNEL_LABEL, KERNEL_DELTA_SOURCE, None, None)
    assert torch.equal(sh.trace.o, seen["y"].double())   # the kernel's O is the layer's O, bit for bit
    assert sh.trace.ties is None and sh.trace.dq is not None
    details: dict = {}
    probe_layer(cap, details=details)
    assert (details["measured"], details["delta_source"]) == (KERNEL_LABEL, "kernel O")
    with pytest.raises(ValueError, match="attends causally"):
        shadow(LayerCapture(layer=1, q=cap.q, k=cap.k, v=cap.v, spec=cap.spec, backend="sdpa", causal=False))


# ---------------------------------------------------------------- known answers: a planted lean, none

def _planted(lean: bool):
    """An SDPA stand-in: the attention in fp32, O rounded to bf16 to nearest (no lean), or after a
    push of a quarter bf16 ulp upwards (``lean``: O's error positive, so delta's with dO > 0)."""
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        assert is_causal and scale is None and attn_mask is None and dropout_p == 0.0   # the model's call
        o = real(q.float(), k.float(), v.float(), is_causal=True)
        if lean:
            o = o + o.abs() * 2.0 ** -9
        return o.to(q.dtype)
    return sdpa


@pytest.mark.parametrize("lean,verdict", [(True, "leans +"), (False, "no lean")])
def test_a_planted_lean_is_found_and_an_unbiased_kernel_is_not(monkeypatch, lean, verdict):
    monkeypatch.setattr(F, "scaled_dot_product_attention", _planted(lean))   # what the layer's call runs
    records = []
    for step in range(4):
        q, k, v, do, _, _ = _inputs(seed=step, B=4, H=4, T=32, D=16)
        records.append({keys.STEP: step, **probe_layer(_sdpa_cap(q, k, v, do.abs()), grad=False)})
    for what in ("O", "delta"):
        s = lean_across_probes(records, what)[0]
        assert s.verdict == verdict, (what, s)
        assert (min(s.zs) > 3.29) if lean else (abs(s.stouffer_z) < 3.29)
