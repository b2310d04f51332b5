"""The two-second tour: it runs, and its numbers come from the computation."""
from __future__ import annotations

from flashguard.cli import main


def test_showcase_runs_and_shows_the_bias(capsys):
    import flashguard.experiments.showcase as showcase
    rows = showcase.run_showcase(print_fn=lambda *a: None)
    by = {(m.policy, m.stabilizer): m for m in rows}
    paper = by[("paper", "none")]
    assert paper.o_vs_floor.verdict == "biased -" and paper.delta_vs_floor.verdict == "biased +"
    assert by[("paper-fp32fwd", "none")].o_vs_floor.verdict == "no bias"
    assert by[("fa2", "none")].o_vs_floor.verdict == "no bias"
    assert main(["showcase"]) == 0
    out = capsys.readouterr().out
    assert "-4.71875" in out and "beyond the noise floor" in out and "paper-fp32fwd" in out
