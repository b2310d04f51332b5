"""GPT model: shapes, weights, backends, loss terms, diagnostics access."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from flashguard.attention import reference_attention
from flashguard.model import GPT, AttentionSpec, GPTConfig, MODEL_PRESETS, SpecError, layer_specs, model_config
from flashguard.model import attention as attention_module

MICRO = model_config("micro")


def batch(cfg=MICRO, B=3, T=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = T or cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    tgt = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return idx, tgt


def make(cfg=MICRO, attention=AttentionSpec(), seed=0):
    torch.manual_seed(seed)
    return GPT(cfg, attention)


# ---- shapes and weights -------------------------------------------------------------------

def test_shapes_and_loss():
    model = make()
    idx, tgt = batch(T=40)
    logits, loss = model(idx, tgt)
    assert logits.shape == (3, 40, MICRO.vocab_size)
    assert loss.shape == () and torch.isfinite(loss)
    assert abs(loss.item() - math.log(MICRO.vocab_size)) < 0.3  # near-uniform at init
    assert torch.equal(model.last_ce, loss.detach()) and model.last_z.item() == 0.0
    assert not model.last_ce.requires_grad
    logits, loss = model(idx)
    assert logits.shape == (3, 1, MICRO.vocab_size) and loss is None
    full, _ = model(idx, tgt)
    torch.testing.assert_close(logits[:, 0], full[:, -1])


def test_ignore_index():
    model = make()
    idx, tgt = batch()
    tgt[:, :10] = -1
    logits, loss = model(idx, tgt)
    expected = F.cross_entropy(logits[:, 10:].reshape(-1, MICRO.vocab_size), tgt[:, 10:].reshape(-1))
    torch.testing.assert_close(loss, expected)


def test_too_long_input():
    model = make()
    idx = torch.zeros(1, MICRO.block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"65.*block_size 64"):
        model(idx)


def test_tied_weights():
    model = make()
    assert model.lm_head.weight is model.transformer.wte.weight
    idx, tgt = batch()
    model(idx, tgt)[1].backward()
    assert model.transformer.wte.weight.grad is model.lm_head.weight.grad
    # one tensor in the optimizer and in the count
    assert sum(p is model.lm_head.weight for p in model.parameters()) == 1


def test_init_statistics():
    cfg = model_config("tiny-cpu")
    model = make(cfg)
    blk = model.transformer.h[0]
    assert abs(blk.attn.c_attn.weight.std().item() - 0.02) < 0.002
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.002
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    for w in (blk.attn.c_proj.weight, blk.mlp.c_proj.weight):
        assert abs(w.std().item() - resid) < 0.1 * resid
    assert abs(blk.mlp.c_fc.weight.std().item() - 0.02) < 0.002
    assert torch.equal(blk.ln_1.weight, torch.ones(cfg.n_embd)) and blk.ln_1.bias is None
    biased = make(dataclasses.replace(MICRO, bias=True))
    assert all(torch.count_nonzero(m.bias) == 0 for m in biased.modules()
               if isinstance(m, torch.nn.Linear) and m.bias is not None)


def expected_params(cfg: GPTConfig, non_embedding: bool) -> int:
    C, L = cfg.n_embd, cfg.n_layer
    b = int(cfg.bias)
    attn = C * 3 * C + b * 3 * C + C * C + b * C
    mlp = C * 4 * C + b * 4 * C + 4 * C * C + b * C
    ln = C * (1 + b)
    qk = 2 * cfg.head_dim * (1 + b) if cfg.qk_layernorm else 0
    n = L * (attn + mlp + 2 * ln + qk) + ln  # + final LayerNorm
    if not non_embedding:
        n += cfg.vocab_size * C + cfg.block_size * C  # lm_head tied to wte
    return n


@pytest.mark.parametrize("preset", list(MODEL_PRESETS))
@pytest.mark.parametrize("variant", [{}, {"bias": True}, {"qk_layernorm": True}])
def test_param_counts(preset, variant):
    cfg = model_config(preset, **variant)
    with torch.device("meta"):
        model = GPT(cfg)
    assert model.num_params(non_embedding=True) == expected_params(cfg, True)
    assert model.num_params(non_embedding=False) == expected_params(cfg, False)


def test_gpt2_124m_exact_counts():
    with torch.device("meta"):
        model = GPT(model_config("gpt2-124m"))
    assert model.num_params() == 84_953_856 == 12 * (12 * 768**2 + 2 * 768) + 768  # ~85M
    assert model.num_params(non_embedding=False) == 124_373_760


def test_configure_optimizer_groups():
    model = make(dataclasses.replace(MICRO, bias=True, qk_layernorm=True))
    opt = model.configure_optimizer(weight_decay=0.1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    assert isinstance(opt, torch.optim.AdamW)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    # wte (tied lm_head) + wpe + 4 matrices per layer
    assert len(decay["params"]) == 2 + 4 * MICRO.n_layer
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == model.num_params(False)
    assert opt.defaults["lr"] == 1e-3 and opt.defaults["betas"] == (0.9, 0.95)


# ---- attention backends -------------------------------------------------------------------

BACKEND_SPECS = {
    "sdpa": AttentionSpec("sdpa"),
    "flash-fp32": AttentionSpec("flash", precision="fp32"),
    "flash-fp32-tiled": AttentionSpec("flash", precision="fp32", block_q=16, block_k=32),
    "math": AttentionSpec("math"),
}


def run_with(spec, cfg=MICRO):
    model = make(cfg, spec)
    idx, tgt = batch(cfg)
    logits, loss = model(idx, tgt)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


@pytest.mark.parametrize("qk_layernorm", [False, True])
def test_backends_agree_in_fp32(qk_layernorm):
    cfg = dataclasses.replace(MICRO, qk_layernorm=qk_layernorm)
    base_logits, base_loss, base_grads = run_with(BACKEND_SPECS["sdpa"], cfg)
    for name, spec in BACKEND_SPECS.items():
        logits, loss, grads = run_with(spec, cfg)
        torch.testing.assert_close(logits, base_logits, rtol=0, atol=1e-5, msg=name)
        torch.testing.assert_close(loss, base_loss, rtol=0, atol=1e-5, msg=name)
        for n in base_grads:
            torch.testing.assert_close(grads[n], base_grads[n], rtol=1e-3, atol=1e-6, msg=f"{name} {n}")


def test_flash_paper_under_bf16_autocast():
    model = make(attention=AttentionSpec("flash", precision="paper", stabilizer="paper"))
    idx, tgt = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, tgt)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    assert torch.isfinite(loss)
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    _, fp32_loss, _ = run_with(AttentionSpec("sdpa"))
    assert abs(loss.item() - fp32_loss.item()) < 0.05


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_other_backends_under_bf16_autocast(backend):
    model = make(dataclasses.replace(MICRO, qk_layernorm=True), AttentionSpec(backend))
    idx, tgt = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, tgt)
    loss.backward()
    assert torch.isfinite(loss)


def test_math_backend_is_fp32_math_under_autocast(monkeypatch):
    seen = []

    def spy(q, k, v, **kw):
        seen.append((torch.is_autocast_enabled("cpu"), kw["dtype"]))
        return reference_attention(q, k, v, **kw)

    monkeypatch.setattr(attention_module, "reference_attention", spy)
    model = make(attention=AttentionSpec("math"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(batch()[0])
    assert seen == [(False, torch.float32)] * MICRO.n_layer
    assert logits.dtype == torch.bfloat16


def test_per_layer_specs_in_model():
    specs = layer_specs(AttentionSpec("flash", precision="paper"), {1: {"precision": "fp32"}}, MICRO.n_layer)
    model = make(attention=specs)
    assert model.attention_specs == specs
    for i, block in enumerate(model.transformer.h):
        assert block.layer_index == i and block.attn.layer_index == i and block.attn.spec is specs[i]
    idx, tgt = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, tgt)
    loss.backward()
    assert torch.isfinite(loss)
    with pytest.raises(ValueError, match=r"\b3\b.*n_layer=2"):   # names the count and the layers
        GPT(MICRO, [AttentionSpec()] * 3)
    with pytest.raises(TypeError):
        GPT(MICRO, ["sdpa", "sdpa"])


def test_layer_specs_helper():
    default = AttentionSpec("sdpa")
    specs = layer_specs(default, {1: {"backend": "flash", "precision": "paper"}}, 12)
    assert len(specs) == 12 and specs[0] == default and specs[2:] == [default] * 10
    assert specs[1] == AttentionSpec("flash", precision="paper")
    flash = AttentionSpec("flash", precision="paper", stabilizer="safe")
    specs = layer_specs(flash, {"1": {"precision": "fp32"}, 3: AttentionSpec("math")}, 4)
    assert specs[1] == AttentionSpec("flash", precision="fp32", stabilizer="safe")
    assert specs[3] == AttentionSpec("math") and specs[0] == specs[2] == flash
    assert layer_specs(flash, None, 2) == [flash, flash] == layer_specs(flash, {}, 2)


@pytest.mark.parametrize("overrides, match", [
    ({12: {"precision": "fp32"}}, r"layer 12.*0\.\.11"),
    ({-1: {"precision": "fp32"}}, r"layer -1"),
    ({"x": {}}, r"'x'"),
    ({1: {"precison": "fp32"}}, r"precison"),
    ({1: {"precision": "fp33"}}, r"AttentionSpec.precision.*fp33"),
    ({1: {"stabilizer": "paper:gamma=2"}}, r"AttentionSpec.stabilizer"),
    ({1: {"backend": "cuda"}}, r"backend.*'cuda'"),
    ({1: {"block_q": 0, "backend": "flash"}}, r"AttentionSpec.block_q"),
    ({1: {"precision": "fp32"}}, r"\['precision'\].*'sdpa'"),   # the flash-only key, the layer's backend
    ({1: "fp32"}, r"must be a dict"),
])
def test_layer_specs_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        layer_specs(AttentionSpec("sdpa"), overrides, 12)


def test_attention_spec_validation_and_names():
    with pytest.raises(SpecError, match="'triton'") as e:
        AttentionSpec("triton")
    assert e.value.field == "backend"
    with pytest.raises(ValueError, match="AttentionSpec.precision"):
        AttentionSpec("flash", precision="bf17")
    with pytest.raises(ValueError, match="AttentionSpec.stabilizer"):
        AttentionSpec("flash", stabilizer="magic")
    with pytest.raises(ValueError, match="AttentionSpec.block_k"):
        AttentionSpec("flash", block_k=True)
    assert AttentionSpec().short_str() == "sdpa"
    assert AttentionSpec("flash", precision="paper", stabilizer="safe").short_str() == "flash[paper,safe]"
    assert AttentionSpec("flash", block_q=128).short_str() == "flash[fa2,none,128xdefault]"
    from flashguard.numerics import get_policy
    from flashguard.attention import get_stabilizer
    spec = AttentionSpec("flash", precision=get_policy("fa2").replace(delta_source="dp_p"),
                         stabilizer=get_stabilizer("paper:beta=7"))
    assert spec.short_str().startswith("flash[fa2[delta_source=dp_p]")


def test_spec_holds_its_flash_options():
    """A spec's flash fields are checked and resolved once into its FlashOptions (not a field it is
    compared or saved by); an unknown backend (the old name "reference" too) is refused by field."""
    from flashguard.attention import FlashOptions
    from flashguard.model import BACKENDS
    from flashguard.numerics import get_policy
    assert BACKENDS == ("sdpa", "flash", "math")
    spec = AttentionSpec("flash", precision="paper", stabilizer="safe", block_q=64)
    assert spec.options == FlashOptions(precision="paper", stabilizer="safe", block_q=64)
    assert spec.options.precision is get_policy("paper") and "options" not in spec.settings()
    assert dataclasses.replace(spec, precision="fp32").options.precision is get_policy("fp32")
    assert spec == AttentionSpec("flash", precision="paper", stabilizer="safe", block_q=64)
    with pytest.raises(SpecError, match="'reference'") as e:
        AttentionSpec("reference")
    assert e.value.field == "backend"


# ---- loss terms and remedies ----------------------------------------------------------------

def test_z_loss_adds_exactly_its_term():
    idx, tgt = batch()
    tgt[0, :5] = -1
    plain = make()
    _, plain_loss = plain(idx, tgt)
    model = make(dataclasses.replace(MICRO, z_loss=1e-2))
    logits, loss = model(idx, tgt)
    keep = tgt.reshape(-1) != -1
    lse = torch.logsumexp(logits.reshape(-1, MICRO.vocab_size)[keep].double(), dim=-1)
    term = 1e-2 * lse.square().mean()
    assert term.item() > 0.1
    torch.testing.assert_close(model.last_ce, plain_loss.detach())
    torch.testing.assert_close(loss.double() - plain_loss.double(), term, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.last_z.double(), term, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.detach(), model.last_ce + model.last_z)


def test_z_loss_gradient_shrinks_logsumexp():
    model = make(dataclasses.replace(MICRO, z_loss=1.0))
    idx, tgt = batch()
    model(idx, tgt)
    z0 = model.last_z.item()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(idx, tgt)[1].backward()
        opt.step()
    model(idx, tgt)
    assert model.last_z.item() < z0


def test_qk_layernorm_changes_outputs_and_trains():
    idx, tgt = batch()
    plain = make()
    cfg = dataclasses.replace(MICRO, qk_layernorm=True)
    model = make(cfg)
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert unexpected == [] and missing and all("q_ln" in k or "k_ln" in k for k in missing)
    with torch.no_grad():
        assert not torch.allclose(model(idx, tgt)[0], plain(idx, tgt)[0], atol=1e-4)
    before = model(idx, tgt)[1]
    before.backward()
    assert model.transformer.h[0].attn.q_ln.weight.grad.abs().sum() > 0
    assert model.transformer.h[0].attn.k_ln.weight.grad.abs().sum() > 0
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.5 * p.grad
    after = model(idx, tgt)[1]
    assert after.item() < before.item() - 1e-3


def uniform_causal_output(attn, x):
    """What the attention module gives when every visible key has the same weight."""
    B, T, C = x.shape
    v = attn.c_attn(x).split(C, dim=2)[2]                     # (B, T, C)
    counts = torch.arange(1, T + 1, dtype=x.dtype).view(1, T, 1)
    return attn.c_proj(v.cumsum(dim=1) / counts)              # (B, T, C)


@pytest.mark.parametrize("spec", [AttentionSpec("sdpa"), AttentionSpec("math"),
                                  AttentionSpec("flash", precision="fp32")], ids=lambda s: s.short_str())
def test_softcap_tiny_cap_gives_uniform_attention(spec):
    cfg = dataclasses.replace(MICRO, attn_softcap=1e-5)
    model = make(cfg, spec)
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        attn.c_attn.weight.mul_(50)  # large scores: without the cap attention is far from uniform
        x = torch.randn(2, 32, cfg.n_embd, generator=torch.Generator().manual_seed(1))
        uniform = uniform_causal_output(attn, x)
        torch.testing.assert_close(attn(x), uniform, rtol=0, atol=1e-4)
        uncapped = make(MICRO, spec).transformer.h[0].attn
        uncapped.load_state_dict(attn.state_dict())
        assert (uncapped(x) - uniform).abs().max() > 1e-2


def test_softcap_backends_agree_and_sdpa_falls_back():
    cfg = dataclasses.replace(MICRO, attn_softcap=0.02)  # scores at init are ~0.03: the cap bites
    base = run_with(AttentionSpec("math"), cfg)
    for spec in (AttentionSpec("sdpa"), AttentionSpec("flash", precision="fp32")):
        logits, loss, _ = run_with(spec, cfg)
        torch.testing.assert_close(logits, base[0], rtol=0, atol=1e-5)
    assert make(cfg).transformer.h[0].attn.effective_backend == "math"
    assert not torch.allclose(run_with(AttentionSpec("sdpa"))[0], base[0], atol=1e-4)


def test_softcap_is_passed_to_the_attention(monkeypatch):
    """Model-side plumbing, with stand-ins that accept ``softcap`` (runs before the lead's change lands)."""
    calls = []

    def capped_math(q, k, v, dtype, softcap):
        s = (q.to(dtype) @ k.to(dtype).transpose(-2, -1)) / math.sqrt(q.shape[-1])
        s = softcap * torch.tanh(s / softcap)
        s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
        return s.softmax(-1) @ v.to(dtype)

    def fake_reference(q, k, v, attn_mask=None, is_causal=False, scale=None, dtype=torch.float64, softcap=None):
        calls.append(("reference", softcap, dtype))
        return capped_math(q, k, v, dtype, softcap)

    def fake_flash(q, k, v, *, options, **kw):
        calls.append(("flash", options.softcap, options.precision.name))
        return capped_math(q, k, v, torch.float32, options.softcap).to(q.dtype)

    monkeypatch.setattr(attention_module, "reference_attention", fake_reference)
    monkeypatch.setattr(attention_module, "flash_attention", fake_flash)
    cfg = dataclasses.replace(MICRO, attn_softcap=1e-5, n_layer=3)
    model = make(cfg, [AttentionSpec("sdpa"), AttentionSpec("math"), AttentionSpec("flash", precision="paper")])
    assert [b.attn.effective_backend for b in model.transformer.h] == ["math", "math", "flash"]
    model(batch(cfg)[0])
    assert calls == [("reference", 1e-5, torch.float32)] * 2 + [("flash", 1e-5, "paper")]
    attn = model.transformer.h[0].attn
    with torch.no_grad():
        attn.c_attn.weight.mul_(50)
        x = torch.randn(2, 16, cfg.n_embd)
        torch.testing.assert_close(attn(x), uniform_causal_output(attn, x), rtol=0, atol=1e-4)


# ---- configuration errors -------------------------------------------------------------------

@pytest.mark.parametrize("changes, field", [
    ({"block_size": 0}, "block_size"), ({"vocab_size": -3}, "vocab_size"), ({"n_layer": 1.5}, "n_layer"),
    ({"n_head": True}, "n_head"), ({"n_embd": 0}, "n_embd"), ({"n_embd": 100, "n_head": 3}, "n_embd"),
    ({"bias": 1}, "bias"), ({"qk_layernorm": "yes"}, "qk_layernorm"),
    ({"dropout": 1.0}, "dropout"), ({"dropout": -0.1}, "dropout"),
    ({"attn_dropout": 1.0}, "attn_dropout"), ({"attn_dropout": -0.1}, "attn_dropout"),
    ({"attn_dropout": "0.1"}, "attn_dropout"), ({"attn_dropout": None}, "attn_dropout"),
    ({"attn_softcap": 0.0}, "attn_softcap"), ({"attn_softcap": float("inf")}, "attn_softcap"),
    ({"attn_softcap": -1.0}, "attn_softcap"), ({"attn_softcap": "30"}, "attn_softcap"),
    ({"z_loss": -1e-4}, "z_loss"), ({"z_loss": float("nan")}, "z_loss"),
])
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}\b"):
        dataclasses.replace(MICRO, **changes)


