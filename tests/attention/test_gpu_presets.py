"""The production GPU kernels' presets (numerics.policy.GPU_PRESETS, docs/kernels.md).

On CPU: the presets exist, parse and validate; forward and backward agree with the fp64
reference as closely as fa2 does; the exp2 forms (numerics.gpu_exp) give known answers computed
directly in fp64, each way (a tie whose P̄ is not 1 under the FMA, and one whose P̄ is exactly 1);
the backward's two places for the softmax scale agree bit for bit where the scale is a power of two.
On CUDA only: each preset against the real kernel it models (skipped cleanly without a GPU).
"""
from __future__ import annotations

import math

import pytest
import torch

from flashguard import flash_attention
from flashguard.attention.reference import reference_attention
from flashguard.experiments import audit
from flashguard.numerics.gpu_exp import LOG2E_F32, Exp2Steps, fp32, kernel_log2e_scale
from flashguard.numerics.policy import GPU_PRESETS, POLICIES, get_policy

HAS_CUDA = torch.cuda.is_available()


# --------------------------------------------------------------------------- presets

def test_presets_exist_with_their_kernel_steps():
    assert set(GPU_PRESETS) <= set(POLICIES)
    want = {"fa2-cuda": ("exp2_fma", "reciprocal", "accumulator"),
            "torch-flash-cuda": ("exp2_unfused", "reciprocal", "accumulator"),
            "fa3-cuda": ("exp2_fma", "reciprocal", "accumulator"),
            "mem-efficient": ("exp2_log2e", "reciprocal", "operand"),
            "cudnn": ("exact", "divide", "operand")}
    for name, steps in want.items():
        p = get_policy(name)
        assert p.name == name and (p.exp, p.normalize, p.ds_scale) == steps
        # fa2's formats everywhere: only the steps differ
        assert p.replace(name="fa2", exp="exact", normalize="divide", ds_scale="operand") == POLICIES["fa2"]


def test_new_fields_parse_and_validate():
    p = get_policy("fa2[exp=exp2_fma,normalize=reciprocal,ds_scale=accumulator]")
    assert p == POLICIES["fa2-cuda"].replace(name=p.name)
    assert p.short_str() == "fa2[exp=exp2_fma,normalize=reciprocal,ds_scale=accumulator]"
    assert get_policy("fa2-cuda[exp=exp2_unfused]").exp == "exp2_unfused"
    with pytest.raises(ValueError, match="ds_scale"):
        get_policy("fa2[ds_scale=later]")
    with pytest.raises(ValueError, match="exp must be one of"):
        get_policy("fa2[exp=exp2]")
    with pytest.raises(ValueError, match="scores='fp32'"):
        get_policy("paper").replace(exp="exp2_fma")
    with pytest.raises(ValueError, match="masked_scores='inf'"):
        get_policy("fa2").replace(exp="exp2_log2e", masked_scores="finite")


# --------------------------------------------------------------------------- against fp64

def _inputs(t, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 2, t, d, generator=g).bfloat16() for _ in range(4)]


def _errors(precision, q, k, v, do, mask, causal, tiles=(64, 48)):
    qr, kr, vr = (x.double().requires_grad_() for x in (q, k, v))
    ref = reference_attention(qr, kr, vr, attn_mask=mask, is_causal=causal)
    ref.backward(do.double())
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(qq, kk, vv, attn_mask=mask, is_causal=causal, precision=precision, block_q=tiles[0],
                        block_k=tiles[1])
    o.backward(do)
    return [float((a.detach().double() - b.detach()).abs().max()) for a, b in
            ((o, ref), (qq.grad, qr.grad), (kk.grad, kr.grad), (vv.grad, vr.grad))]


@pytest.mark.parametrize("mask_kind,causal", [("none", False), ("none", True), ("bool", False), ("additive", False)])
@pytest.mark.parametrize("d", [64, 128])
def test_forward_and_backward_match_fp64_as_fa2_does(mask_kind, causal, d):
    t = 150  # not a multiple of the tiles
    q, k, v, do = _inputs(t, d)
    g = torch.Generator().manual_seed(1)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(t, t, generator=g) > 0.3
    elif mask_kind == "additive":
        mask = torch.where(torch.rand(t, t, generator=g) > 0.3, torch.randn(t, t, generator=g), float("-inf"))
    base = _errors("fa2", q, k, v, do, mask, causal)
    for name in GPU_PRESETS:
        errs = _errors(name, q, k, v, do, mask, causal)
        for what, e, b in zip(("O", "dQ", "dK", "dV"), errs, base):
            assert e <= 2 * b + 1e-3, (name, what, e, b)


