"""The lab: problems whose ties are exact and whose rows are independent, verdicts with a known
answer in each direction (the reference arithmetic leans, fp32 does not), the fix rules, the CLI."""
from __future__ import annotations

import json
import math

import pytest
import torch

from flashguard.attention.trace import Arithmetic
from flashguard.cli import main
from flashguard.experiments.lab import Bench, Problem, make_problem, run_lab
from flashguard.experiments.lab.experiments import judge_fix, verdict_over
from flashguard.experiments.lab.problems import half_ulp_bf16, tail_mass
from md_helpers import headings, numbers


@pytest.mark.parametrize("ties,t,tail", [(2, 512, 0.25), (8, 512, 4.0), (16, 1024, 0.25), (1, 128, 1.0)])
def test_problem_rows_have_exact_ties_and_the_asked_tail(ties, t, tail):
    p = Problem(ties=ties, t=t, tail=tail, n_rows=256, rows=16)
    q, k, v, do = make_problem(p)
    assert q.shape == (16, 1, 16, 64) and k.shape == (16, 1, t, 64) and do.shape == q.shape
    qb, kb = q.bfloat16(), k.bfloat16()
    s = (qb.float() @ kb.float().transpose(-2, -1))        # exact tie test on the bf16 inputs
    top = s.amax(-1, keepdim=True)
    assert ((s == top).sum(-1) == ties).all()             # every row: exactly `ties` keys at its max
    tm = tail_mass(qb, kb) / half_ulp_bf16(ties)
    assert 0.5 * tail < float(tm.median()) < 2.0 * tail
    # rows are independent: each row's maximum sits at keys of its own
    assert len({tuple(torch.nonzero(s[0, 0, i] == top[0, 0, i]).flatten().tolist()) for i in range(16)}) == 16


def test_problem_validation_and_units():
    with pytest.raises(ValueError, match="exceed t"):
        Problem(ties=8, t=64, rows=16)
    with pytest.raises(ValueError, match="ties must be"):
        Problem(ties=0)
    assert Problem().unit == "row" and Problem(sink=True).unit == "sequence"
    q, k, _, _ = make_problem(Problem(sink=True, ties=3, rows=8, n_rows=32))
    s = q.double() @ k.double().transpose(-2, -1)
    assert (s[..., :3] == s.amax(-1, keepdim=True)).all()  # the sink keys are every row's maximum
    p = Problem(offset=100.0, n_rows=64)
    assert math.isclose(p.max_logit, Problem(n_rows=64).max_logit)


@pytest.fixture(scope="module")
def bench():
    return Bench()


def test_known_answers_in_both_directions(bench):
    p = Problem(ties=8, tail=0.25, n_rows=1024)
    paper = bench.measure(p, Arithmetic.of("paper"))
    assert paper.o_vs_floor.verdict == "biased -" and paper.delta_vs_floor.verdict == "biased +"
    assert paper.o_vs_floor.unit == "row" and paper.o_vs_floor.n == 1024
    assert paper.multi_one == 1.0 and paper.tie_rate == 1.0
    fp32 = bench.measure(p, Arithmetic.of("fp32[inputs=bf16,output=bf16]"))
    assert fp32.o_vs_floor.verdict == "no bias" and fp32.delta_vs_floor.verdict == "no bias"
    flipped = bench.measure(Problem(ties=8, tail=0.25, n_rows=1024, v_mean=1.0, do_mean=0.5), Arithmetic.of("paper"))
    assert flipped.o_vs_floor.verdict == "biased +"   # V mostly positive: the sign flips


def test_fix_rules(bench):
    p = Problem(ties=8, tail=0.25, n_rows=1024)
    plain = bench.measure(p, Arithmetic.of("paper"))
    assert judge_fix(plain, bench.measure(p, Arithmetic.of("paper-fp32fwd"))) == (True, "")
    ok, why = judge_fix(plain, bench.measure(p, Arithmetic.of("paper", "safe")))
    assert not ok and "still leans" in why
    # in production arithmetic there is nothing to fix, and safe's shift costs accuracy
    fa2 = bench.measure(p, Arithmetic.of("fa2"))
    assert fa2.o_vs_floor.verdict == "no bias"
    ok, why = judge_fix(fa2, bench.measure(p, Arithmetic.of("fa2", "safe")))
    assert not ok and "less accurate" in why
    assert judge_fix(fa2, bench.measure(p, Arithmetic.of("fa2[row_sum_rounded=true]")))[0]
    # the study's fix with beta = 7 pushes the row sum under the reference code's 1e-10 floor
    ok, why = judge_fix(plain, bench.measure(p, Arithmetic.of("paper", "paper:beta=7")))
    assert not ok