def test_model_config_presets_and_errors():
    assert model_config("micro") == MICRO
    cfg = model_config("tiny-cpu", dropout=0.1, z_loss=1e-4)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (4, 4, 256, 256, 256)
    assert cfg.dropout == 0.1 and cfg.z_loss == 1e-4
    g = model_config("gpt2-124m")
    assert (g.n_layer, g.n_head, g.n_embd, g.block_size, g.vocab_size, g.bias) == (12, 12, 768, 1024, 50304, False)
    with pytest.raises(ValueError, match="'gpt3'"):
        model_config("gpt3")
    with pytest.raises(ValueError, match="n_layers"):
        model_config("micro", n_layers=3)
    with pytest.raises(ValueError, match=r"n_embd\W+64\W.*n_head\W+5\W"):
        model_config("micro", n_head=5)
    assert GPTConfig(**cfg.to_dict()) == cfg


# ---- diagnostics access ----------------------------------------------------------------------

def test_wq_wk_heads_slices():
    cfg = model_config("micro", n_head=4)
    model = make(cfg)
    C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
    for layer in range(cfg.n_layer):
        w = model.transformer.h[layer].attn.c_attn.weight
        wq, wk, wv = model.wq_heads(layer), model.wk_heads(layer), model.wv_heads(layer)
        assert wq.shape == wk.shape == wv.shape == (H, D, C)
        for h in range(H):
            assert torch.equal(wq[h], w[h * D:(h + 1) * D])
            assert torch.equal(wk[h], w[C + h * D:C + (h + 1) * D])
            assert torch.equal(wv[h], w[2 * C + h * D:2 * C + (h + 1) * D])
        assert wq.data_ptr() == w.data_ptr() and not wq.requires_grad  # a view, follows training
    # head h's queries, as the attention module computes them
    x = torch.randn(2, 5, C)
    q = model.transformer.h[1].attn.c_attn(x)[..., :C].view(2, 5, H, D)
    torch.testing.assert_close(x @ model.wq_heads(1)[3].T, q[:, :, 3])
    assert model.wq_heads(0, grad=True) is None
    idx, tgt = batch(cfg)
    model(idx, tgt)[1].backward()
    g = model.transformer.h[0].attn.c_attn.weight.grad
    assert torch.equal(model.wq_heads(0, grad=True)[2], g[2 * D:3 * D])
    for bad in (-1, 2, 1.0):
        with pytest.raises(ValueError, match=r"\b0\.\.1\b"):   # the valid range
            model.wq_heads(bad)


