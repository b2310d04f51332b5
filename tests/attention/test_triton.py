"""The fused Triton flash attention (flashguard.attention.triton_flash).

Without a GPU the kernels run in Triton's CPU interpreter. TRITON_INTERPRET=1 must be in the
environment before triton is first imported (checked with triton 3.6 and 3.9: ``@triton.jit``
reads it when it decorates a function, and triton's own library functions - ``tl.sum``,
``tl.max`` - are decorated at ``import triton``; set later, the kernels fail with "Cannot call
@triton.jit'd outside of the scope of a kernel"). So tests/conftest.py sets it when there is no
CUDA, and this module sets it again at its top, before its first triton import; flashguard
itself never imports triton before the kernels are used. With CUDA and TRITON_INTERPRET unset
(benchmarks/gpu_check.sh) the same tests run the compiled kernels on the GPU, plus the
GPU-only tests at the end. ``test_kernels_compile_for_sm90`` compiles the kernels for a Hopper
GPU here (in a subprocess without the interpreter): the checks the interpreter skips.

Interpreter support by dtype (triton 3.9.0): fp32 and fp16 run as on a GPU. bf16 does not:
its ``tl.dot`` multiplies the raw bit patterns (triton-lang/triton#11584, "not supported
yet") and its fp32 -> bf16 conversion truncates instead of rounding to nearest. The kernels
work around both under the interpreter (constexprs ``F32_DOT``: bf16 operands converted to
fp32 exactly before the dot; ``BF16_RNE``: round-to-nearest-even done on the bits before the
conversion), so bf16 is tested here too, but the bf16 ``tl.dot`` itself only on a GPU.

Tolerances are relative to what the PyTorch implementation with the same arithmetic
(``flash_attention(..., precision="fa2" / "fa2-fp16" / "fp32")``, same tiles) achieves
against the fp64 reference on the same inputs.
"""
import os
import sys

import pytest
import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated (see the docstring)

triton = pytest.importorskip("triton")
if not ON_GPU and tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 8):
    # seen with triton 3.6 and numpy 2.4: its interpreter turns a loop bound computed from
    # program_id into an int with int(1-element array), which numpy refuses ("only 0-dimensional
    # arrays can be converted to Python scalars"); fixed in 3.8 (.squeeze())
    pytest.skip(f"triton {triton.__version__}'s interpreter cannot run these kernels (needs >= 3.8)",
                allow_module_level=True)

from flashguard.attention import flash_attention, override_sdpa, reference_attention  # noqa: E402
from flashguard.attention.flash import flash_forward  # noqa: E402
from flashguard.attention.stabilizers import SAFE_DELTA_MIN, PaperStabilizer, Stabilizer, get_stabilizer  # noqa: E402
from flashguard.attention.triton_flash import triton_flash_attention, triton_forward  # noqa: E402
from flashguard.numerics.policy import get_policy  # noqa: E402
from flashguard.attention import _triton_kernels  # noqa: E402  (raises if triton's mode is mixed)

assert _triton_kernels.INTERPRETED == (not ON_GPU), "triton was imported before TRITON_INTERPRET was set"

DEVICE = "cuda" if ON_GPU else "cpu"
PRESET = {torch.float32: "fp32", torch.float16: "fa2-fp16", torch.bfloat16: "fa2"}
TILE = 32  # forward tiles of both implementations (the stabilizers' decisions depend on them)
STABS = ["none", "paper", "safe"]


def _inputs(B, H, Tq, Tk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, t, D, generator=g).to(dtype).to(DEVICE) for t in (Tq, Tk, Tk, Tq))
    return q, k, v, do


def _run(fn, q, k, v, do):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def _errors(outs, refs):
    """max |x - ref| / max |ref| for O, dQ, dK, dV."""
    return [((x.double() - r).abs().max() / r.abs().max()).item() for x, r in zip(outs, refs)]