def test_fully_masked_rows_give_zero_and_no_nan():
    q, k, v, do = _inputs(40, 64)
    mask = torch.ones(40, 40, dtype=torch.bool)
    mask[3] = False
    for name in GPU_PRESETS:
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        o = flash_attention(qq, kk, vv, attn_mask=mask, precision=name, block_q=16, block_k=16)
        o.backward(do)
        assert torch.equal(o[:, :, 3], torch.zeros_like(o[:, :, 3])), name
        assert all(torch.isfinite(x.grad).all() for x in (qq, kk, vv)), name


def test_ds_scale_accumulator_equals_operand_for_a_power_of_two_scale():
    # D = 64: scale 1/8 moves no rounding, so both places of the scale give the same bits
    q, k, v, do = _inputs(100, 64)
    grads = []
    for ds_scale in ("operand", "accumulator"):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        flash_attention(qq, kk, vv, precision=get_policy(f"fa2[ds_scale={ds_scale}]"), block_q=32,
                        block_k=32).backward(do)
        grads.append([x.grad for x in (qq, kk, vv)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# --------------------------------------------------------------------------- exp2 known answers

def _f32(x: float) -> torch.Tensor:
    return torch.tensor([[x]], dtype=torch.float32)


def _direct_fma_p(r: float, m: float, c: float) -> float:
    """P̄ = fp32(2^fp32(r c - fp32(m c))) in fp64 directly: r c and m c are exact in fp64 (24-bit
    factors), their difference too for nearby r, m, so fp32() rounds the exact value once."""
    x = fp32(r * c - fp32(m * c))
    return fp32(2.0 ** x)


def test_exp2_fma_known_answer_at_a_tie_whose_product_rounds():
    scale = 1 / math.sqrt(64)
    c = kernel_log2e_scale(scale)
    assert c == fp32(scale * math.log2(math.e))
    # m c is not an fp32 number: the FMA leaves its rounding error in the exponent. At a logit of
    # about 11 (m c = 16.5 in log2 units) that error, up to 2^-20, moves P̄ off 1 by an fp32 ulp or more;
    # at small logits (m c < 2) it is below half an ulp of 1 and P̄ rounds back to 1.
    m = fp32(91.37)
    assert m * c != fp32(m * c)
    steps = Exp2Steps("exp2_fma", scale, raw=True)
    x = float(steps.exponent(_f32(m), _f32(m)))
    assert x == m * c - fp32(m * c) != 0.0               # exactly the rounding error of m c
    p = float(steps.p(_f32(m), _f32(m)))
    assert p == _direct_fma_p(m, m, c) and p != 1.0      # the tied maximum's P̄ is not 1 in fp32 ...
    assert float(torch.tensor(p).bfloat16()) == 1.0      # ... but is 1 as the bf16 P̄·V operand
    # the unfused form (PyTorch's build) and the memory-efficient form give exactly 1 at the tie
    assert float(Exp2Steps("exp2_unfused", scale, raw=True).p(_f32(m), _f32(m))) == 1.0
    s = fp32(m * scale)
    assert float(Exp2Steps("exp2_log2e", scale, raw=True).p(_f32(s), _f32(s))) == 1.0


def test_exp2_fma_known_answer_where_the_product_is_exact():
    # the other way: m c exact in fp32 (m a power of two), so the tie's exponent is 0 and P̄ = 1
    scale = 1 / math.sqrt(64)
    c = kernel_log2e_scale(scale)
    m = 4.0
    assert m * c == fp32(m * c)
    steps = Exp2Steps("exp2_fma", scale, raw=True)
    assert float(steps.exponent(_f32(m), _f32(m))) == 0.0
    assert float(steps.p(_f32(m), _f32(m))) == 1.0
    # and below the maximum, each form against its direct fp64 computation
    for r in (3.5, fp32(2.718), fp32(-1.25)):
        assert float(steps.p(_f32(r), _f32(m))) == _direct_fma_p(r, m, c)
        want = fp32(2.0 ** fp32(fp32(r * c) - fp32(m * c)))
        assert float(Exp2Steps("exp2_unfused", scale, raw=True).p(_f32(r), _f32(m))) == want
        t, tm = fp32(r * LOG2E_F32), fp32(m * LOG2E_F32)
        assert float(Exp2Steps("exp2_log2e", scale, raw=False).p(_f32(r), _f32(m))) == fp32(2.0 ** fp32(t - tm))


def test_exp2_masked_and_empty_rows():
    steps = Exp2Steps("exp2_fma", 0.125, raw=True)
    inf = float("inf")
    assert float(steps.p(_f32(-inf), _f32(0.0))) == 0.0
    assert float(steps.rescale(_f32(-inf), _f32(3.0))) == 0.0
    assert float(steps.p_from_lse(_f32(1.0), _f32(inf))) == 0.0
    assert math.isnan(float(steps.p(_f32(float("nan")), _f32(0.0))))


def test_fa2_cuda_forward_known_answer_on_a_tied_row():
    # one query, two identical keys (a tie), V constant: O = fp32(2 v * fp32(1 / (2 P̄))) in bf16,
    # with P̄ = exp2(fma(m, c, -fp32(m c))) summed unrounded into l and 1 in the bf16 P̄·V operand
    d = 64
    scale = 1 / math.sqrt(d)
    q = torch.zeros(1, 1, 1, d)
    q[..., 0] = 8.0
    k = torch.zeros(1, 1, 2, d)
    k[..., 0] = 1.125                                    # raw score m = 9 (exact in bf16 and fp32)
    v = torch.full((1, 1, 2, d), -1.5)
    m = 9.0
    c = kernel_log2e_scale(scale)
    p = _direct_fma_p(m, m, c)
    want_o = float(torch.tensor(fp32(fp32(2 * -1.5) * fp32(1 / fp32(2 * p)))).bfloat16())
    o = flash_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), precision="fa2-cuda")
    assert torch.equal(o, torch.full_like(o, want_o))
    # its lse: fma(m, scale, log l) on the kernel's raw maximum
    from flashguard.attention.options import run_forward
    from flashguard.attention.trace import Arithmetic
    fwd = run_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), Arithmetic.of("fa2-cuda").options, causal=False,
                      scale=scale)
    log_l = float(torch.log(torch.tensor(fp32(2 * p), dtype=torch.float32)))
    assert float(fwd.lse) == fp32(m * fp32(scale) + log_l)


