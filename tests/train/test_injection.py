"""The delta error injection (flashguard.attention.injection, the [injection] config, the trainer):
`real` at alpha = 1 is bit-identical to no injection, every sign rule gives its stated signs and
magnitudes, the injected delta reaches dS, the draws come from the injection's own generator
(global RNG untouched, resume bit-identical), and bad options are refused by name."""
from __future__ import annotations

import math

import pytest
import torch

from flashguard.attention import flash_attention, reference_attention
from flashguard.attention.function import flash_attention_with_hooks
from flashguard.attention.injection import (DeltaHook, ErrorInjection, InjectionClock, inject, injection_generator,
                                            sign_rule)
from flashguard.model import AttentionSpec
from flashguard.train import ConfigError, JsonlLog, build_model, list_checkpoints, load_checkpoint, load_config, train
from flashguard.train.config import config_to_toml
from flashguard.train.injection import InjectionHook, install_injection

from run_helpers import ROOT, interrupted, micro_overrides
from test_loss_hash import RECORDED_PLATFORM, _platform

MICRO = ROOT / "configs" / "micro.toml"


def _qkv(B=4, H=4, T=256, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).to(torch.bfloat16) for _ in range(4))
    return q, k, v, do


def _backward(q, k, v, do, precision="paper", hook=None):
    """(dq, dk, dv) of causal flash attention, with ``hook`` as its delta hook (None: none)."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    if hook is None:
        o = flash_attention(q, k, v, is_causal=True, precision=precision, block_q=64, block_k=64)
    else:
        o = flash_attention_with_hooks(q, k, v, delta_hook=hook, is_causal=True, precision=precision,
                                            block_q=64, block_k=64)
    o.backward(do)
    return q.grad, k.grad, v.grad


def _injected(injection, precision="paper", seed=0):
    """One hooked backward; the observer's record (fp64 delta_lp, delta_ref, e, injected)."""
    seen = []
    _backward(*_qkv(seed=seed), precision=precision, hook=DeltaHook(injection, observer=lambda **r: seen.append(r)))
    assert len(seen) == 1
    return seen[0]


# ---- the rules -------------------------------------------------------------------------------

def test_real_at_alpha_1_is_the_arithmetic_exactly_and_other_rules_change_it():
    q, k, v, do = _qkv()
    plain = _backward(q, k, v, do)
    grads = _backward(q, k, v, do, hook=DeltaHook(ErrorInjection(1.0, "real")))
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    louder = _backward(q, k, v, do, hook=DeltaHook(ErrorInjection(3.0, "real")))
    assert not torch.equal(plain[0], louder[0]) and torch.equal(plain[2], louder[2])  # dV does not use delta


@pytest.mark.parametrize("rule,p", [("coherent", 0.6), ("coherent", 0.75), ("coherent", 1.0), ("coherent", 0.0),
                                    ("zero-mean", None)])
def test_sign_rules_have_their_sign_rate_and_magnitude_alpha_e(rule, p):
    alpha = 3.0
    r = _injected(ErrorInjection(alpha, rule, p, seed=5))
    e, injected, ref = r["e"].flatten(), r["injected"].flatten(), r["delta_ref"].flatten()
    tol = 1e-12 * float(ref.abs().max())
    err = injected - ref
    assert torch.allclose(err.abs(), alpha * e.abs(), rtol=1e-12, atol=tol)  # |injected - delta_ref| == alpha |e|
    nz = e != 0
    n = int(nz.sum())
    assert n > 3000  # bf16 errors: nearly every row has one
    frac = float((err[nz] > 0).double().mean())
    want = 0.5 if rule == "zero-mean" else p
    assert abs(frac - want) <= 4.5 * math.sqrt(want * (1 - want) / n) + 1e-12, (frac, want, n)


def test_shuffled_is_a_permutation_of_e_across_rows():
    alpha = 10.0
    r = _injected(ErrorInjection(alpha, "shuffled", seed=2))
    e, shuffled = r["e"].flatten(), ((r["injected"] - r["delta_ref"]) / alpha).flatten()
    tol = 1e-12 * float(r["delta_ref"].abs().max())
    assert torch.allclose(shuffled.sort().values, e.sort().values, rtol=1e-12, atol=tol)
    assert not torch.allclose(shuffled, e, atol=tol)  # moved
    # the rule itself: exactly the same multiset, so the same sum of |e|
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 4, 256, 1, generator=g, dtype=torch.float64)
    y = sign_rule(x, ErrorInjection(alpha, "shuffled"), torch.Generator().manual_seed(1))
    assert torch.equal(y.flatten().sort().values, x.flatten().sort().values)
    assert y.abs().flatten().sort().values.sum() == x.abs().flatten().sort().values.sum()


