"""Pbar scaled into the fp8 range before its rounding (``PrecisionPolicy.pbar_scale``) and the
fp8 presets that use it (``fa2-e4m3-pscaled``, ``fa2-e5m2-pscaled``)."""
import pytest
import torch

from flashguard.attention.flash import pbar_operand
from flashguard.attention.trace import Arithmetic, trace
from flashguard.experiments.lab.captured import CapturedProblem
from flashguard.experiments.lab.measure import Bench
from flashguard.numerics import get_policy
from flashguard.numerics.formats import FORMATS
from flashguard.numerics.policy import POLICIES, largest_pbar_scale


@pytest.mark.parametrize("fmt, want", [("e4m3", 8), ("e5m2", 15), ("fp16", 15), ("bf16", 127), ("fp32", 127),
                                       ("fp64", 1023)])
def test_largest_scale_keeps_a_pbar_of_one_finite(fmt, want):
    f = FORMATS[fmt]
    assert largest_pbar_scale(f) == want
    assert 2.0 ** want < f.max_finite and f.max_finite / 2.0 ** want <= 4  # (fp64: 2^1025 overflows)


def test_presets_are_the_fp8_policies_with_a_scaled_e4m3_pbar_and_the_consistent_row_sum():
    for fmt in ("e4m3", "e5m2"):
        fixed = POLICIES[f"fa2-{fmt}-pscaled"]
        assert fixed == POLICIES[f"fa2-{fmt}"].replace(name=fixed.name, pbar="e4m3", row_sum_rounded=True,
                                                       pbar_scale=8)
        assert fixed.inputs.name == fmt  # the inputs (and dS) keep their format


@pytest.mark.parametrize("text, needle", [("fa2-e4m3[pbar_scale=9]", "at most 8"),
                                          ("fa2-e5m2[pbar_scale=16]", "at most 15"),
                                          ("fa2[pbar_scale=-1]", "int >= 0"),
                                          ("fa2[pbar_scale=two]", "must be an integer")])
def test_a_bad_scale_is_refused_by_name(text, needle):
    with pytest.raises(ValueError, match="pbar_scale") as e:
        get_policy(text)
    assert needle in str(e.value)


def test_scaling_keeps_the_probabilities_plain_rounding_flushes():
    p = torch.tensor([1.0, 2.0 ** -8, 2.0 ** -11, 2.0 ** -14, 3e-5])
    plain = pbar_operand(p, get_policy("fa2-e4m3"))
    scaled = pbar_operand(p, get_policy("fa2-e4m3-pscaled"))
    # e4m3's smallest subnormal is 2^-9: below half of it the plain rounding gives 0
    assert plain.tolist()[:4] == [1.0, 2.0 ** -8, 0.0, 0.0] and plain[4] == 0
    # scaled by 2^8 every one is representable (2^-14 * 2^8 = 2^-6, e4m3's smallest normal)
    assert scaled.tolist()[:4] == [1.0, 2.0 ** -8, 2.0 ** -11, 2.0 ** -14]
    assert abs(float(scaled[4]) - 3e-5) / 3e-5 < 2.0 ** -3


def test_scaling_changes_nothing_where_the_format_has_the_range():
    """A power-of-two scale is exact: with a bf16 or fp32 Pbar, O and the gradients are the same
    bits at any scale (scores of a normal range, no subnormal Pbar)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 97, 59, generator=g) for _ in range(4))
    for name in ("fa2", "fp32"):
        a, b = (trace(q, k, v, do, Arithmetic.of(get_policy(name).replace(pbar_scale=s), block_q=64, block_k=32),
                      causal=True) for s in (0, 11))
        for x, y in ((a.o, b.o), (a.dq, b.dq), (a.dk, b.dk), (a.dv, b.dv)):
            assert torch.equal(x, y), name


def _tail_problem(units: int = 384, tail: int = 48) -> CapturedProblem:
    """Independent rows (one query per sequence and head) with one dominant key (score 0, V near 0)
    and a tail of keys whose probabilities, 2e-4 .. 9e-4, all lie below half of e4m3's smallest
    subnormal, with V near +1: the plain fp8 rounding drops the tail's weight from the numerator."""
    g = torch.Generator().manual_seed(3)
    D = 8
    q = torch.zeros(units, 1, 1, D)
    q[..., 0] = 1.0
    k = torch.zeros(units, 1, tail + 1, D)
    k[:, :, 1:, 0] = -(7.0 + 1.5 * torch.rand(units, 1, tail, generator=g))  # scores -7 .. -8.5
    v = torch.randn(units, 1, tail + 1, D, generator=g) * 0.25
    v[:, :, 1:] += 1.0
    do = torch.randn(units, 1, 1, D, generator=g)
    return CapturedProblem("fp8 tail", q, k, v, do, causal=False, scale=1.0)


