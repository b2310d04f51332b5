"""`flashguard lr-sensitivity`: the final loss, Wortsman's LR sensitivity on a
hand-computed curve, diverged runs counted as l0, the verdicts with known answers in each
direction on fabricated outcomes, the presets' configs, a smoke run (resumable, matched batches,
outputs) on the micro model, and the CLI's refusals."""
from __future__ import annotations

import json
import math

import pytest
from md_helpers import numbers, table_dicts, tables
from run_helpers import cli_exit, interrupted

from flashguard.cli import main
from flashguard.experiments.lr_sensitivity import (LR_PRESETS, LRPreset, curve, final_loss, get_lr_preset, judge_fix,
                                                   judge_harm, log_grid, mean_curve, run_lr_sensitivity, run_spec)
from flashguard.experiments.lr_sensitivity.presets import FP32, PAPER
from flashguard.experiments.lr_sensitivity.runner import _common
from flashguard.experiments.repro.presets import config_path, get_preset
from flashguard.train import JsonlLog, load_config

LRS = (1e-3, 3e-3, 1e-2, 3e-2)
L0 = 5.0
D = "d"   # a diverged run
P = "p"   # an unfinished (partial) run


def _outcomes(finals, lrs=LRS, l0=L0):
    """{lr: run outcome} from one final loss per lr, D (diverged) or P (unfinished)."""
    out = {}
    for lr, f in zip(lrs, finals):
        status = {D: "diverged", P: "partial"}.get(f, "done")
        out[lr] = {"status": status, "final_loss": f if status == "done" else None, "initial_loss": l0,
                   "diverged_at": 40 if status == "diverged" else None}
    return out


def _curves(by_arith: dict) -> dict:
    """{(seed, name): curve} from {name: [finals of seed 1, finals of seed 2, ...]}."""
    return {(s, name): curve(_outcomes(f), LRS) for name, per_seed in by_arith.items()
            for s, f in enumerate(per_seed, 1)}


def test_final_loss_is_the_mean_of_the_last_five_percent():
    recs = [{"step": s, "loss/train": float(s)} for s in range(100)]
    assert final_loss(recs, 100) == pytest.approx((95 + 96 + 97 + 98 + 99) / 5)
    assert final_loss(recs[:20], 20) == 19.0  # at least one step
    recs[97]["loss/train"] = math.nan
    assert final_loss(recs, 100) is None


def test_sensitivity_on_a_hand_computed_curve():
    # counted: 3.0, 2.0, min(6.0, l0) = 5.0, diverged = l0 = 5.0; l* = 2.0
    c = curve(_outcomes([3.0, 2.0, 6.0, D]), LRS)
    assert c["complete"] and c["l0"] == L0
    assert [p["counted"] for p in c["points"]] == [3.0, 2.0, 5.0, 5.0]
    assert (c["best_lr"], c["best_loss"]) == (3e-3, 2.0)
    assert c["sensitivity"] == pytest.approx((1.0 + 0.0 + 3.0 + 3.0) / 4)
    # trains: final <= l0 - 0.5 (l0 - l*) = 3.5, below l0, not diverged
    assert c["threshold"] == 3.5 and [p["trains"] for p in c["points"]] == [True, True, False, False]
    assert c["largest_trainable_lr"] == 3e-3


def test_diverged_runs_count_as_l0_and_all_diverged_trains_nothing():
    c = curve(_outcomes([D, D, D, D]), LRS)
    assert [p["counted"] for p in c["points"]] == [L0] * 4
    assert c["sensitivity"] == 0.0 and c["largest_trainable_lr"] is None
    worse = curve(_outcomes([3.0, 2.0, D, D]), LRS)
    better = curve(_outcomes([3.0, 2.0, 2.1, 2.2]), LRS)
    assert worse["sensitivity"] > better["sensitivity"]
    assert (worse["largest_trainable_lr"], better["largest_trainable_lr"]) == (3e-3, 3e-2)


def test_an_unfinished_run_leaves_the_curve_incomplete():
    c = curve(_outcomes([3.0, P, 2.0, 2.5]), LRS)
    assert not c["complete"] and c["missing"] == [3e-3] and c["sensitivity"] is None
    assert c["points"][1]["counted"] is None
    m = mean_curve([c, curve(_outcomes([3.0, 2.5, 2.0, 2.5]), LRS)])
    assert m["counted"][0] == 3.0 and m["counted"][1] is None and m["sensitivity"] is None


FP32_CURVE = [3.0, 2.2, 2.0, 2.4]       # trains at every lr (threshold 3.5)
HARMED = [3.0, 2.2, D, D]               # diverges above 3e-3
SAME = [3.0, 2.21, 2.0, 2.41]           # within the tolerance of fp32


def _judge(by_arith, fixes=("fix",)):
    curves = _curves(by_arith)
    seeds = [1, 2]
    harm = judge_harm(curves, seeds)
    return harm, [judge_fix(curves, seeds, harm, fix=f, label=f, claim_id=f"L{k}") for k, f in enumerate(fixes, 2)]


