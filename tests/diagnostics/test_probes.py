"""Each probe on constructed inputs whose answer is known."""
from __future__ import annotations

import math

import pytest
import torch

from diag_helpers import distinct_problem, tied_problem
from flashguard.attention import flash_attention, reference_attention
from flashguard.diagnostics import (LayerCapture, ProbeState, error_structure, map_dq_to_wq, probe_layer,
                                    shadow, weight_probe)
from flashguard.diagnostics.probes import attention_metrics
from flashguard.model import GPT, AttentionSpec, GPTConfig
from flashguard.numerics import get_policy


def _cap(q, k, v, do=None, precision="paper", stabilizer="none", causal=False, **kw):
    spec = AttentionSpec(backend="flash", precision=precision, stabilizer=stabilizer,
                         block_q=kw.pop("block_q", None), block_k=kw.pop("block_k", None))
    return LayerCapture(layer=0, q=q, k=k, v=v, do=do, spec=spec, causal=causal, **kw)


# ---------------------------------------------------------------------------- ties and Pbar == 1

@pytest.mark.parametrize("precision", ["paper", "fa2", "fp32"])
def test_exact_ties_give_tie_rate_one_and_two_pbar_ones_per_row(precision):
    q, k, v, do = tied_problem(T=64)
    m = probe_layer(_cap(q, k, v, do, precision), grad=False)
    assert m["numerics/tie_rate/L0"] == 1.0
    assert m["numerics/tie_rate/L0H0"] == m["numerics/tie_rate/L0H1"] == 1.0
    assert m["numerics/pbar_one_multi/L0"] == 1.0
    assert m["numerics/pbar_one/L0"] == pytest.approx(2 / 64)  # exactly the two tied keys of each row


def test_distinct_maxima_give_no_ties_and_one_pbar_one_per_row():
    q, k, v, do = distinct_problem(T=32)
    m = probe_layer(_cap(q, k, v, do, "paper"), grad=False)
    assert m["numerics/tie_rate/L0"] == 0.0
    assert m["numerics/pbar_one_multi/L0"] == 0.0
    assert m["numerics/pbar_one/L0"] == pytest.approx(1 / 32)  # the row maximum: exp(0) = 1
    assert m["attn/max_logit/L0"] == pytest.approx(0.40625 * 31 - 3.0, abs=0.07)  # the lowest score


def test_paper_fix_keeps_the_ties_but_removes_pbar_one():
    q, k, v, do = tied_problem(T=64)
    m = probe_layer(_cap(q, k, v, do, "paper", stabilizer="paper"), grad=False)
    assert m["numerics/tie_rate/L0"] == 1.0      # the tie rule reads the scores
    assert m["numerics/pbar_one/L0"] == 0.0      # m = beta * r: every Pbar < 1
    assert m["numerics/pbar_one_multi/L0"] == 0.0


@pytest.mark.parametrize("precision,block", [("paper", 16), ("fa2", 16), ("paper", 512)])
def test_causal_mask_and_tiles_are_counted_per_visible_row(precision, block):
    # all scores equal (q = 0): every (row, key tile) pair with >= 2 visible keys is tied, and
    # every visible Pbar is 1; hidden keys, rows with no visible key and tiles the mask hides
    # completely (visited by the paper arithmetic) are not counted
    T, B, H = 40, 2, 2
    g = torch.Generator().manual_seed(0)
    q = torch.zeros(B, H, T, 8).bfloat16()
    k, v, do = (torch.randn(B, H, T, 8, generator=g).bfloat16() for _ in range(3))
    m = probe_layer(_cap(q, k, v, do, precision, causal=True, block_q=block, block_k=block), grad=False)
    rows = tied = 0
    for q0 in range(0, T, block):
        for k0 in range(0, T, block):
            for i in range(q0, min(q0 + block, T)):
                visible = sum(1 for j in range(k0, min(k0 + block, T)) if j <= i)
                rows += visible >= 1
                tied += visible >= 2
    assert m["numerics/tie_rate/L0"] == pytest.approx(tied / rows)
    assert m["numerics/pbar_one/L0"] == 1.0
    assert m["attn/max_logit/L0"] == 0.0
    assert m["attn/sink_mass/L0"] == pytest.approx(sum(1 / (i + 1) for i in range(1, T)) / (T - 1))


