"""The edge-attribution experiment: its rules on hand-made outcomes (each verdict each way), its
presets, and a smoke run end to end (resumable, matched batches, the CLI)."""
from __future__ import annotations

import json

import pytest

from flashguard.cli import main
from flashguard.experiments.edge import EDGE_PRESETS, get_edge_preset, run_edge
from flashguard.experiments.edge.analysis import arm_summary, judge_claims
from flashguard.experiments.edge.presets import CLAIMS, Claim, EdgePreset
from flashguard.experiments.lr_sensitivity.presets import FP32, PAPER
from flashguard.train import JsonlLog, load_config

from run_helpers import cli_exit, interrupted

LABELS = {"fp32": "fp32", "paper": "paper", "fix": "fix"}
E0 = Claim("E0", "paper diverges more than fp32", "paper", "fp32", "more")
E1 = Claim("E1", "fix removes it", "fix", "paper", "fewer")


def _arm(diverged_seeds, n=10, at=300, steps=1000):
    return {s: ({"status": "diverged", "diverged_at": at + s, "steps": at + s + 1, "final_loss": None}
                if s in diverged_seeds else {"status": "done", "diverged_at": None, "steps": steps, "final_loss": 3.0})
            for s in range(1, n + 1)}


def _verdicts(fp32, paper, fix):
    return {c["id"]: c for c in judge_claims((E0, E1), {"fp32": fp32, "paper": paper, "fix": fix}, LABELS)}


def test_held_when_paper_diverges_and_the_arm_does_not():
    v = _verdicts(_arm([]), _arm(range(1, 11)), _arm([]))
    assert v["E0"]["verdict"] == "held" and v["E1"]["verdict"] == "held"
    assert v["E1"]["fisher_p"] == pytest.approx(5.41e-6, rel=1e-2) and v["E1"]["earlier"] == "paper"


def test_not_held_when_the_arm_diverges_as_often():
    v = _verdicts(_arm([]), _arm(range(1, 11)), _arm(range(1, 10)))
    assert v["E0"]["verdict"] == "held" and v["E1"]["verdict"] == "not held"
    # as often but later: the log-rank shows it, the verdict stays the count's
    later = _verdicts(_arm([]), _arm(range(1, 11)), _arm(range(1, 11), at=800))
    assert later["E1"]["verdict"] == "not held" and later["E1"]["logrank_p"] < 0.05 and later["E1"]["earlier"] == "paper"


def test_inconclusive_without_the_divergence_and_unfinished_with_a_missing_run():
    v = _verdicts(_arm([]), _arm([1, 2]), _arm([]))
    assert v["E0"]["verdict"] == "not held" and v["E1"]["verdict"] == "inconclusive"
    fix = _arm([])
    fix[4] = {"status": "partial", "diverged_at": None, "steps": 10, "final_loss": None}
    v = _verdicts(_arm([]), _arm(range(1, 11)), fix)
    assert v["E1"]["verdict"] == "unfinished" and v["E1"]["unfinished_seeds"] == [4]


def test_holm_adjusts_the_family():
    """7 of 10 against 10 of 10: p = 0.105 alone is not held either way; 2 of 10 (p = 3.6e-4) is
    held alone and with a second claim in the family (x2)."""
    claims = (E0, E1, Claim("E2", "other", "fix", "paper", "fewer"))
    v = {c["id"]: c for c in judge_claims(claims, {"fp32": _arm([]), "paper": _arm(range(1, 11)),
                                                   "fix": _arm([1, 2])}, LABELS)}
    assert v["E1"]["adjusted_p"] == pytest.approx(2 * v["E1"]["fisher_p"]) and v["E1"]["verdict"] == "held"


def test_arm_summary_counts_and_steps():
    s = arm_summary(_arm([2, 5]))
    assert (s["diverged"], s["finished"], s["diverged_seeds"], s["diverged_steps"]) == (2, 10, [2, 5], [302, 305])
    assert s["median_step"] == 303.5 and s["mean_final_loss"] == 3.0