# ---- generation ----------------------------------------------------------------------------

def test_generate():
    model = make().eval()
    idx = torch.randint(0, MICRO.vocab_size, (2, 60))
    out1 = model.generate(idx, 10, top_k=5, generator=torch.Generator().manual_seed(3))
    out2 = model.generate(idx, 10, top_k=5, generator=torch.Generator().manual_seed(3))
    assert out1.shape == (2, 70) and torch.equal(out1, out2) and torch.equal(out1[:, :60], idx)
    greedy = model.generate(idx, 1, temperature=0)
    assert torch.equal(greedy[:, -1], model(idx)[0][:, -1].argmax(-1))
    one = model.generate(idx, 3, top_k=1, generator=torch.Generator().manual_seed(0))
    assert torch.equal(one, model.generate(idx, 3, temperature=0))
    with pytest.raises(ValueError, match="temperature"):
        model.generate(idx, 1, temperature=-1)
    with pytest.raises(ValueError, match="top_k"):
        model.generate(idx, 1, top_k=0)


def test_dropout_only_in_training():
    model = make(dataclasses.replace(MICRO, dropout=0.2))
    idx, tgt = batch()
    a, b = model(idx, tgt)[0], model(idx, tgt)[0]
    assert not torch.equal(a, b)
    model.eval()
    assert torch.equal(model(idx, tgt)[0], model(idx, tgt)[0])


