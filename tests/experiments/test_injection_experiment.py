"""`flashguard injection`: the grid's arms, cells and boundaries, the I1 verdict with
known answers in each direction on fabricated summaries, and a smoke run (matched batches, resume,
outputs) on the micro model."""
from __future__ import annotations

import json

import pytest
from md_helpers import numbers
from run_helpers import cli_exit, interrupted

from flashguard.experiments.injection import (INJECTION_PRESETS, InjectionPreset, arms, boundaries, cell_outcomes,
                                              judge_coherence, run_injection)
from flashguard.train import JsonlLog, load_config

ALPHAS = (1.0, 3.0, 10.0, 30.0, 100.0)


def _s(diverged_at=None, status=None):
    return {"steps": 100, "final_loss": 2.0, "min_loss": 1.9, "diverged_at": diverged_at,
            "status": status or ("diverged" if diverged_at is not None else "done")}


def _cells(coherent, zero_mean, baseline=None, seeds=1):
    """Cells from per-alpha outcomes: a step (diverged there), None (trained on), "partial"
    (unfinished) or a list (one outcome per seed)."""
    summaries = {}
    for col, outcomes in (("coherent-p1", coherent), ("zero-mean", zero_mean)):
        for a, o in zip(ALPHAS, outcomes):
            per_seed = o if isinstance(o, list) else [o] * seeds
            summaries[(col, a)] = {i: _s(status="partial") if x == "partial" else _s(x) for i, x in enumerate(per_seed)}
    summaries[("real", 1.0)] = {0: _s(baseline)}
    return cell_outcomes(summaries)


def _verdict(coherent, zero_mean, **kw):
    return judge_coherence(_cells(coherent, zero_mean, **kw), ALPHAS, coherent="coherent-p1")


N = None


def test_held_when_coherent_explodes_and_zero_mean_of_the_same_or_larger_size_does_not():
    v = _verdict([N, N, 150, 90, 40], [N, N, N, N, 350])
    assert v["verdict"] == "held"
    assert v["numbers"]["alpha_coherent"] == 10 and v["numbers"]["alpha_zero_mean"] == 30
    assert v["numbers"]["coherent_step"] == 150
    coherent, zero_mean = v["evidence"].split("; ")   # each cell's outcome: its alpha, then its step or its loss
    assert coherent.startswith("coherent-p1") and numbers(coherent)[:2] == [10, 150] and "diverged" in coherent
    assert zero_mean.startswith("zero-mean") and numbers(zero_mean)[0] == 30 and "trained on" in zero_mean
    assert _verdict([N, N, 150, 90, 40], [N, N, N, N, N], seeds=3)["verdict"] == "held"


def test_not_held_when_size_decides_or_zero_mean_explodes_first():
    same = _verdict([N, N, 150, 90, 40], [N, N, 300, 200, 100])
    assert same["verdict"] == "not held" and same["numbers"]["alpha_coherent"] == 10
    assert "alpha_zero_mean" not in same["numbers"]
    assert {300, 200, 100} <= set(numbers(same["evidence"]))   # zero-mean's divergence steps at every alpha >= 10
    reverse = _verdict([N, N, N, N, N], [N, N, N, 200, 100])
    assert reverse["verdict"] == "not held" and reverse["numbers"]["alpha_zero_mean"] == 30
    assert reverse["evidence"].startswith("zero-mean") and numbers(reverse["evidence"])[:2] == [30, 200]


def test_inconclusive_with_the_reason():
    calm = _verdict([N] * 5, [N] * 5)
    assert calm["verdict"] == "inconclusive" and "nothing diverged" in calm["evidence"]
    base = _verdict([N, N, 150, 90, 40], [N] * 5, baseline=80)
    assert base["verdict"] == "inconclusive" and "baseline" in base["evidence"]
    assert set(base["numbers"]) == {"coherent_column", "zero_mean_column"} and 80 in numbers(base["evidence"])
    unfinished = _verdict([N, N, 150, 90, 40], [N, N, 300, "partial", "partial"])
    assert unfinished["verdict"] == "inconclusive" and unfinished["numbers"]["alpha_coherent"] == 10
    assert "missing" in unfinished["evidence"] and {30, 100} <= set(numbers(unfinished["evidence"]))  # which cells
    split = _verdict([N, N, 150, 90, 40], [N, N, 300, [200, None], 100])
    assert split["verdict"] == "inconclusive" and "split" in split["evidence"] and "1/2" in split["evidence"]
    open_c = _verdict([N, "partial", N, N, N], [N] * 5)
    assert open_c["verdict"] == "inconclusive" and open_c["evidence"].startswith("coherent-p1")
    assert "missing" in open_c["evidence"] and numbers(open_c["evidence"]) == [3]