def test_verdict_over_conditions():
    assert verdict_over({"a": True, "b": True}) == "held"
    assert verdict_over({"a": False, "b": False}) == "not held"
    assert verdict_over({"a": True, "b": False}) == "partly held"
    assert verdict_over({}) == "inconclusive"


@pytest.fixture(scope="module")
def labs():
    return {pol: run_lab(quick=True, precision=pol, n_rows=256) for pol in ("paper", "fp32")}


def test_lab_verdicts_follow_from_the_computation(labs):
    paper, fp32 = labs["paper"]["verdicts"], labs["fp32"]["verdicts"]
    assert paper["iv_worked_example"] == "held" and fp32["iv_worked_example"] == "not held"
    assert fp32["i_tie_bias"] == "not held" and fp32["ii_no_ties_no_bias"] == "held"
    assert fp32["iii_paper_fix_beta2"] == "inconclusive"    # nothing to remove
    assert paper["i_tie_bias"] in ("held", "partly held")
    answers = labs["paper"]["answers"]
    assert answers["paper"]["biased_conditions"] and answers["fa2"]["biased_conditions"] == []
    # the printed answer: yes with the count of leaning conditions, or no
    paper_says, fa2_says = (answers[p]["line"].split(";")[0] for p in ("paper", "fa2"))
    assert paper_says.split(": ")[-1].startswith("yes") and fa2_says.split(": ")[-1] == "no"
    assert numbers(paper_says)[0] == len(answers["paper"]["biased_conditions"])
    assert "paper / safe" in answers["paper"]["failures"]


def test_lab_cli_writes_json_md_and_figures(tmp_path, monkeypatch, capsys):
    import flashguard.experiments.lab as lab_pkg
    real = lab_pkg.run_lab
    monkeypatch.setattr(lab_pkg, "run_lab", lambda **kw: real(**{**kw, "n_rows": 128}))
    assert main(["lab", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    data = json.loads((tmp_path / "lab.json").read_text())
    assert {"paper", "fa2"} <= set(data["answers"])   # a line per arithmetic: its answer
    assert all(f"{pol}: {answer['line']}" in out for pol, answer in data["answers"].items())
    assert set(data["verdicts"]) == {"i_tie_bias", "ii_no_ties_no_bias", "iii_paper_fix_beta2",
                                     "iii_paper_fix_beta7", "iv_worked_example"}
    assert {"condition", "arithmetic", "o", "delta", "o_vs_floor", "delta_vs_floor"} <= set(data["rows"][0])
    assert data["rows"][0]["o_vs_floor"]["unit"] == "row"
    md = (tmp_path / "lab.md").read_text()
    assert "Verdicts" in headings(md) and "PR #2721" in md and data["unit_note"].split(" (")[0] in md   # the unit
    for name in ("bias_vs_k", "bias_vs_format"):
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_fp8_lean_is_the_row_sum_mismatch_and_the_consistent_sum_removes_it(bench):
    # known answers in both directions in fp8: without the fix the arithmetic's own O (before its one
    # rounding) leans by about the tail mass the PV operand rounds away; with l summed from the same
    # rounded Pbar it does not
    from flashguard.experiments.lab.experiments import unrounded_output
    p = Problem(ties=2, tail=0.25, n_rows=1024)
    plain = bench.measure(p, Arithmetic.of(unrounded_output("fa2-e4m3")))
    fixed = bench.measure(p, Arithmetic.of(unrounded_output("fa2-e4m3[row_sum_rounded=true]")))
    assert plain.o_leans and plain.o.mean > 0 and plain.delta_leans
    assert not fixed.leans and judge_fix(plain, fixed) == (True, "")


def test_differing_from_the_floor_is_not_a_lean(bench):
    # fp8 with the consistent row sum, no ties: its O differs from the floor's at |z| > 10 because the
    # floor's own rounding of O leans, while its own error against fp64 has no lean
    m = bench.measure(Problem(ties=1, tail=0.25, n_rows=1024), Arithmetic.of("fa2-e4m3[row_sum_rounded=true]"))
    assert m.o_vs_floor.biased and abs(m.o_vs_floor.z) > 10 and m.o_floor.biased
    assert not m.o.biased and not m.o_leans