# ---- attention dropout ---------------------------------------------------------------------

DROP_SPECS = {"sdpa": AttentionSpec("sdpa"), "flash": AttentionSpec("flash", precision="paper", block_q=16, block_k=16),
              "math": AttentionSpec("math")}


def _step(model, idx, tgt, autocast=False):
    """Logits and every parameter gradient of one forward + backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits, loss = model(idx, tgt)
    loss.backward()
    return [logits.detach()] + [p.grad.clone() for p in model.parameters()]


def _digest(tensors) -> str:
    import hashlib
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _platform() -> str:
    """A hash of this machine's CPU arithmetic on random data (bf16 and fp32 matmuls, softmax,
    LayerNorm, GELU): platforms whose kernels round differently get different ones."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 64, generator=g), torch.randn(64, 192, generator=g)
    return _digest([a.bfloat16() @ b.bfloat16(), a @ b, torch.softmax(a, -1), F.layer_norm(a, (64,)),
                    F.gelu(a, approximate="tanh")])


# sha256 of (bf16 logits, every gradient) on the micro model, recorded before attn_dropout existed
# (torch 2.13.0+cpu, oneDNN AMX; _platform() == "5499006c8d7246a8"): the default (0) leaves every
# backend's numbers where they were
BEFORE_ATTN_DROPOUT = {"sdpa": "ba1a66e328b78ec3", "flash": "ecd39b86089c3b60", "math": "02ae1614f7ed802f"}
BEFORE_PLATFORM = ("2.13.0+cpu", "5499006c8d7246a8")