def test_coherent_rule_on_many_values_and_zero_mean_is_coherent_at_one_half():
    e = torch.randn(200_000, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for p in (0.5, 0.6, 0.75):
        y = sign_rule(e, ErrorInjection(1.0, "coherent", p), torch.Generator().manual_seed(4))
        assert torch.equal(y.abs(), e.abs())
        assert abs(float((y > 0).double().mean()) - p) <= 4.5 * math.sqrt(p * (1 - p) / e.numel())
    zm = sign_rule(e, ErrorInjection(1.0, "zero-mean"), torch.Generator().manual_seed(4))
    half = sign_rule(e, ErrorInjection(1.0, "coherent", 0.5), torch.Generator().manual_seed(4))
    assert torch.equal(zm, half)
    new, err = inject(e + 1.0, torch.ones_like(e), ErrorInjection(2.0, "real"), None)
    assert torch.allclose(new, 1.0 + 2.0 * err, rtol=0, atol=1e-15)


def test_the_injected_delta_reaches_ds():
    """fp32 arithmetic, real rule at a large alpha: the gradients move by exactly what a delta
    shifted by (alpha - 1) e per row gives, dS = P (dP - delta) -> dQ - = scale (P * shift) K."""
    q, k, v, do = (t.float() for t in _qkv(B=2, H=2, T=128))
    alpha = 1e5
    seen = []
    plain = _backward(q, k, v, do, precision="fp32")
    moved = _backward(q, k, v, do, precision="fp32",
                      hook=DeltaHook(ErrorInjection(alpha, "real"), observer=lambda **r: seen.append(r)))
    shift = (alpha - 1) * seen[0]["e"]                                         # (B, H, T, 1)
    scale = 1 / math.sqrt(q.shape[-1])
    s = (q.double() @ k.double().transpose(-2, -1)) * scale
    p = torch.softmax(s.masked_fill(~torch.ones(128, 128, dtype=torch.bool).tril(), float("-inf")), dim=-1)
    ds_change = -p * shift * scale
    for got, want in ((moved[0] - plain[0], ds_change @ k.double()),
                      (moved[1] - plain[1], ds_change.transpose(-2, -1) @ q.double())):
        assert float(want.abs().max()) > 1e-3
        assert torch.allclose(got.double(), want, atol=1e-3 * float(want.abs().max()), rtol=0)
    # and delta_ref is rowsum(dO * O_ref) of the one reference attention
    o_ref = reference_attention(q, k, v, is_causal=True)
    assert torch.allclose(seen[0]["delta_ref"], (do.double() * o_ref).sum(-1, keepdim=True), rtol=1e-12, atol=1e-12)


def test_an_fp32_reference_gives_the_paper_arithmetics_e_to_a_thousandth():
    """Why the experiment's presets may use injection.reference = fp32 for bf16 arithmetic."""
    e64, e32 = (_injected(ErrorInjection(1.0, "real", reference=r))["e"] for r in ("fp64", "fp32"))
    assert float((e32 - e64).abs().max()) <= 1e-3 * float(e64.abs().mean())
    assert torch.equal(e32 > 0, e64 > 0)


# ---- randomness ------------------------------------------------------------------------------

def test_draws_come_from_the_injections_own_generator():
    a = torch.rand(8, generator=injection_generator(1, 2, 0, 1))
    assert torch.equal(a, torch.rand(8, generator=injection_generator(1, 2, 0, 1)))
    for other in ((2, 2, 0, 1), (1, 3, 0, 1), (1, 2, 1, 1), (1, 2, 0, 0), (1, 2, 0, 1, 1)):
        assert not torch.equal(a, torch.rand(8, generator=injection_generator(*other)))
    clock = InjectionClock()
    clock.begin_step(7)
    assert [clock.next_call(0), clock.next_call(0), clock.next_call(1)] == [(7, 0), (7, 1), (7, 0)]
    clock.begin_step(8)
    assert clock.next_call(0) == (8, 0)
    before = torch.get_rng_state()
    _injected(ErrorInjection(3.0, "zero-mean"))
    _injected(ErrorInjection(3.0, "shuffled"))
    assert torch.equal(before, torch.get_rng_state())  # the global generator is not touched
    # the same call draws the same signs; another step other signs
    h = [DeltaHook(ErrorInjection(3.0, "zero-mean", seed=1), layer=0, observer=lambda **r: seen.append(r))
         for _ in range(2)]
    seen = []
    for hook, step in zip(h + h[:1], (4, 4, 5)):
        hook.clock.begin_step(step)
        _backward(*_qkv(B=1, H=2, T=64), hook=hook)
    assert torch.equal(seen[0]["injected"], seen[1]["injected"]) and not torch.equal(seen[0]["injected"],
                                                                                      seen[2]["injected"])


# ---- the model and the trainer ---------------------------------------------------------------

def _micro_steps(cfg, n=3, hook_observer=None):
    """n AdamW steps of the micro model under bf16 autocast on fixed batches: losses and every
    step's gradients."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg)
    clock = install_injection(model, cfg, observer=hook_observer)
    opt = model.configure_optimizer(weight_decay=0.0, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses, grads = [], []
    for step in range(n):
        if clock is not None:
            clock.begin_step(step)
        x = torch.randint(0, 256, (4, 64), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, torch.roll(x, -1, 1))
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def test_real_alpha_1_micro_training_steps_are_bit_identical_to_none():
    base = load_config(MICRO, ["data.dir=/unused"])
    calls = []
    real = load_config(MICRO, ["data.dir=/unused", 'injection.rule="real"', "injection.alpha=1.0"])
    (l0, g0), (l1, g1) = _micro_steps(base), _micro_steps(real, hook_observer=lambda **r: calls.append(r["layer"]))
    assert sorted(set(calls)) == [0, 1] and len(calls) == 6  # both flash layers, every step
    assert all(torch.equal(a, b) for a, b in zip(l0, l1))
    assert all(torch.equal(a, b) for s0, s1 in zip(g0, g1) for a, b in zip(s0, s1))
    l3, g3 = _micro_steps(load_config(MICRO, ["data.dir=/unused", 'injection.rule="real"', "injection.alpha=30.0",
                                              "injection.layers=[1]"]))
    assert torch.equal(l3[0], l0[0])  # the first forward is the same; its backward is not
    assert not torch.equal(g3[0][0], g0[0][0])


def _losses(run):
    return {r["step"]: (r["loss/train"], r["grad/norm"]) for r in JsonlLog.read(run / "metrics.jsonl")}


def test_training_with_injection_is_saved_matched_and_resumes_bit_for_bit(tiny_data, tmp_path, monkeypatch):
    inj = ['injection.rule="coherent"', "injection.p=0.75", "injection.alpha=30.0"]
    none, real, full, crashed = (tmp_path / n for n in ("none", "real", "full", "crashed"))
    train(load_config(MICRO, micro_overrides(tiny_data)), none)
    train(load_config(MICRO, micro_overrides(tiny_data) + ['injection.rule="real"']), real, hooks=[InjectionHook()])
    assert _losses(real) == _losses(none)  # exact: losses and gradient norms
    a, b = (load_checkpoint(list_checkpoints(r)[-1][1])["model"] for r in (none, real))
    assert all(torch.equal(a[k], b[k]) for k in a)
    cfg = load_config(MICRO, micro_overrides(tiny_data) + inj)
    train(cfg, full, hooks=[InjectionHook()])
    saved = load_config(full / "config.toml")
    assert saved.injection == cfg.injection and saved.injection.p == 0.75 and "[injection]" in config_to_toml(cfg)
    assert _losses(full) != _losses(none)
    assert JsonlLog.read(full / "batches.jsonl") == JsonlLog.read(none / "batches.jsonl")  # same batches
    interrupted(monkeypatch, 4, lambda: train(cfg, crashed, hooks=[InjectionHook()]))
    train(cfg, crashed, resume=True, hooks=[InjectionHook()])
    assert _losses(crashed) == _losses(full)


# (loss, grad norm) per step of micro_overrides' run with INJECTED, recorded at one thread on
# RECORDED_PLATFORM (tests/train/test_loss_hash.py) by the loop that still installed the injection
# itself, before InjectionHook became a hook the caller passes: the hook must train the same bits.
INJECTED = ['injection.rule="coherent"', "injection.p=0.75", "injection.alpha=30.0"]
RECORDED_INJECTED = {0: (5.530303001403809, 1.9963034391403198), 1: (5.370121955871582, 2.0910873413085938),
                     2: (5.121511936187744, 2.0479114055633545), 3: (4.992992877960205, 2.027270555496216),
                     4: (4.916872978210449, 1.8809807300567627), 5: (4.852157115936279, 1.9298450946807861)}


def test_an_injection_run_needs_its_hook_and_with_it_trains_as_recorded(tiny_data, tmp_path, one_thread):
    cfg = load_config(MICRO, micro_overrides(tiny_data) + INJECTED)
    with pytest.raises(ConfigError, match=r'^injection\.rule = "coherent" needs the hook '
                                          r'flashguard\.train\.injection\.InjectionHook\b'):
        train(cfg, tmp_path / "nohook")
    assert not (tmp_path / "nohook").exists()
    hook = InjectionHook()
    train(cfg, tmp_path / "hooked", hooks=[hook])
    assert hook.clock is not None and hook.clock.step == 5
    got = _losses(tmp_path / "hooked")
    assert got != _losses(_plain_run(tiny_data, tmp_path))
    here = (torch.__version__, _platform())
    if here != RECORDED_PLATFORM:
        pytest.skip(f"losses recorded on {RECORDED_PLATFORM}, this is {here} (its kernels round differently)")
    assert got == RECORDED_INJECTED  # exact floats


def _plain_run(tiny_data, tmp_path):
    train(load_config(MICRO, micro_overrides(tiny_data)), tmp_path / "plain")
    return tmp_path / "plain"


def test_the_injection_hook_without_a_rule_leaves_the_model_alone(tiny_data, tmp_path):
    cfg = load_config(MICRO, micro_overrides(tiny_data))
    model, hook = build_model(cfg), InjectionHook()
    before = list(model.attention_specs)
    hook.attach(model, cfg, 0)
    hook.step_begin(0, model)
    assert hook.clock is None and list(model.attention_specs) == before
    assert set(InjectionHook.config_keys) == {f"injection.{k}" for k in ("rule", "alpha", "p", "layers", "seed",
                                                                          "reference", "point")}


# ---- bad options -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,msg", [
    (dict(alpha=0.0), "alpha"), (dict(alpha=float("nan")), "alpha"), (dict(alpha=True), "alpha"),
    (dict(rule="sorted"), "rule"), (dict(rule="coherent"), "p must"), (dict(rule="coherent", p=1.5), "p must"),
    (dict(rule="real", p=0.5), "p applies"), (dict(seed=-1), "seed"), (dict(seed=1.5), "seed"),
    (dict(reference="fp16"), "reference"),
])
def test_bad_injection_options_are_refused(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        ErrorInjection(**kwargs)


@pytest.mark.parametrize("override,msg", [
    ('injection.rule="sorted"', "injection.rule"),
    ("injection.alpha=3.0", r"^injection\.alpha.*injection\.rule\W+none"),   # the key set, the rule that is off
    ('injection.rule="coherent"', "injection.p"),
    ('injection.rule="real";injection.alpha=-1.0', "injection.alpha"),
    ('injection.rule="real";injection.p=0.5', "injection.p"),
    ('injection.rule="real";injection.layers=[1, 1]', "injection.layers"),
    ('injection.rule="real";injection.layers=["1"]', "injection.layers"),
    ('injection.rule="real";injection.reference="bf16"', "injection.reference"),
    ('injection.rule="real";injection.seed=-3', "injection.seed"),
    ("injection.colour=1", r"injection\.colour"),
    ('injection.alpha="big"', r"^injection\.alpha.*\bfloat\b"),
])
def test_bad_injection_config_names_the_key(override, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(MICRO, override.split(";"))


def test_injection_goes_into_flash_layers_only():
    cfg = load_config(MICRO, ['injection.rule="real"', "attention.layers.0.backend=sdpa"])
    model = build_model(cfg)
    install_injection(model, cfg)
    assert [s.delta_hook is not None for s in model.attention_specs] == [False, True]  # every flash layer
    for layers, msg in (("[0]", "layer 0 runs the sdpa backend"), ("[5]", "layer 5 does not exist")):
        bad = load_config(MICRO, ['injection.rule="real"', "attention.layers.0.backend=sdpa",
                                  f"injection.layers={layers}"])
        with pytest.raises(ConfigError, match=msg):
            install_injection(build_model(bad), bad)
    triton = load_config(MICRO, ['injection.rule="real"', "attention.precision=fa2", "attention.layers.1.kernel=triton"])
    with pytest.raises(ConfigError, match=r"\b1\b.*attention\.kernel\W+triton"):
        install_injection(build_model(triton), triton)
    with pytest.raises(ValueError, match="flash backend only"):
        AttentionSpec(backend="sdpa", delta_hook=lambda d, **kw: d)
    with pytest.raises(TypeError, match="delta_hook.*int"):
        flash_attention_with_hooks(*_qkv(B=1, H=1, T=8)[:3], delta_hook=3)
