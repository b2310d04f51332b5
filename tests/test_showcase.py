"""The README's main job: it runs, and its numbers come from the computation."""
from __future__ import annotations

from flashguard.cli import main


def test_showcase_runs_and_shows_the_bias(capsys, monkeypatch):
    import flashguard.experiments.showcase as showcase
    rows = showcase.run_showcase(print_fn=lambda *a: None)
    by = {(m.policy, m.stabilizer): m for m in rows}
    paper = by[("paper", "none")]
    assert paper.o.verdict == "biased -" and paper.delta.verdict == "biased +" and paper.pbar_one > 0
    assert by[("fp32", "none")].o.verdict == "no bias"
    assert by[("paper", "safe")].pbar_one == 0
    assert main(["showcase"]) == 0
    out = capsys.readouterr().out
    assert "-4.71875" in out and "bias ratio" in out and "biased -" in out