@pytest.mark.parametrize("backend", sorted(DROP_SPECS))
def test_attn_dropout_default_is_bit_identical(backend):
    """attn_dropout = 0 (the default) is no dropout at all: training mode gives the bits of eval
    mode, draws nothing from torch's generator, and (on the build they were recorded on) the
    logits and gradients hash as before the option existed."""
    assert MICRO.attn_dropout == 0.0
    spec = AttentionSpec("flash", precision="paper") if backend == "flash" else AttentionSpec(backend)
    torch.manual_seed(0)
    model = GPT(MICRO, spec)
    idx, tgt = torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64))
    train = _step(model, idx, tgt, autocast=True)
    after = torch.randint(0, 1000, (1,)).item()
    torch.manual_seed(0)
    GPT(MICRO, spec)
    torch.randint(0, 256, (4, 64)), torch.randint(0, 256, (4, 64))
    assert torch.randint(0, 1000, (1,)).item() == after  # the step drew nothing
    evals = _step(model.eval(), idx, tgt, autocast=True)
    assert all(torch.equal(a, b) for a, b in zip(train, evals))
    # the recorded hashes are of one thread's arithmetic: with more, CPU reductions split differently
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        one = _step(GPT(MICRO, spec), idx, tgt, autocast=True)
        here = (torch.__version__, _platform())
    finally:
        torch.set_num_threads(threads)
    if here == BEFORE_PLATFORM:  # elsewhere the kernels round differently
        assert _digest(one) == BEFORE_ATTN_DROPOUT[backend]