# --------------------------------------------------------------------------- the device comparison

def test_audit_tiles_and_kernels_cover_every_preset():
    assert set(audit.GPU_PRESET_TILES) == set(GPU_PRESETS) == set(audit.GPU_PRESET_KERNELS)
    labels = [a.label() for a in audit.gpu_preset_arithmetics()]
    assert "fa2-cuda / none 128x128" in labels and "mem-efficient / none 64x64" in labels


def test_ulp_distance():
    a = torch.tensor([1.0, -1.0, 0.0, 2.0]).bfloat16()
    nxt = torch.nextafter(a.float(), torch.tensor(float("inf"))).bfloat16()  # not adjacent in bf16: use bits
    b = (a.view(torch.int16) + torch.tensor([1, 1, 1, 0], dtype=torch.int16)).view(torch.bfloat16)
    assert audit.ulp_distance(a, b).tolist() == [1, 1, 1, 0]
    assert audit.ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])).tolist() == [0]
    assert nxt.dtype == torch.bfloat16


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal without a CUDA device")
def test_cuda_comparison_refuses_without_a_device():
    with pytest.raises(ValueError, match="no CUDA device"):
        audit.compare_gpu_presets()
    with pytest.raises(ValueError, match="--device cuda"):
        audit.run_audit([], device="cuda")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (compares the presets with the real kernels)")
def test_gpu_presets_against_the_real_kernels():
    rows = audit.compare_gpu_presets()
    measured = [r for r in rows if "error" not in r]
    assert measured, rows
    for r in measured:
        # not bit-exactness (ex2.approx, the MMA's accumulation order are not emulated): near it
        assert r["o"]["bit_exact"] > 0.9 and r["o"]["max_ulp"] <= 4, r


@pytest.mark.parametrize("name,field", [("torch-cpu", "exp=fexp_u20"), ("fa2-cuda", "exp=exp2_fma"),
                                        ("mem-efficient", "normalize=reciprocal")])
def test_the_triton_kernels_refuse_a_kernel_model_they_do_not_implement(name, field):
    """The Triton kernels compute exact exp, acc / l and the scale on dS's operand: a preset that
    models another kernel's steps is refused there (auto then runs the PyTorch kernel), not run
    silently with the Triton kernels' own steps."""
    from flashguard.attention.triton_flash import fa2_structured, triton_unsupported_settings
    assert field in fa2_structured(name) and "not fa2-structured" in triton_unsupported_settings(precision=name)
    assert fa2_structured("fa2") is None