def test_logit_and_sink_metrics_by_hand_and_against_the_full_probability_matrix():
    """S = q k^T with q = I (scale 1), causal: key 0 holds row 1's maximum alone, row 2's tied with
    key 2 (argmax's first index: key 0) and not row 3's; the largest |S| is a negative score, and
    a hidden score (row 0's 9) counts for nothing."""
    s = torch.tensor([[1., 9., 0., 0.],
                      [2., 1., 0., 0.],
                      [1., 0., 1., 0.],
                      [0., 3., -5., 1.]])
    q = torch.eye(4, dtype=torch.float64)[None, None]
    k = s.T.contiguous().to(torch.float64)[None, None]   # S[i, j] = k_j[i]
    v = torch.randn(1, 1, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cap = _cap(q, k, v, None, "fp64", causal=True, scale=1.0)
    m = probe_layer(cap, grad=False)
    assert m["attn/max_logit/L0"] == 5.0
    assert m["attn/sink_top_frac/L0"] == pytest.approx(2 / 3)         # rows 1 and 2 of rows 1..3
    lse = [torch.tensor(row[:i + 1], dtype=torch.float64).logsumexp(0) for i, row in enumerate(s.tolist())]
    sink = sum(math.exp(s[i, 0] - lse[i]) for i in (1, 2, 3)) / 3
    assert m["attn/sink_mass/L0"] == pytest.approx(sink, rel=1e-14)
    # random scores: the same as read off the full matrix exp(S - lse)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 33, 8, generator=g) for _ in range(3))
    sh = shadow(_cap(q, k, v, None, "fp32", causal=True), grad=False)
    p = sh.probabilities()[..., 1:, :]
    m = attention_metrics(sh)
    for h in range(3):
        assert m[f"attn/sink_mass/L0H{h}"] == pytest.approx(float(p[:, h, :, 0].mean()), rel=1e-14)
        visible = sh.s[:, h][sh.s[:, h] > float("-inf")]
        assert m[f"attn/max_logit/L0H{h}"] == float(visible.abs().max())
    assert m["attn/sink_top_frac/L0"] == float((p.argmax(-1) == 0).double().mean())


# ---------------------------------------------------------------------------- the study's bias

def test_positive_delta_bias_from_ties_in_paper_arithmetic_and_none_in_fp32():
    """Tied maxima, mostly negative V, dO correlated with V (tied_problem).

    paper arithmetic: two bf16 roundings in the forward each push |O| up, and each alone gives
    about half of the O bias measured here (-0.0009 of -0.0018; checked with custom policies):
    * PV of a row = v_a + v_b (weight exactly 1 each) + tiny same-sign terms, rounded once to
      bf16: v_a + v_b of two numbers in (-2, -1] needs one bit more than bf16 has; when that
      bit is 1 the tiny terms (sticky bits) break the rounding tie away from zero, when it is
      0 they are dropped - on average |PV| grows (the study's example);
    * l = 2 + sum of the tiny Pbar rounds to 2 in bf16, so O = PV / l is too large in magnitude.
    So O's error is negative where V is negative (o_err_bias < 0, times sign(V) > 0), and
    delta = rowsum(dO * O) with dO mostly negative errs upward: delta_lp - delta_hp > 0 on
    average and in most rows (not all: delta's own bf16 product and sum add per-row noise; with
    those in fp32 every row is positive).
    fp32 arithmetic on the same problem: errors 4-5 orders of magnitude smaller and no sign.
    (fa2 arithmetic - fp32 PV and l, one final rounding of O - errs the other way on this
    problem: there the sticky bits are the other keys' V minus the tied pair's mean, which the
    10 % positive entries make positive, so O is rounded toward zero and delta errs downward.)
    """
    q, k, v, do = tied_problem(seed=1)
    paper = probe_layer(_cap(q, k, v, do, "paper"), grad=False)
    fp32 = probe_layer(_cap(q, k, v, do, "fp32"), grad=False)
    assert paper["numerics/o_err_bias/L0"] < -1e-3
    assert paper["numerics/o_err_bias_vsign/L0"] > 1e-3
    assert paper["numerics/delta_err_mean/L0"] > 0.05
    assert paper["numerics/delta_err_rel/L0"] > 5e-4
    assert paper["numerics/delta_err_pos_frac/L0"] > 0.65
    assert abs(fp32["numerics/o_err_bias/L0"]) < 1e-7
    assert abs(fp32["numerics/delta_err_rel/L0"]) < 1e-6
    assert 0.3 < fp32["numerics/delta_err_pos_frac/L0"] < 0.7


def test_delta_running_sum_adds_up_across_probes():
    q, k, v, do = tied_problem(seed=2)
    state = ProbeState()
    means = []
    for _ in range(3):
        m = probe_layer(_cap(q, k, v, do, "paper"), state=state, grad=False)
        means.append(m["numerics/delta_err_mean/L0"])
    assert m["numerics/delta_err_cumsum/L0"] == pytest.approx(sum(means))
    assert state.delta_count[0] == 3


# ---------------------------------------------------------------------------- weights

def _model(n_layer=2, n_head=2, n_embd=16):
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=n_layer, n_head=n_head, n_embd=n_embd),
               AttentionSpec(backend="flash", precision="fp32"))