@pytest.mark.parametrize("backend", sorted(DROP_SPECS))
def test_attn_dropout_in_training_only_and_reproducible(backend):
    """attn_dropout > 0 changes the training-mode output (logits and gradients), not the eval-mode
    one (the same weights without it give the same bits), and torch.manual_seed reproduces it."""
    spec = DROP_SPECS[backend]
    plain = make(MICRO, spec)
    drop = make(dataclasses.replace(MICRO, attn_dropout=0.25), spec)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), drop.state_dict().values()))
    idx, tgt = batch(T=40)
    torch.manual_seed(5)
    ref = _step(plain, idx, tgt)
    torch.manual_seed(5)
    a = _step(drop, idx, tgt)
    torch.manual_seed(5)
    b = _step(drop, idx, tgt)
    assert all(torch.equal(x, y) for x, y in zip(a, b))           # reproducible from the seed
    assert not torch.equal(a[0], ref[0]) and not torch.equal(a[1], ref[1])
    c = _step(drop, idx, tgt)                                     # the generator moved on: new masks
    assert not torch.equal(a[0], c[0])
    plain.eval(), drop.eval()
    assert all(torch.equal(x, y) for x, y in zip(_step(plain, idx, tgt), _step(drop, idx, tgt)))


def test_attn_dropout_reaches_each_backend(monkeypatch):
    """The model passes dropout_p = attn_dropout while training (0 in eval) to torch's SDPA and to
    flash_attention (also on the injection's delta-hook path)."""
    seen = []
    for name in ("flash_attention", "flash_attention_with_hooks"):
        real = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name,
                            lambda *a, _real=real, **kw: (seen.append(kw["dropout_p"]), _real(*a, **kw))[1])
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: (seen.append(kw["dropout_p"]), real_sdpa(*a, **kw))[1])
    cfg = dataclasses.replace(MICRO, n_layer=3, attn_dropout=0.1)
    specs = [AttentionSpec("sdpa"), AttentionSpec("flash", precision="fp32"),
             AttentionSpec("flash", precision="fp32", delta_hook=lambda d, **kw: d)]
    model = make(cfg, specs)
    idx, tgt = batch(T=16)
    model(idx, tgt)
    assert seen == [0.1] * 3
    model.eval()
    model(idx, tgt)
    assert seen[3:] == [0.0] * 3


