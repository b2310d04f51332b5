"""The O injection point (issue 23: the lean of O removed at the same size) and rule exact:
`real` at alpha = 1 returns the arithmetic's O bit for bit; `zero-mean` keeps |e| and removes the
lean - the injected O is unbiased given e's sign, which rounding to nearest would not give; the
backward's delta reads the injected O; `exact` gives delta_ref; bad combinations are refused."""
from __future__ import annotations

import pytest
import torch

from flashguard.attention import flash_attention
from flashguard.attention.function import flash_attention_with_hooks
from flashguard.attention.injection import DeltaHook, ErrorInjection, OutputHook, make_hook
from flashguard.numerics.formats import round_to
from flashguard.train import ConfigError, build_model, load_config
from flashguard.train.injection import install_injection

from run_helpers import ROOT

MICRO = ROOT / "configs" / "micro.toml"


def _qkv(B=2, H=2, T=128, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(4))


def _run(hook=None, delta_hook=None, seed=0, precision="paper"):
    q, k, v, do = _qkv(seed=seed)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    if hook is None and delta_hook is None:
        o = flash_attention(q, k, v, is_causal=True, precision=precision, block_q=64, block_k=64)
    else:
        o = flash_attention_with_hooks(q, k, v, output_hook=hook, delta_hook=delta_hook, is_causal=True,
                                       precision=precision, block_q=64, block_k=64)
    o.backward(do)
    return o.detach(), q.grad


def test_real_alpha_1_at_o_is_the_arithmetic_exactly():
    plain = _run()
    seen = []
    same = _run(OutputHook(ErrorInjection(1.0, "real", point="o"), observer=lambda **r: seen.append(r)))
    assert torch.equal(plain[0], same[0]) and torch.equal(plain[1], same[1])
    assert len(seen) == 1 and seen[0]["e"].abs().max() > 0  # paper's O does carry an error
    louder = _run(OutputHook(ErrorInjection(4.0, "real", point="o")))
    assert not torch.equal(plain[0], louder[0])


def test_zero_mean_at_o_keeps_the_size_and_removes_the_lean_given_the_sign():
    """Over many rows: conditioned on e's sign, the injected error's mean is ~0 for zero-mean (a
    lean of +-1 would be the real rule's), and its rms is |e|'s within the stochastic rounding's
    addition (between 1 and 1.5 x); rounding the flipped O to nearest instead keeps most of it."""
    seen = []
    for seed in range(3):
        _run(OutputHook(ErrorInjection(1.0, "zero-mean", point="o", seed=seed), observer=lambda **r: seen.append(r)),
             seed=seed)
    e = torch.cat([r["e"].flatten() for r in seen])
    got = torch.cat([(r["injected"] - r["o_ref"]).flatten() for r in seen])
    big = e.abs() > 0
    for sign in (1, -1):
        sel = big & (torch.sign(e) == sign)
        lean = got[sel].mean() / e[sel].abs().mean()
        assert abs(lean) < 0.05, lean  # real: exactly sign * 1
    ratio = (got.pow(2).mean() / e.pow(2).mean()).sqrt()
    assert 1.0 <= ratio < 1.5


def test_stochastic_rounding_is_why_a_flipped_small_error_stays_flipped():
    """e below a quarter of an ulp (O correctly rounded, near its grid point): the flipped value
    rounded to nearest snaps back to that grid point (e's sign, and a lean, survive), rounded
    stochastically it carries -e on average (the injection's choice). Over uniform offsets the
    two agree on the mean; what nearest gets wrong is the error's dependence on its size."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(400_000, generator=g, dtype=torch.float64)
    lp = ref.to(torch.float32).to(torch.bfloat16).to(torch.float64)
    e = lp - ref
    ulp = torch.exp2(torch.floor(torch.log2(ref.abs())) - 7)  # bf16: 8 significant bits
    flipped = ref - e
    nearest = flipped.to(torch.float32).to(torch.bfloat16).to(torch.float64) - ref
    stochastic = round_to(flipped, "bf16", "stochastic", generator=g).to(torch.float64) - ref
    small = (e > 0) & (e < ulp / 4)
    assert torch.equal(nearest[small], e[small])                          # not flipped at all
    assert abs(stochastic[small].mean() / e[small].mean() + 1) < 0.03     # -e on average


def test_the_backward_reads_the_injected_o():
    """delta = rowsum(dO * O): with O replaced, dQ changes though the forward's inputs did not."""
    plain = _run()
    o, dq = _run(OutputHook(ErrorInjection(1.0, "zero-mean", point="o", seed=3)))
    assert not torch.equal(plain[0], o) and not torch.equal(plain[1], dq)


def test_exact_delta_is_the_reference_and_exact_is_refused_elsewhere():
    seen = []
    _run(delta_hook=DeltaHook(ErrorInjection(rule="exact"), observer=lambda **r: seen.append(r)))
    assert torch.equal(seen[0]["injected"], seen[0]["delta_ref"]) and seen[0]["e"].abs().max() > 0
    with pytest.raises(ValueError, match="point delta only"):
        ErrorInjection(rule="exact", point="o")
    with pytest.raises(ValueError, match="injects none"):
        ErrorInjection(rule="exact", alpha=2.0)
    with pytest.raises(ValueError, match="point must be"):
        ErrorInjection(point="p")
    with pytest.raises(ValueError, match="OutputHook"):
        DeltaHook(ErrorInjection(point="o"))
    with pytest.raises(ValueError, match="DeltaHook"):
        OutputHook(ErrorInjection())
    with pytest.raises(TypeError, match="delta_hook.*output_hook"):
        flash_attention_with_hooks(*_qkv()[:3])


def test_the_config_puts_an_o_hook_on_every_flash_layer():
    cfg = load_config(MICRO, ['injection.rule="zero-mean"', 'injection.point="o"'])
    model = build_model(cfg)
    install_injection(model, cfg)
    assert all(s.output_hook is not None and s.delta_hook is None for s in model.attention_specs)
    assert make_hook(ErrorInjection(point="o"), 0, None)[0] == "output_hook"
    with pytest.raises(ConfigError, match="injection.point"):
        load_config(MICRO, ['injection.rule="real"', 'injection.point="q"'])
    with pytest.raises(ConfigError, match=r"injection\.point.*injection\.rule\W+none"):
        load_config(MICRO, ['injection.point="o"'])