def test_the_scaled_pbar_removes_the_lean_of_the_flushed_tail():
    """Known answers both ways, by the lab's one lean rule: the plain fp8 arithmetic, and the
    consistent row sum alone, lean (O too small: the tail is lost); the scaled Pbar does not."""
    p, bench = _tail_problem(), Bench()
    fp32_inputs = "[inputs=fp32]"  # inputs kept exact, so that the scores are the planted ones
    plain = bench.measure(p, Arithmetic.of(get_policy("fa2-e4m3" + fp32_inputs)))
    rowsum = bench.measure(p, Arithmetic.of(get_policy("fa2-e4m3[inputs=fp32,row_sum_rounded=true]")))
    fixed = bench.measure(p, Arithmetic.of(get_policy("fa2-e4m3-pscaled" + fp32_inputs)))
    for m in (plain, rowsum):
        assert m.o_leans and m.o.mean < 0 and m.o.z < -10
    assert not fixed.o_leans
    assert abs(fixed.o.mean) < abs(plain.o.mean) / 20
    assert fixed.o_mae < plain.o_mae


def test_the_triton_kernels_refuse_a_scaled_pbar_by_name():
    from flashguard.attention.triton_flash import fa2_structured
    assert fa2_structured(get_policy("fa2")) is None
    assert "pbar_scale=3" in fa2_structured(get_policy("fa2[pbar_scale=3]"))


def test_the_lab_tries_the_scaled_pbar_on_fp8_only_and_files_it_under_its_arithmetic():
    from flashguard.experiments.lab.candidates import fix_candidates, fix_family
    for fmt in ("e4m3", "e5m2"):
        labels = [a.label() for a in fix_candidates(f"fa2-{fmt}")]
        # the preset first: an answer names its first remover, and the row sum alone leans on real inputs
        assert labels.index(f"fa2-{fmt}-pscaled / none") < labels.index(f"fa2-{fmt}[row_sum_rounded=True] / none")
        assert fix_family(f"fa2-{fmt}") == {f"fa2-{fmt}", f"fa2-{fmt}-pscaled"}
    for pol in ("fa2", "fa2-fp16", "paper"):
        assert not any(a.precision.pbar_scale for a in fix_candidates(pol))
    assert fix_family("paper") == {"paper", "paper-fp32fwd"}
    # a policy already scaled, with the consistent row sum, is offered stabilizers only
    assert [a.stabilizer.name for a in fix_candidates("fa2-e4m3-pscaled")] == ["paper", "paper", "safe"]


@pytest.mark.parametrize("fmt, s", [("e4m3", 8), ("e5m2", 15), ("e4m3", 3)])
def test_the_one_pass_rounding_is_the_scaled_rounding_bit_for_bit(fmt, s):
    """pbar_operand rounds an emulated Pbar once, to the format with its bias raised by s; that is
    the rounding of P * 2^s multiplied back, for every P: grid points, midpoints, the subnormal
    range, zero, one."""
    from flashguard.attention import flash
    from flashguard.numerics.arith import cast
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(1)
    p = torch.cat([torch.rand(200_000, generator=g), torch.rand(200_000, generator=g) * 2.0 ** -(s + 8),
                   torch.exp(-30 * torch.rand(200_000, generator=g)), torch.tensor([0.0, 1.0])])
    grid = torch.tensor(sorted({x for x in (f.min_subnormal * 2.0 ** -s * i for i in range(1, 4096)) if x <= 1}))
    p = torch.cat([p, grid, (grid[1:] + grid[:-1]) / 2])  # representable values and the ties between them
    policy = get_policy(f"fa2-{fmt}").replace(pbar_scale=s)
    three_pass = cast(p * 2.0 ** s, f) * 2.0 ** -s
    assert torch.equal(flash.pbar_operand(p, policy), three_pass)