def test_math_backend_drops_what_flash_drops():
    """The math backend's dropout uses flashguard's keep mask with a seed drawn as flash_attention
    draws it: from the same generator state, the fp32 formula and the fp32 flash arithmetic agree
    to fp32 rounding (so they agree in expectation too); a cheap mask, no refusal needed."""
    q, k, v = (torch.randn(2, 3, 24, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch.manual_seed(3)
    m = attention_module.attend(AttentionSpec("math"), q, k, v, dropout_p=0.3)
    torch.manual_seed(3)
    f = attention_module.attend(AttentionSpec("flash", precision="fp32", block_q=8, block_k=8), q, k, v,
                                dropout_p=0.3)
    torch.testing.assert_close(m, f, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(m, attention_module.attend(AttentionSpec("math"), q, k, v))
    with pytest.raises(ValueError, match=r"dropout_p.*1\.5"):
        attention_module.attend(AttentionSpec("math"), q, k, v, dropout_p=1.5)


def test_flops_per_token():
    with torch.device("meta"):
        model = GPT(model_config("gpt2-124m"))
    n = 124_373_760 - 1024 * 768
    assert model.flops_per_token() == 6 * n + 12 * 12 * 768 * 1024


def test_set_attention_switches_backends_on_the_same_weights():
    model = make()
    idx, tgt = batch()
    sdpa_loss = model(idx, tgt)[1]
    model.set_attention([AttentionSpec("sdpa"), AttentionSpec("flash", precision="fp32")])
    assert [s.backend for s in model.attention_specs] == ["sdpa", "flash"]
    torch.testing.assert_close(model(idx, tgt)[1], sdpa_loss, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"\b1\b.*n_layer=2"):
        model.set_attention([AttentionSpec()])
    with pytest.raises(TypeError, match="AttentionSpec"):
        model.transformer.h[0].attn.spec = "flash"


def test_attention_spec_kernel_is_checked_and_reaches_flash_attention(monkeypatch):
    """The spec's kernel (flash_attention's kernel=) and tiles go to the call; triton is refused
    for settings it cannot run, by field (SpecError.field), and under soft-capping."""
    from flashguard.model import KERNELS
    assert KERNELS == ("auto", "pytorch", "triton") and AttentionSpec().kernel == "auto"
    with pytest.raises(SpecError, match="'cuda'") as e:
        AttentionSpec("flash", kernel="cuda")
    assert e.value.field == "kernel"
    with pytest.raises(SpecError, match="'paper'") as e:
        AttentionSpec("flash", precision="paper", kernel="triton")
    assert e.value.field == "kernel"
    with pytest.raises(SpecError, match="block_q=512") as e:
        AttentionSpec("flash", precision="fa2", kernel="triton", block_q=512)
    assert e.value.field == "kernel"
    with pytest.raises(SpecError, match="hook") as e:
        AttentionSpec("flash", precision="fa2", kernel="triton", delta_hook=lambda *a: None)
    assert e.value.field == "kernel"
    ok = AttentionSpec("flash", precision="fa2", kernel="triton", block_q=64)
    assert ok.short_str() == "flash[fa2,none,64xdefault,triton]"
    with pytest.raises(SpecError, match="softcap"):
        GPT(dataclasses.replace(MICRO, attn_softcap=30.0), ok)
    with pytest.raises(SpecError, match=r"\['kernel'\].*'sdpa'") as e:   # the misplaced key and the backend
        AttentionSpec("sdpa").with_changes({"kernel": "pytorch"})
    assert e.value.field == "kernel"
    seen = {}
    real = attention_module.flash_attention

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **{**kw, "kernel": "pytorch"})
    monkeypatch.setattr(attention_module, "flash_attention", spy)
    model = GPT(MICRO, AttentionSpec("flash", precision="fp32", kernel="pytorch", block_q=8, block_k=16))
    model(torch.randint(0, MICRO.vocab_size, (1, 16)))
    assert (seen["options"].kernel, seen["options"].block_q, seen["options"].block_k) == ("pytorch", 8, 16)
    q = torch.randn(1, 2, 8, 16)
    assert AttentionSpec("flash", precision="fa2").kernel_for(q, q, q) == "pytorch"  # auto on CPU