def _set_head(model, layer, part, head, sigmas, seed=0):
    """Put a (D, C) matrix with singular values ``sigmas`` into a head slice of c_attn."""
    D, C = model.config.head_dim, model.config.n_embd
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(D, D, generator=g))
    w, _ = torch.linalg.qr(torch.randn(C, D, generator=g))
    m = u @ torch.diag(torch.tensor(sigmas, dtype=torch.float32)) @ w.T
    with torch.no_grad():
        rows = slice(part * C + head * D, part * C + (head + 1) * D)
        model.transformer.h[layer].attn.c_attn.weight[rows] = m


def test_known_spectral_norms_and_growth_rate():
    model = _model()
    _set_head(model, 1, 0, 1, [3.0, 2.0, 1.0, 0.5, 0.25, 0.1, 0.1, 0.1])   # W_Q, layer 1, head 1
    _set_head(model, 1, 1, 0, [0.7] * 8, seed=1)                           # W_K, layer 1, head 0
    state = ProbeState()
    m = weight_probe(model, [1], step=100, state=state)
    assert m["weights/wq_spectral_norm/L1H1"] == pytest.approx(3.0, rel=1e-6)
    assert m["weights/wk_spectral_norm/L1H0"] == pytest.approx(0.7, rel=1e-6)
    assert m["weights/wq_spectral_norm_max/L1"] == pytest.approx(3.0, rel=1e-6)
    assert not any("growth" in k for k in m) and not any("/L0" in k for k in m)
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight.mul_(math.exp(0.05))
    m = weight_probe(model, [1], step=150, state=state)
    # ln growth 0.05 over 50 steps = 0.1 per 100 steps, for every head alike
    assert m["weights/wq_growth/L1H1"] == pytest.approx(0.1, rel=1e-4)
    assert m["weights/wk_growth/L1H0"] == pytest.approx(0.1, rel=1e-4)
    assert m["weights/wq_growth_max/L1"] == pytest.approx(0.1, rel=1e-4)


# ---------------------------------------------------------------------------- gradient error

def test_error_structure_of_a_rank_one_error():
    g = torch.Generator().manual_seed(0)
    H, D, C = 2, 4, 8
    a, b = torch.randn(H * D, generator=g, dtype=torch.float64), torch.randn(C, generator=g, dtype=torch.float64)
    err = torch.outer(a, b).view(H, D, C)
    w = torch.zeros(H * D, C, dtype=torch.float64)
    w[0, 0], w[1, 1] = 5.0, 1.0                            # W's top singular pair: (e0, e0)
    s = error_structure(err, w.view(H, D, C), prev=err.reshape(H * D, C), running=-err.reshape(H * D, C))
    assert s["sv1"] == pytest.approx(float(a.norm() * b.norm()))
    assert s["sv2"] < 1e-12 * s["sv1"]
    assert s["rank1_frac"] == pytest.approx(1.0)
    assert s["cos_prev"] == pytest.approx(1.0) and s["cos_sum"] == pytest.approx(-1.0)
    assert s["align_top"] == pytest.approx(abs(float(a[0] * b[0])) / s["norm"])
    # an error along W's own top pair: fully aligned; subtracting it (a gradient step) shrinks sigma_1
    e0 = torch.zeros(H * D, C, dtype=torch.float64)
    e0[0, 0] = 2.0
    s0 = error_structure(e0.view(H, D, C), w.view(H, D, C))
    assert s0["align_top"] == pytest.approx(1.0) and s0["top_push"] == pytest.approx(-1.0)
    assert s0["align_top/H0"] == pytest.approx(1.0) and s0["norm/H1"] == 0.0
    z = error_structure(torch.zeros(H, D, C), w.view(H, D, C))
    assert z["norm"] == 0.0 and z["rank1_frac"] == 0.0