def test_cells_and_boundaries():
    cells = _cells([N, N, [150, 170, 160], 90, 40], [N, N, N, [N, 300], "partial"], seeds=3)
    c = cells[("coherent-p1", 10.0)]
    assert c["state"] == "diverged" and c["median_step"] == 160 and c["diverged"] == 3 and c["seeds"] == 3
    assert cells[("zero-mean", 30.0)]["state"] == "split" and cells[("zero-mean", 100.0)]["state"] == "missing"
    b = boundaries(cells, ["coherent-p1", "zero-mean", "real"], ALPHAS)
    assert b["coherent-p1"]["alpha_star"] == 10 and b["coherent-p1"]["text"] == "(3, 10]"
    assert b["zero-mean"]["alpha_star"] is None and not b["zero-mean"]["known"]
    bumpy = boundaries(_cells([N, 100, N, 90, 40], [N] * 5), ["coherent-p1", "zero-mean"], ALPHAS)
    assert bumpy["coherent-p1"]["alpha_star"] == 3 and bumpy["coherent-p1"]["monotone"] is False
    assert bumpy["coherent-p1"]["text"].startswith("(1, 3]") and bumpy["zero-mean"]["text"] == "> 100"


def test_the_grids_arms():
    full = arms(INJECTION_PRESETS["tiny-cpu"])
    names = [a.name for a in full]
    assert len(full) == 5 * 4 + 5 + 5 and names[0] == "real-a1" and len(set(names)) == len(names)
    assert {"zero-mean-a100", "coherent-p0.6-a3", "coherent-p1-a10", "shuffled-a30", "real-a100"} <= set(names)
    by = {a.name: a for a in full}
    base = load_config(None, list(by["real-a1"].run_spec(7).overrides)).injection  # the baseline
    assert (base.rule, base.alpha) == ("real", 1.0)
    cfg = load_config(None, list(by["coherent-p0.75-a30"].run_spec(7).overrides))
    assert (cfg.injection.rule, cfg.injection.p, cfg.injection.alpha, cfg.train.seed) == ("coherent", 0.75, 30.0, 7)
    assert load_config(None, list(by["zero-mean-a3"].run_spec(1).overrides)).injection.rule == "zero-mean"


def test_injection_smoke_on_micro_matched_resumable(tiny_data, tmp_path, monkeypatch):
    preset = InjectionPreset("smoke", "micro", alphas=(10,), ps=(0.5, 1.0), steps=6, diagnostics_every=3)
    out = tmp_path / "inj"
    data = [f'data.dir="{tiny_data}"', "train.checkpoint_every=3", 'injection.reference="fp32"']
    # the first run is interrupted after its step-3 checkpoint
    interrupted(monkeypatch, 4, lambda: run_injection(preset, out, overrides=data, progress=False, log=lambda m: None))
    result = run_injection(preset, out, overrides=data, progress=False, log=lambda m: None)
    saved = json.loads((out / "injection.json").read_text())
    assert [r["name"] for r in saved["runs"]] == ["zero-mean-a10", "coherent-p1-a10", "shuffled-a10", "real-a10"]
    assert all(r["summary"]["status"] in ("done", "diverged") for r in saved["runs"])
    assert saved["claims"][0]["verdict"] in ("held", "not held", "inconclusive") and saved["claims"][0]["evidence"]
    assert saved["claims"][0]["verdict"] == result["claims"][0]["verdict"]
    assert set(saved["boundaries"]) == {"zero-mean", "coherent-p1", "shuffled", "real"}
    # outcomes: every layer's W_Q norm and max logit at the probe steps, the loss per step
    r = saved["runs"][1]
    assert [s for s, _ in r["wq_norm"]["0"]] == [0, 3] and set(r["max_logit"]) == {"0", "1"}
    assert len(r["loss"]) == 6
    # matched: the same batches in every arm (the interrupted one included); configs carry the injection
    batches = [JsonlLog.read(out / r["dir"] / "batches.jsonl") for r in saved["runs"]]
    assert all(b == batches[0] for b in batches) and len(batches[0]) == 6
    saved_inj = load_config(out / "runs" / "s1337" / "coherent-p1-a10" / "config.toml").injection
    assert (saved_inj.p, saved_inj.reference) == (1.0, "fp32")  # the arm's rule, the user's reference
    assert (out / "phase.png").stat().st_size > 0 and (out / "wq_norms.png").stat().st_size > 0
    text = (out / "injection.md").read_text()
    assert "| **alpha\\*** |" in text and saved["claims"][0]["id"] == "I1" and saved["claims"][0]["title"] in text
    # a second call trains nothing
    before = {r["dir"]: (out / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in saved["runs"]}
    run_injection(preset, out, overrides=data, progress=False, log=lambda m: None)
    assert before == {r["dir"]: (out / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in saved["runs"]}


@pytest.mark.parametrize("args,msg", [
    (["--preset", "gpt2-124m-owt"], ("'gpt2-124m-owt'",)),
    (["--claims", "C1"], ("--claims", "injection")),   # an option injection does not take, and the command
    (["--seeds", "1,x"], ("--seeds", "1,x")),
    (["--seeds", "1,1"], ("repeated seed",)),
    (["injection.layers=[7]"], ("injection.layers", "7")),  # checked before anything trains
    (["injection.reference=fp16"], ("injection.reference",)),
])
def test_bad_injection_arguments_name_the_problem(tiny_data, tmp_path, capsys, args, msg):
    code = cli_exit(["injection", "--preset", "micro", "--out", str(tmp_path / "x"),
                 f'data.dir="{tiny_data}"', *args])
    err = capsys.readouterr().err
    assert code == 2 and all(m in err for m in msg), err   # names the option or key, and the value
    assert not (tmp_path / "x" / "runs").exists()