def _worse(claim) -> dict:
    """{seed: worse than fp32} of a verdict's numbers."""
    return {s: c["worse"] for s, c in claim["numbers"]["per_seed"].items()}


def test_held_when_paper_is_worse_at_every_seed_and_the_fix_restores():
    harm, (fix, bad) = _judge({"fp32": [FP32_CURVE] * 2, "paper": [HARMED] * 2, "fix": [SAME] * 2,
                               "bad": [HARMED, [3.0, 2.2, 2.0, D]]}, fixes=("fix", "bad"))
    assert harm["verdict"] == "held" and _worse(harm) == {"1": True, "2": True}
    per = harm["numbers"]["per_seed"]["1"]
    assert per["lower_lr"] and per["largest"] == 3e-3 and per["largest_ref"] == 3e-2
    assert per["sens_diff"] > 0 and {0.003, 0.03} <= set(numbers(harm["evidence"]))   # the evidence gives both lrs
    assert fix["verdict"] == "held" and fix["id"] == "L2" and _worse(fix) == {"1": False, "2": False}
    assert bad["verdict"] == "not held" and bad["id"] == "L3" and _worse(bad) == {"1": True, "2": True}


def test_worse_by_sensitivity_alone_counts():
    # the same best and largest trainable lr, but losses higher by 0.5 at two lrs: sensitivity 0.65 vs
    # 0.4, a difference of 0.25 > 5% of fp32's l0 - l* = 3.0
    harm, _ = _judge({"fp32": [FP32_CURVE] * 2, "paper": [[3.0, 2.7, 2.0, 2.9]] * 2, "fix": [SAME] * 2})
    per = harm["numbers"]["per_seed"]["2"]
    assert not per["lower_lr"] and per["higher_sens"] and per["tolerance"] == pytest.approx(0.05 * 3.0)
    assert per["sens_diff"] == pytest.approx(0.25)
    assert harm["verdict"] == "held"


def test_not_held_when_paper_equals_fp32_and_the_fix_has_nothing_to_restore():
    harm, (fix,) = _judge({"fp32": [FP32_CURVE] * 2, "paper": [SAME] * 2, "fix": [SAME] * 2})
    assert harm["verdict"] == "not held" and _worse(harm) == {"1": False, "2": False}
    assert abs(harm["numbers"]["per_seed"]["1"]["sens_diff"]) < harm["numbers"]["per_seed"]["1"]["tolerance"]
    # nothing to restore: the evidence names L1 and its verdict
    assert fix["verdict"] == "inconclusive" and "L1" in fix["evidence"] and "not held" in fix["evidence"]


def test_inconclusive_when_seeds_disagree_or_runs_are_unfinished():
    harm, (fix,) = _judge({"fp32": [FP32_CURVE] * 2, "paper": [HARMED, SAME], "fix": [SAME] * 2})
    assert harm["verdict"] == "inconclusive" and _worse(harm) == {"1": True, "2": False}
    assert "seeds disagree" in harm["evidence"]
    harm, (fix,) = _judge({"fp32": [FP32_CURVE] * 2, "paper": [HARMED] * 2, "fix": [SAME, HARMED]})
    assert harm["verdict"] == "held" and fix["verdict"] == "inconclusive" and "seeds disagree" in fix["evidence"]
    harm, _ = _judge({"fp32": [FP32_CURVE, [3.0, 2.2, P, 2.4]], "paper": [HARMED] * 2, "fix": [SAME] * 2})
    assert harm["verdict"] == "inconclusive" and harm["numbers"]["per_seed"] == {}
    assert "fp32" in harm["evidence"] and "unfinished" in harm["evidence"]
    assert numbers(harm["evidence"]) == [2, 0.01]   # the seed, and the lr of the unfinished run


def test_presets_and_their_run_configs():
    assert log_grid(3e-4, 3e-2, 7) == (3e-4, 6.46e-4, 1.39e-3, 3e-3, 6.46e-3, 1.39e-2, 3e-2)
    full = LR_PRESETS["micro-lr"]
    assert len(full.lrs) == 7 and [a.name for a in full.arithmetics] == ["fp32", "paper", "paper-fix", "paper-fp32fwd"]
    for preset in LR_PRESETS.values():  # every run's config loads: valid precision and stabilizer names
        base = config_path(get_preset(preset.repro))
        common = _common(preset, preset.steps, False, [])
        for a in preset.arithmetics:
            cfg = load_config(base, [*common, *run_spec(a, preset.lrs[-1], 7).overrides])
            assert (cfg.optim.lr, cfg.optim.min_lr, cfg.train.seed) == (preset.lrs[-1], preset.lrs[-1] / 10, 7)
            assert cfg.train.divergence_factor == 2 and cfg.optim.schedule == "cosine" and cfg.train.keep_last == 1
    fix = load_config(None, list(run_spec(full.arithmetic("paper-fix"), 1e-3, 1).overrides)).attention.spec
    assert (fix.precision, fix.stabilizer) == ("paper", "paper")
    fwd = load_config(None, list(run_spec(full.arithmetic("paper-fp32fwd"), 1e-3, 1).overrides)).attention.spec
    assert (fwd.precision, fwd.stabilizer) == ("paper-fp32fwd", "none")
    with pytest.raises(ValueError, match="ascending"):
        LRPreset("x", "micro", lrs=(3e-3, 1e-3), arithmetics=(FP32, PAPER), steps=10)
    with pytest.raises(ValueError, match="harmed"):
        LRPreset("x", "micro", lrs=(1e-3, 3e-3), arithmetics=(FP32,), steps=10)