def _check_against_reference(q, k, v, do, causal, stabilizer, floor):
    ref = _run(lambda a, b, c: reference_attention(a, b, c, is_causal=causal), q.double(), k.double(), v.double(),
               do.double())
    tri = _run(lambda a, b, c: triton_flash_attention(a, b, c, is_causal=causal, stabilizer=stabilizer,
                                                      block_m=TILE, block_n=TILE), q, k, v, do)
    pt = _run(lambda a, b, c: flash_attention(a, b, c, is_causal=causal, stabilizer=stabilizer,
                                              precision=PRESET[q.dtype], block_q=TILE, block_k=TILE,
                                              kernel="pytorch"), q, k, v, do)
    assert tri[0].dtype == q.dtype and tri[0].shape == ref[0].shape
    assert all(torch.isfinite(t).all() for t in tri)
    e_tri, e_pt = _errors(tri, ref), _errors(pt, ref)
    for name, a, b in zip(("O", "dQ", "dK", "dV"), e_tri, e_pt):
        assert a <= 2.0 * b + floor, f"{name}: triton error {a:.3g} vs pytorch fa2 path {b:.3g}"
    return tri


FLOOR = {torch.float32: 2e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("stabilizer", STABS)
def test_matches_reference_t97_d59(dtype, causal, stabilizer):
    """T = 97 (a partial last tile), head dim 59 (padded to 64); causal: the first row sees one
    key, and rows at the top of each query tile are fully hidden in the diagonal key tile."""
    q, k, v, do = _inputs(1, 2, 97, 97, 59, dtype)
    _check_against_reference(q, k, v, do, causal, stabilizer, FLOOR[dtype])


@pytest.mark.parametrize("tq,tk", [(40, 97), (97, 33)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_matches_reference_tq_ne_tk(tq, tk, causal):
    q, k, v, do = _inputs(2, 1, tq, tk, 59, torch.bfloat16, seed=1)
    _check_against_reference(q, k, v, do, causal, "safe", FLOOR[torch.bfloat16])


def test_value_head_dim_and_fp32_api_inputs():
    """D_v != D, and fp32 tensors through flash_attention(precision="fa2", kernel="triton"):
    rounded to bf16 inside, gradients returned in fp32 as the pytorch path returns them."""
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(1, 2, 50, 24, generator=g).to(DEVICE) for _ in range(2))
    v = torch.randn(1, 2, 50, 40, generator=g).to(DEVICE)
    do = torch.randn(1, 2, 50, 40, generator=g).to(DEVICE)
    kw = dict(is_causal=True, precision="fa2", block_q=TILE, block_k=TILE)
    tri = _run(lambda a, b, c: flash_attention(a, b, c, kernel="triton", **kw), q, k, v, do)
    pt = _run(lambda a, b, c: flash_attention(a, b, c, kernel="pytorch", **kw), q, k, v, do)
    for a, b in zip(tri, pt):
        assert a.dtype == torch.float32 and a.shape == b.shape
        assert ((a - b).abs().max() / b.abs().max()).item() < 2e-2


def test_strided_inputs():
    """A GPT's layout, (B, T, H, D).transpose(1, 2) slices of one qkv tensor, runs on its
    strides (no copies): the same output and gradients as contiguous inputs."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(2, 45, 3, 3, 24, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_()  # (B, T, 3, H, D)
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))                                     # (B, H, T, D)
    assert not q.is_contiguous() and q.stride(-1) == 1
    do = torch.randn(2, 3, 45, 24, generator=g).to(torch.bfloat16).to(DEVICE)
    fn = lambda a, b, c: triton_flash_attention(a, b, c, is_causal=True, block_m=TILE, block_n=TILE)  # noqa: E731
    o = fn(q, k, v)
    (gx,) = torch.autograd.grad(o, (x,), do)
    expect = _run(fn, q.contiguous(), k.contiguous(), v.contiguous(), do)
    assert torch.equal(o, expect[0])
    for i in range(3):
        assert torch.equal(gx[:, :, i].transpose(1, 2), expect[1 + i])


def test_row_sum_rounded():
    q, k, v, do = _inputs(1, 1, 64, 64, 32, torch.bfloat16, seed=3)
    pol = get_policy("fa2[row_sum_rounded=true]")
    ref = reference_attention(q.double(), k.double(), v.double())
    out = {}
    for kernel in ("triton", "pytorch"):
        out[kernel] = flash_attention(q, k, v, precision=pol, block_q=TILE, block_k=TILE, kernel=kernel)
    e_tri, e_pt = ((o.double() - ref).abs().max().item() for o in (out["triton"], out["pytorch"]))
    assert e_tri <= 2 * e_pt + 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_stabilizers_agree(dtype):
    """Softmax is shift-invariant: the three stabilizers give one O (to rounding)."""
    q, k, v, _ = _inputs(1, 2, 97, 97, 59, dtype, seed=4)
    q = q * 3  # larger scores: the shifts differ more
    outs = {s: triton_flash_attention(q, k, v, is_causal=True, stabilizer=s, block_m=TILE, block_n=TILE)
            for s in STABS}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for s in ("paper", "safe"):
        diff = (outs[s].double() - outs["none"].double()).abs().max().item()
        assert diff <= tol * outs["none"].abs().max().item(), (s, diff)


def _integer_inputs(B, H, T, D, dtype, seed):
    """q, k with entries in {-2, ..., 2}: with scale 1/8 every score is exact in any order."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randint(-2, 3, (B, H, T, D), generator=g).to(dtype).to(DEVICE) for _ in range(2))
    return q, k, torch.randn(B, H, T, D, generator=g).to(dtype).to(DEVICE)


def _pytorch_shift(q, k, v, causal, stab, block):
    """The final running shift m of each row in the pytorch implementation (fa2 arithmetic)."""
    last = {}

    def observe(tile, m_new, **_):
        last[tile[:2]] = m_new

    flash_forward(q, k, v, keep=None, bias=None, causal=causal, scale=0.125, policy=get_policy(PRESET[q.dtype]),
                  stabilizer=stab, block_q=block, block_k=block, observe=observe)
    return torch.cat([last[key] for key in sorted(last)], dim=-2)[..., 0]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_shift_paper_fallback_and_safe_bitwise(causal):
    """Duplicate keys make every tile row's maximum a tie, so ``paper`` takes its fallback in
    every tile (m = beta * r for r > 0, 0 for r < 0); ``safe`` adds its dithered margin rounded
    up. Scores are exact (small integers times 1/8), so the shift m of every row must equal
    the pytorch implementation's bit for bit, for each stabilizer."""
    B, H, T, D = 1, 2, 97, 59
    q, k, v = _integer_inputs(B, H, T, D, torch.bfloat16, seed=5)
    k = k[..., ::2, :].repeat_interleave(2, dim=-2)[..., :T, :]  # keys 2j and 2j + 1 equal
    k[..., 0] = 2
    q[..., 3, :] = 0
    q[..., 3, 0] = -1  # row 3 scores -1/4 everywhere: a negative tied maximum
    shifts = {}
    for name in STABS:
        stab = get_stabilizer(name)
        o, lse, m = triton_forward(q, k, v, causal=causal, scale=0.125, stabilizer=stab, block_m=TILE,
                                   block_n=TILE, return_m=True)
        expect = _pytorch_shift(q, k, v, causal, stab, TILE)
        assert torch.equal(m, expect), f"{name}: shift differs from the pytorch implementation's"
        shifts[name] = m
    s = (q.float() @ k.float().transpose(-2, -1)) * 0.125
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    row_max = s.amax(-1)
    assert torch.equal(shifts["none"], row_max)
    # the fallback fired (beta * r for r > 0, 0 for r < 0) in most rows
    assert (shifts["paper"] > row_max).double().mean() > 0.5
    assert ((row_max > 0) & (shifts["paper"] >= 2 * row_max)).any()
    assert ((row_max < 0) & (shifts["paper"] == 0)).any()
    # safe: m - max in [ln2/2, ln2), up to one fp32 step upward
    gap = shifts["safe"].double() - row_max.double()
    assert (gap >= SAFE_DELTA_MIN).all() and (gap < 2 * SAFE_DELTA_MIN + 1e-6 * row_max.abs().double()).all()


def test_paper_options_and_tol():
    """beta and tol reach the kernel: with tol = 0 distinct maxima are not ties."""
    q, k, v = _integer_inputs(1, 1, 64, 32, torch.float32, seed=6)
    for stab in (PaperStabilizer(beta=7.0, tol=0.0), PaperStabilizer(beta=3.0, tol=10.0)):
        _, _, m = triton_forward(q, k, v, causal=False, scale=0.125, stabilizer=stab, block_m=TILE, block_n=TILE,
                                 return_m=True)
        assert torch.equal(m, _pytorch_shift(q, k, v, False, stab, TILE))


class _MyStab(Stabilizer):
    name = "mine"

    def shift(self, s, row_max, policy):
        return row_max


@pytest.mark.parametrize("kwargs,feature", [
    (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), "attn_mask"),
    (dict(softcap=30.0), "softcap"),
    (dict(precision="paper"), "not fa2-structured"),
    (dict(precision="fa2-e4m3"), "inputs format e4m3"),
    (dict(precision="fa2[delta_source=o_highp]"), "delta_source=o_highp"),
    (dict(stabilizer=_MyStab()), "stabilizer _MyStab"),
])
def test_unsupported_features_raise(kwargs, feature):
    q = torch.randn(1, 1, 8, 16, device=DEVICE)
    if "attn_mask" in kwargs:
        kwargs = dict(kwargs, attn_mask=kwargs["attn_mask"].to(DEVICE))
    with pytest.raises(NotImplementedError, match=feature):
        flash_attention(q, q, q, kernel="triton", **kwargs)
    # auto falls back to the pytorch implementation instead
    assert torch.isfinite(flash_attention(q, q, q, **kwargs)).all()


def test_bad_arguments():
    q = torch.randn(1, 1, 8, 160, device=DEVICE)
    with pytest.raises(NotImplementedError, match="head dim 160"):
        triton_flash_attention(q, q, q)
    q = torch.randn(1, 1, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match="block_m"):
        triton_flash_attention(q, q, q, block_m=48)
    with pytest.raises(ValueError, match="block_q"):
        flash_attention(q, q, q, block_q=48, kernel="triton")
    with pytest.raises(NotImplementedError, match="float64"):
        triton_flash_attention(q.double(), q.double(), q.double())


def test_override_sdpa_triton_kernel():
    import torch.nn.functional as F

    q, k, v, _ = _inputs(1, 2, 40, 40, 16, torch.float16, seed=7)
    with override_sdpa(precision="fa2-fp16", stabilizer="safe", kernel="triton", block_q=TILE, block_k=TILE):
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expect = triton_flash_attention(q, k, v, is_causal=True, stabilizer="safe", block_m=TILE, block_n=TILE)
    assert torch.equal(o, expect)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_keeps_the_pytorch_paths_bits(p):
    """q = 0 (uniform attention) and v = identity put P_ij * Z_ij in O[i, j]: the kernels' kept
    entries are exactly attention.dropout's mask for the seed they drew."""
    from flashguard.attention.dropout import draw_seed, dropout_keep_mask

    B, H, T = 2, 2, 48
    q = torch.zeros(B, H, T, 16, device=DEVICE)
    v = torch.eye(T, device=DEVICE).expand(B, H, T, T).contiguous()
    torch.manual_seed(3)
    seed = draw_seed()
    torch.manual_seed(3)
    o = flash_attention(q, q, v, precision="fp32", kernel="triton", dropout_p=p)
    assert torch.equal((o != 0).cpu(), dropout_keep_mask(seed, p, B, H, T, T))
    torch.testing.assert_close(o[o != 0], torch.full_like(o[o != 0], 1 / (T * (1 - p))), rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_dropout_forward_and_backward_match_the_pytorch_path(dtype, causal):
    """Same seed, same mask: O and the gradients agree with the PyTorch tiles with the same
    arithmetic (fp32: to fp32 rounding; bf16: to the bf16 operands' rounding of two different
    accumulation orders)."""
    q, k, v, do = _inputs(1, 2, 40, 40, 16, dtype, seed=4)
    outs = []
    for kernel in ("triton", "pytorch"):
        torch.manual_seed(8)
        outs.append(_run(lambda a, b, c: flash_attention(a, b, c, is_causal=causal, precision=PRESET[dtype],
                                                         kernel=kernel, dropout_p=0.3, block_q=TILE,
                                                         block_k=TILE), q, k, v, do))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(*outs):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.abs().max().item())


# --------------------------------------------------------------------------------------------
# compiled for a Hopper GPU (sm_90) without one: Triton's own front end, optimizer and ptxas
# run here, which the interpreter skips (type errors, constexpr scoping, shared memory)

def test_kernels_compile_for_sm90():
    """tools/triton_compile_check.py --quick, in a subprocess: compiling needs TRITON_INTERPRET
    unset before triton is imported, and this process imported it for the interpreter."""
    import subprocess
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(root / "tools" / "triton_compile_check.py"), "--quick"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "0 failed" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


# --------------------------------------------------------------------------------------------
# GPU only: the compiled kernels at realistic sizes

gpu = pytest.mark.skipif(not ON_GPU, reason="needs CUDA (and TRITON_INTERPRET unset)")


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gpu_bf16_realistic(d, causal):
    q, k, v, do = _inputs(2, 4, 1024, 1024, d, torch.bfloat16, seed=8)
    ref = _run(lambda a, b, c: reference_attention(a, b, c, is_causal=causal), q.double(), k.double(), v.double(),
               do.double())
    for stab in STABS:
        tri = _run(lambda a, b, c: triton_flash_attention(a, b, c, is_causal=causal, stabilizer=stab), q, k, v, do)
        sdpa = _run(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal),
                    q, k, v, do)
        e_tri, e_sdpa = _errors(tri, ref), _errors(sdpa, ref)
        for name, a, b in zip(("O", "dQ", "dK", "dV"), e_tri, e_sdpa):
            assert a <= 3.0 * b + 2e-3, f"{stab} {name}: triton {a:.3g} vs torch sdpa {b:.3g}"


@gpu
def test_gpu_auto_kernel_is_triton():
    from flashguard.attention import choose_kernel

    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    assert choose_kernel(q, q, q) == "triton"
    assert choose_kernel(q, q, q, precision="paper") == "pytorch"
    assert choose_kernel(q, q, q, softcap=30.0) == "pytorch"


@gpu
def test_gpu_speed_against_pytorch_path():
    """The fused kernels must be far faster than the tiled PyTorch implementation."""
    q, k, v, do = _inputs(4, 16, 2048, 2048, 64, torch.bfloat16, seed=9)

    def timed(fn, reps=5):
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps

    t_tri = timed(lambda: _run(lambda a, b, c: triton_flash_attention(a, b, c, is_causal=True), q, k, v, do))
    t_pt = timed(lambda: _run(lambda a, b, c: flash_attention(a, b, c, is_causal=True, kernel="pytorch",
                                                              block_q=128, block_k=128), q, k, v, do), reps=2)
    print(f"fwd+bwd T=2048: triton {t_tri:.2f} ms, pytorch tiles {t_pt:.2f} ms")
    assert t_tri * 5 < t_pt