def test_shadow_reference_is_reference_attention_with_autograd():
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 20, 8, generator=g, dtype=torch.float64) for _ in range(4))
    for softcap in (None, 5.0):
        cap = LayerCapture(layer=0, q=q, k=k, v=v, do=do, causal=True, scale=0.3, softcap=softcap,
                           spec=AttentionSpec(backend="flash", precision="fp64", block_q=8, block_k=8))
        sh = shadow(cap)
        qq = q.clone().requires_grad_(True)
        o = reference_attention(qq, k, v, is_causal=True, scale=0.3, softcap=softcap)
        (dq,) = torch.autograd.grad(o, qq, do)
        torch.testing.assert_close(sh.trace.o_ref, o.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(sh.dq_hp, dq, rtol=1e-10, atol=1e-12)
        # the probabilities the sink metrics read are the reference's: rows sum to 1
        torch.testing.assert_close(sh.probabilities().sum(-1), torch.ones(2, 3, 20, dtype=torch.float64))


def test_gradient_error_equals_flash_minus_reference_gradient_and_is_rank_one_for_one_input():
    """dW_Q error of the pipeline = (dQ of flash_attention's autograd - dQ of the fp64 reference)
    mapped through x; with the same x for every token it is (sum of the dQ errors) x^T: rank 1."""
    g = torch.Generator().manual_seed(3)
    B, H, T, D, C = 2, 2, 24, 8, 16
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    w_q = torch.randn(H, D, C, generator=g)
    for x, rank_one in ((torch.randn(B, T, C, generator=g), False),
                        (torch.randn(C, generator=g).expand(B, T, C), True)):
        cap = LayerCapture(layer=1, q=q, k=k, v=v, do=do, x=x, w_q=w_q, causal=True,
                           spec=AttentionSpec(backend="flash", precision="paper", block_q=8, block_k=8))
        m = probe_layer(cap)
        qq = q.clone().requires_grad_(True)
        o = flash_attention(qq, k, v, is_causal=True, precision="paper", block_q=8, block_k=8)
        (dq_flash,) = torch.autograd.grad(o, qq, do)
        q64 = q.double().requires_grad_(True)
        (dq_ref,) = torch.autograd.grad(reference_attention(q64, k.double(), v.double(), is_causal=True), q64,
                                        do.double())
        err = torch.einsum("bhtd,btc->hdc", dq_flash.double() - dq_ref, x.double())
        assert m["grad/wq_err_norm/L1"] == pytest.approx(float(err.norm()), rel=1e-6)
        sv = torch.linalg.svdvals(err.reshape(H * D, C))
        assert m["grad/wq_err_sv1/L1"] == pytest.approx(float(sv[0]), rel=1e-6)
        assert m["grad/wq_err_sv1/L1"] > 0
        if rank_one:
            assert m["grad/wq_err_rank1_frac/L1"] == pytest.approx(1.0, abs=1e-9)
            assert m["grad/wq_err_sv2/L1"] < 1e-6 * m["grad/wq_err_sv1/L1"]
        else:
            assert m["grad/wq_err_rank1_frac/L1"] < 0.9
        full = torch.einsum("bhtd,btc->hdc", dq_ref, x.double())
        assert m["grad/wq_err_rel/L1"] == pytest.approx(float(err.norm() / full.norm()), rel=1e-6)


def test_gradient_error_cosines_across_probes():
    q, k, v, do = tied_problem(seed=4, T=32, D=32, B=1)
    g = torch.Generator().manual_seed(0)
    cap = LayerCapture(layer=0, q=q, k=k, v=v, do=do, x=torch.randn(1, 32, 16, generator=g),
                       w_q=torch.randn(2, 32, 16, generator=g), causal=False,
                       spec=AttentionSpec(backend="flash", precision="paper"))
    state = ProbeState()
    first = probe_layer(cap, state=state)
    assert "grad/wq_err_cos_prev/L0" not in first
    second = probe_layer(cap, state=state)         # the same batch again: the same error
    assert second["grad/wq_err_cos_prev/L0"] == pytest.approx(1.0, abs=1e-6)
    assert second["grad/wq_err_cos_sum/L0"] == pytest.approx(1.0, abs=1e-6)
    assert state.grad_err_count[0] == 2


def test_query_layernorm_is_followed_by_the_mapping():
    g = torch.Generator().manual_seed(0)
    B, H, T, D, C = 2, 2, 5, 4, 8
    x, w = torch.randn(B, T, C, generator=g), torch.randn(H, D, C, generator=g)
    ln = torch.nn.LayerNorm(D)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    dq = torch.randn(B, H, T, D, generator=g)
    wq = w.clone().double().requires_grad_(True)
    qn = torch.nn.functional.layer_norm(torch.einsum("btc,hdc->bhtd", x.double(), wq), (D,),
                                        ln.weight.double(), None, ln.eps)
    (expected,) = torch.autograd.grad(qn, wq, dq.double())
    got = map_dq_to_wq(dq, x, w, (ln.weight.detach(), None, ln.eps))
    torch.testing.assert_close(got, expected)
    # stacked gradients are mapped one by one (the probes map dq error and dq together)
    both = map_dq_to_wq(torch.stack((dq, 2 * dq)), x, w, (ln.weight.detach(), None, ln.eps))
    assert both.shape == (2, H, D, C)
    torch.testing.assert_close(both[1], 2 * expected)


# ---------------------------------------------------------------------------- plumbing

def test_non_flash_layers_get_attention_metrics_only_unless_a_policy_is_given():
    # (an sdpa layer's probes measure its kernel: tests/diagnostics/test_sdpa_probes.py)
    q, k, v, do = tied_problem(T=32, D=32, B=1)
    cap = LayerCapture(layer=0, q=q, k=k, v=v, do=do, spec=AttentionSpec(backend="math"), backend="math",
                       causal=False)
    m = probe_layer(cap, grad=False)
    assert "attn/max_logit/L0" in m and not any(k.startswith("numerics/") for k in m)
    m = probe_layer(cap, grad=False, precision="paper")
    assert m["numerics/tie_rate/L0"] == 1.0


def test_probes_leave_the_global_rng_alone():
    policy = get_policy("fa2-e4m3").replace(rounding="stochastic")
    q, k, v, do = tied_problem(T=32, D=32, B=1)
    before = torch.get_rng_state()
    sh = shadow(_cap(q, k, v, do, policy))
    assert sh.dq_lp is not None and torch.equal(torch.get_rng_state(), before)


def test_probe_state_round_trips_through_json(tmp_path):
    s = ProbeState(step=7, norms={"weights/wq_spectral_norm/L1H0": (7, 1.25)}, delta_sum={1: 0.5},
                   delta_count={1: 2}, grad_err_prev={1: torch.randn(6, 4)}, grad_err_sum={1: torch.randn(6, 4)},
                   grad_err_count={1: 2})
    s.save(tmp_path / "diagnostics" / "state_0000007.json")
    t = ProbeState.load(tmp_path / "diagnostics" / "state_0000007.json")
    assert t.step == 7 and t.norms == s.norms and t.delta_sum == s.delta_sum and t.grad_err_count == {1: 2}
    assert torch.equal(t.grad_err_prev[1], s.grad_err_prev[1]) and torch.equal(t.grad_err_sum[1], s.grad_err_sum[1])
    assert ProbeState.load_before(tmp_path, 8).step == 7 and ProbeState.load_before(tmp_path, 7) is None


@pytest.mark.parametrize("delta_source", ["o_lowp", "o_highp", "dp_p"])
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_an_exact_policy_has_no_error_in_any_delta_source(delta_source, softcap):
    """With every intermediate in fp64 the policy's path and the fp64 shadow agree: the errors
    the probes report come from the policy's arithmetic, not from the probes."""
    g = torch.Generator().manual_seed(5)
    B, H, T, D, C = 1, 2, 20, 8, 12
    q, k, v, do = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4))
    policy = get_policy("fp64").replace(delta_source=delta_source)
    cap = LayerCapture(layer=0, q=q, k=k, v=v, do=do, x=torch.randn(B, T, C, generator=g, dtype=torch.float64),
                       w_q=torch.randn(H, D, C, generator=g, dtype=torch.float64), causal=True, softcap=softcap,
                       spec=AttentionSpec(backend="flash", precision=policy, block_q=8, block_k=32))
    m = probe_layer(cap)
    assert m["numerics/o_err_abs/L0"] < 1e-14
    assert m["numerics/delta_err_abs/L0"] < 1e-13
    assert m["grad/wq_err_rel/L0"] < 1e-12