def test_smoke_run_end_to_end_resumable(tiny_data, tmp_path, monkeypatch, capsys):
    preset = get_lr_preset("micro-lr-smoke")
    out = tmp_path / "lr"
    data = [f'data.dir="{tiny_data}"']
    # the first run is interrupted after its step-10 checkpoint
    interrupted(monkeypatch, 12, lambda: run_lr_sensitivity(preset, out, seeds=[1], overrides=data, progress=False,
                                                            log=lambda m: None))
    first = out / "runs" / "s1" / "fp32" / "lr0.001"
    assert (first / "checkpoints").is_dir()  # kept to resume from
    result = run_lr_sensitivity(preset, out, seeds=[1], overrides=data, progress=False, log=lambda m: None)
    saved = json.loads((out / "lr_sensitivity.json").read_text())
    assert [(r["arithmetic"], r["lr"]) for r in saved["runs"]] == [("fp32", 1e-3), ("fp32", 3e-2), ("paper", 1e-3),
                                                                   ("paper", 3e-2)]
    assert all(r["status"] in ("done", "diverged") for r in saved["runs"])
    assert all(not (out / r["dir"] / "checkpoints").exists() for r in saved["runs"])  # finished: dropped
    assert [c["complete"] for c in saved["curves"]] == [True, True]
    assert saved["claims"][0]["id"] == "L1" and saved["claims"][0]["verdict"] == result["claims"][0]["verdict"]
    assert len(saved["claims"]) == 1  # the smoke grid has no fix to judge
    # matched: the same batches in every run of the seed (the resumed one included)
    batches = [JsonlLog.read(out / r["dir"] / "batches.jsonl") for r in saved["runs"] if r["status"] == "done"]
    assert len(batches[0]) == 20 and all(b[:10] == batches[0][:10] for b in batches)
    cfg = load_config(out / "runs" / "s1" / "paper" / "lr0.03" / "config.toml")
    assert (cfg.optim.lr, cfg.attention.spec.precision, cfg.train.seed) == (3e-2, "paper", 1)
    assert (out / "lr_curves.png").stat().st_size > 0
    text = (out / "lr_sensitivity.md").read_text()
    assert "LR sensitivity" in text and "![lr_curves.png]" in text
    (claims,) = [table_dicts(t) for t in tables(text) if t[0] == ["claim", "verdict", "evidence"]]
    assert [(r["claim"], r["verdict"]) for r in claims] == \
        [(f"{c['id']}: {c['title']}", f"**{c['verdict']}**") for c in saved["claims"]]
    # a second call (through the CLI) trains nothing
    before = {r["dir"]: (out / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in saved["runs"]}
    capsys.readouterr()
    assert main(["lr-sensitivity", "--preset", "micro-lr-smoke", "--seeds", "1",
                 "--out", str(out), *data]) == 0
    assert "L1  " in capsys.readouterr().out
    assert before == {r["dir"]: (out / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in saved["runs"]}


@pytest.mark.parametrize("args,msg", [
    (["--preset", "micro"], ("lr-sensitivity", "'micro'")),
    (["--claims", "C1"], ("--claims", "lr-sensitivity")),       # the option, and the experiment it is not for
    (["--remedies"], ("--remedies", "lr-sensitivity")),
    (["--runs", "somewhere"], ("--runs", "lr-sensitivity")),
    (["--seeds", "1,x"], ("--seeds", "1,x")),
    (["--seeds", "1,1"], ("repeated seed",)),
    (["--steps", "0"], ("--steps", "0")),
    (["optim.lr=1e-3"], ("optim.lr=1e-3", "grid")),            # the override, and who sets that key
    (["attention.stabilizer=safe"], ("attention.stabilizer", "grid")),
    (["attention.block_q=0"], ("attention.block_q",)),  # any bad override: refused before anything trains
])
def test_bad_lr_sensitivity_arguments_name_the_problem(tiny_data, tmp_path, capsys, args, msg):
    code = cli_exit(["lr-sensitivity", "--preset", "micro-lr-smoke", "--out",
                 str(tmp_path / "x"), f'data.dir="{tiny_data}"', *args])
    err = capsys.readouterr().err
    assert code == 2 and all(m in err for m in msg), err
    assert not (tmp_path / "x" / "runs").exists()
