"""The README's main job: it runs, and its numbers come from the computation."""
from __future__ import annotations

from flashguard.cli import main
from flashguard.experiments.showcase import measure, tied_problem


def test_showcase_runs_and_shows_the_bias(capsys):
    assert main(["showcase"]) == 0
    out = capsys.readouterr().out
    assert "-4.71875" in out and "bias ratio" in out


def test_tie_bias_appears_in_paper_arithmetic_and_not_in_fp32():
    q, k, v = tied_problem(n=16, t=128)
    paper = measure(q, k, v, "paper", "none")
    fp32 = measure(q, k, v, "fp32", "none")
    fixed = measure(q, k, v, "paper", "safe")
    assert paper.pbar_one > 0 and fixed.pbar_one == 0
    assert paper.verdict == "biased" and paper.bias_ratio < -0.2
    assert fp32.verdict == "no clear bias" and abs(fp32.mean_err) < 1e-6
    # without ties (one maximum) the reference arithmetic's tie mechanism has nothing to act on
    q1, k1, v1 = tied_problem(n=16, t=128, ties=1, gap=3.0)
    assert abs(measure(q1, k1, v1, "paper", "none").bias_ratio) < abs(paper.bias_ratio) / 4