# ---------------------------------------------------------------------------- the kernel that trained

def test_probes_measure_with_the_layers_kernel_and_tiles():
    """The shadow runs the arithmetic the layer ran: its tiles (else the kernel's default: 512 on
    the PyTorch path) and its kernel, 'auto' resolved as flash_attention resolves it."""
    q, k, v, do = tied_problem(T=64)
    sh = shadow(_cap(q, k, v, do, "fa2", block_q=16, block_k=32))
    assert (sh.trace.label, sh.trace.ties is not None) == ("fa2 / none 16x32", True)
    cap = LayerCapture(layer=0, q=q, k=k, v=v, do=do, causal=True,
                       spec=AttentionSpec("flash", precision="fa2", kernel="pytorch", block_q=32))
    assert shadow(cap, grad=False).trace.label == "fa2 / none 32x512"
    # auto on CPU tensors runs the PyTorch path, so the probes do
    auto = LayerCapture(layer=0, q=q, k=k, v=v, do=do, spec=AttentionSpec("flash", precision="fa2"))
    assert shadow(auto, grad=False).trace.label == "fa2 / none"
    # the tiles decide what the probes count: 16-key tiles see the tied pair in one tile or two
    t16 = probe_layer(_cap(q, k, v, do, "fa2", block_k=16), grad=False)["numerics/tie_rate/L0"]
    t64 = probe_layer(_cap(q, k, v, do, "fa2"), grad=False)["numerics/tie_rate/L0"]
    assert t64 == 1.0 and t16 < 1.0