def test_presets_are_checked():
    p = get_edge_preset("micro-edge")
    assert len(p.seeds) >= 10 and len(p.arms) == 13 and [c.id for c in p.claims] == [c.id for c in CLAIMS]
    with pytest.raises(ValueError, match="names arm 'nope'"):
        EdgePreset("x", "micro", (0.1,), (FP32, PAPER), (Claim("E9", "t", "nope", "paper", "fewer"),), 10, (1,))
    with pytest.raises(ValueError, match="no edge preset"):
        get_edge_preset("micro-lr")
    assert set(EDGE_PRESETS) == {"micro-edge", "micro-edge-demo", "micro-edge-forward", "micro-edge-low", "micro-edge-probed",
                                 "micro-edge-smoke", "tiny-cpu-edge", "tiny-cpu-edge-scan"}
    assert "train.update_entropy_every=1" in get_edge_preset("micro-edge-probed").probes


def test_smoke_run_end_to_end_resumable(tiny_data, tmp_path, monkeypatch, capsys):
    preset = get_edge_preset("micro-edge-smoke")
    out = tmp_path / "edge"
    data = [f'data.dir="{tiny_data}"']
    # the first run is interrupted after its step-6 checkpoint
    interrupted(monkeypatch, 8, lambda: run_edge(preset, out, seeds=[1], overrides=data, log=lambda m: None))
    run_edge(preset, out, seeds=[1], overrides=data, log=lambda m: None)
    saved = json.loads((out / "edge.json").read_text())
    assert [r["arm"] for r in saved["runs"]] == [a.name for a in preset.arms]
    assert all(r["status"] in ("done", "diverged") for r in saved["runs"])
    sizes = saved["error_sizes"]
    assert sizes["delta-zero-mean"]["ratio"] == pytest.approx(1.0) and sizes["o-zero-mean"]["point"] == "o"
    assert 1.0 <= sizes["o-zero-mean"]["ratio"] < 1.5
    assert [c["id"] for c in saved["by_lr"][0]["claims"]] == ["E0", "E1", "E3", "E10"]
    batches = [JsonlLog.read(out / r["dir"] / "batches.jsonl") for r in saved["runs"] if r["status"] == "done"]
    assert batches and all(b[:3] == batches[0][:3] for b in batches)  # matched batches
    cfg = load_config(out / "runs" / "s1" / "o-zero-mean" / "lr0.01" / "config.toml")
    assert (cfg.injection.rule, cfg.injection.point, cfg.optim.lr) == ("zero-mean", "o", 0.01)
    assert "| E1: " in (out / "edge.md").read_text() and (out / "survival_lr0.01.png").stat().st_size > 0
    before = {r["dir"]: (out / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in saved["runs"]}
    capsys.readouterr()
    assert main(["edge", "--preset", "micro-edge-smoke", "--seeds", "1", "--out", str(out),
                 *data]) == 0
    assert "E0" in capsys.readouterr().out
    assert before == {r["dir"]: (out / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in saved["runs"]}


@pytest.mark.parametrize("args,msg", [
    (["--claims", "C1"], ("--claims", "edge")),                  # the option, and the experiment it is not for
    (["injection.rule=real"], ("injection.rule", "arms")),      # the key, and who sets it
    (["optim.lr=1e-3"], ("optim.lr", "arms")),
    (["--preset", "micro"], ("edge", "'micro'")),
])
def test_bad_edge_arguments_name_the_problem(tiny_data, tmp_path, capsys, args, msg):
    code = cli_exit(["edge", "--preset", "micro-edge-smoke", "--out", str(tmp_path / "x"),
                 f'data.dir="{tiny_data}"', *args])
    err = capsys.readouterr().err
    assert code == 2 and all(m in err for m in msg), err
    assert not (tmp_path / "x").exists()
