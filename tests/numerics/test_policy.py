from __future__ import annotations

import pytest

from flashguard.numerics import BF16, E4M3, FP32, POLICIES, PrecisionPolicy, get_policy


def test_presets_have_the_documented_structure():
    paper, fa2 = get_policy("paper"), get_policy("fa2")
    # the reference code: every tensor bf16, including accumulators and statistics
    assert {paper.scores, paper.stats, paper.o_accum, paper.lse, paper.grad_accum, paper.delta} == {BF16}
    assert paper.row_sum_floor == 1e-10 and paper.visit_masked_tiles and paper.masked_scores == "finite"
    # production kernels: bf16 only at the inputs, the Pbar / dS operands and the output
    assert fa2.inputs == fa2.pbar == fa2.ds == fa2.output == BF16
    assert {fa2.scores, fa2.stats, fa2.pv, fa2.o_accum, fa2.lse, fa2.p, fa2.dp, fa2.delta, fa2.grad_accum} == {FP32}
    assert not fa2.row_sum_rounded  # the PR #2721 bias: l sums the unrounded Pbar
    e4m3 = get_policy("fa2-e4m3")
    assert e4m3.inputs == e4m3.pbar == E4M3 and e4m3.output == BF16
    fp32 = get_policy("fp32")
    assert all(getattr(fp32, f) == FP32 for f in ("inputs", "scores", "pbar", "output", "ds", "grad_accum"))
    assert set(POLICIES) >= {"fp32", "paper", "fa2", "fa2-fp16", "fa2-e4m3", "fa2-e5m2"}


def test_user_policies_replace_and_describe_themselves():
    ablation = get_policy("paper").replace(delta_source="dp_p")
    assert ablation.short_str() == "paper[delta_source=dp_p]"
    assert get_policy("paper").short_str() == "paper"
    pv32 = get_policy("paper").replace(pv="fp32", name="paper-pv32")
    assert pv32.pv == FP32 and pv32.name == "paper-pv32"
    assert PrecisionPolicy(**get_policy("fa2-e5m2").to_dict()) == get_policy("fa2-e5m2")
    custom = PrecisionPolicy(name="e3m2-pbar", pbar="e3m2")
    assert custom.pbar.mantissa_bits == 2 and "e3m2" in custom.short_str()


def test_policies_are_frozen():
    with pytest.raises(Exception):
        get_policy("fa2").scores = BF16


def test_policy_strings_round_trip_through_short_str():
    p = get_policy("paper[pv=e8m4, o_accum=e8m4,rounding=stochastic,row_sum_floor=none,visit_masked_tiles=false]")
    assert p.pv.mantissa_bits == 4 and p.rounding == "stochastic" and p.row_sum_floor is None
    assert not p.visit_masked_tiles
    assert get_policy(p.short_str()) == p
    for bad in ["paper[pv]", "paper[colour=red]", "nope[pv=fp32]", "paper[pv=e8m99]", "paper[row_sum_rounded=maybe]"]:
        with pytest.raises(ValueError):
            get_policy(bad)