_TRITON_PROBE = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 8):
    print("SKIP old triton"); sys.exit(0)
from flashguard.attention.triton_flash import forward_tiles
from flashguard.diagnostics import capture_batch, run_probes
from flashguard.diagnostics.probes import shadow
from flashguard.model import GPT, AttentionSpec, GPTConfig
torch.manual_seed(0)
cfg = GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=2, n_embd=32)
model = GPT(cfg, AttentionSpec("flash", precision="fa2", kernel="triton"))
x = torch.randint(0, 64, (2, 32)); y = torch.roll(x, -1, 1)
caps, loss = capture_batch(model, x, y, [0], autocast="fp32")
sh = shadow(caps[0])
bm, bn = forward_tiles(16, torch.bfloat16)
assert sh.trace.label == f"fa2 / none {bm}x{bn} [triton]", sh.trace.label
assert sh.trace.ties is not None
m = run_probes(model, caps)
assert all(v == v for v in m.values()), m
assert "numerics/tie_rate/L0" in m and "numerics/delta_err_mean/L0" in m
print("OK", sh.trace.label)
"""


def test_probes_of_a_triton_layer_run_the_triton_kernel(tmp_path):
    """kernel = triton: the probes measure through the Triton kernel at its own forward tiles
    (Triton's CPU interpreter, in a subprocess: the mode is fixed when triton is imported)."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", _TRITON_PROBE], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout.strip())
    assert out.stdout.startswith("OK")
