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
    assert "-4.71875" in out   # the worked example's bf16 sum
    # the table: one row per arithmetic, a lean in bold (**), as the measurement above says
    table = {line.split("  ")[0]: line for line in out.splitlines() if " / " in line.split("  ")[0]}
    assert {"paper / none", "paper-fp32fwd / none", "fa2 / none"} <= set(table)
    assert table["paper / none"].count("**") == 4 and "**" not in table["paper-fp32fwd / none"] + table["fa2 / none"]
