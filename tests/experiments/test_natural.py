"""`flashguard natural`: claims N1-N5 with known answers each way on fabricated
arm outcomes (held, not held, inconclusive for a missing arm), the analysis of fabricated run
folders through --runs (mode b, nothing trained), a smoke run of the arms on the micro model
(mode a: resumable, matched batches, a rerun trains nothing), and the CLI's refusals."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from md_helpers import numbers, table_dicts, tables
from run_helpers import cli_exit, interrupted

from flashguard import keys
from flashguard.cli import main
from flashguard.experiments.natural import (NATURAL_PRESETS, get_natural_preset, judge_claims, parse_runs,
                                            run_natural)
from flashguard.experiments.natural.analysis import (HELD, INCONCLUSIVE, NOT_APPLICABLE, NOT_HELD, missing_outcome,
                                                     series_text)
from flashguard.experiments.natural.presets import ARM_KEYS, KERNEL_ARMS, NaturalPreset
from flashguard.experiments.natural.runner import common_overrides
from flashguard.train import JsonlLog, load_config
from flashguard.utils.jsonl import read_jsonl

ARMS = ("fp32", "paper", "paper-fix", "paper-fp32fwd")


# ---------------------------------------------------------------- fabricated outcomes

def _row(layer, verdict, z=None, probes=20):
    z = z if z is not None else {"leans +": 7.2, "leans -": -7.2, "weak +": 4.0, "weak -": -4.0}.get(verdict, 0.3)
    return {"layer": layer, "probes": probes, "first_step": 0, "last_step": 50 * (probes - 1),
            "positive": probes // 2, "stouffer_z": z, "mean_ratio": 0.02 * math.copysign(1, z), "verdict": verdict,
            "steps": [], "zs": []}


def _arm(name, *verdicts, status="done", steps=1000, diverged_at=None):
    """An outcome: one delta verdict per layer (L0, L1, ...)."""
    return {"arm": name, "dir": f"/runs/{name}", "overrides": [], "status": status, "steps": steps,
            "target_steps": 1000, "diverged_at": diverged_at, "divergence": "loss >= 2 x" if diverged_at else None,
            "last_val": 1.5, "last_val_step": steps - 1, "delta": [_row(l, v) for l, v in enumerate(verdicts)],
            "O": [], "census": None, "config": None, "metrics_age_s": 1.0,
            "state": {"partial": f"incomplete at step {steps}", "diverged": f"diverged at step {diverged_at}"}
            .get(status, "done")}


def _verdicts(outcomes) -> dict:
    return {c["id"]: c["verdict"] for c in judge_claims(outcomes)}


def _study_says(**changes):
    """The study's picture: paper leans + at L0, fp32 and both fixes do not, nothing diverges."""
    out = {"fp32": _arm("fp32", "no lean", "no lean"), "paper": _arm("paper", "leans +", "no lean"),
           "paper-fix": _arm("paper-fix", "no lean", "weak +"),
           "paper-fp32fwd": _arm("paper-fp32fwd", "no lean", "no lean")}
    out.update(changes)
    return {k: v for k, v in out.items() if v is not None}


def test_claims_held_when_paper_leans_and_the_control_and_fixes_do_not():
    v = _verdicts(_study_says())
    assert v == {"N1": HELD, "N2": HELD, "N3": HELD, "N4": HELD, "N5": NOT_HELD}  # nothing diverged: N5 not held
    claims = judge_claims(_study_says())
    assert "L0 +7.2 leans +" in claims[0]["evidence"] and claims[0]["numbers"]["leans_plus_layers"] == [0]
    assert all(c["rule"] and c["title"] for c in claims)


def test_n1_not_held_without_a_positive_lean_and_then_the_fixes_have_nothing_to_remove():
    for paper in (_arm("paper", "no lean", "weak +"), _arm("paper", "leans -", "no lean")):
        v = _verdicts(_study_says(paper=paper))
        assert (v["N1"], v["N3"], v["N4"]) == (NOT_HELD, INCONCLUSIVE, INCONCLUSIVE)
        assert "nothing to remove" in judge_claims(_study_says(paper=paper))[2]["evidence"]


def test_n2_not_held_when_fp32_leans_either_way_and_weak_is_not_a_lean():
    assert _verdicts(_study_says(fp32=_arm("fp32", "no lean", "leans -")))["N2"] == NOT_HELD
    assert _verdicts(_study_says(fp32=_arm("fp32", "leans +", "no lean")))["N2"] == NOT_HELD
    assert _verdicts(_study_says(fp32=_arm("fp32", "weak -", "weak +")))["N2"] == HELD


def test_a_fix_not_held_when_it_still_leans_where_paper_leans_and_a_lean_elsewhere_is_not_judged():
    v = _verdicts(_study_says(**{"paper-fp32fwd": _arm("paper-fp32fwd", "leans +", "no lean"),
                                 "paper-fix": _arm("paper-fix", "leans -", "no lean")}))
    assert (v["N3"], v["N4"]) == (NOT_HELD, NOT_HELD)   # either sign at paper's layer
    elsewhere = _study_says(**{"paper-fp32fwd": _arm("paper-fp32fwd", "weak +", "leans +")})
    c = judge_claims(elsewhere)[2]
    assert c["verdict"] == HELD and c["numbers"]["layers"] == [0]          # judged at paper's leaning layer only
    (l1,) = [r for r in c["numbers"]["delta"] if r["verdict"].startswith("leans")]   # the lean elsewhere ...
    assert l1["layer"] == 1 and "elsewhere" in c["evidence"] and series_text(l1) in c["evidence"]   # ... reported
    # a fix without a probe series at paper's leaning layer cannot be judged
    short = _arm("paper-fp32fwd", "no lean")
    short["delta"] = [_row(1, "no lean")]
    assert _verdicts(_study_says(**{"paper-fp32fwd": short}))["N3"] == INCONCLUSIVE


def test_missing_arms_are_inconclusive_and_say_what_would_decide():
    outcomes = _study_says(**{"paper-fix": None, "fp32": missing_outcome("fp32", "/nowhere",
                                                                          ["attention.precision=fp32"])})
    claims = {c["id"]: c for c in judge_claims(outcomes)}
    assert (claims["N1"]["verdict"], claims["N3"]["verdict"]) == (HELD, HELD)
    assert claims["N2"]["verdict"] == INCONCLUSIVE and "--runs fp32=DIR" in claims["N2"]["evidence"]
    assert "attention.precision=fp32" in claims["N2"]["evidence"]
    assert claims["N4"]["verdict"] == INCONCLUSIVE and "paper-fix not run" in claims["N4"]["evidence"]
    v = _verdicts(_study_says(paper=None))
    assert v == {"N1": INCONCLUSIVE, "N2": HELD, "N3": INCONCLUSIVE, "N4": INCONCLUSIVE, "N5": INCONCLUSIVE}
    # an arm with no delta probe (probes off) cannot show a lean or its absence
    unprobed = _arm("fp32")
    assert _verdicts(_study_says(fp32=unprobed))["N2"] == INCONCLUSIVE


def test_n5_divergence_rules():
    div = _arm("paper", "leans +", status="diverged", steps=400, diverged_at=399)
    assert _verdicts(_study_says(paper=div))["N5"] == HELD
    assert _verdicts(_study_says(paper=_arm("paper", "leans +")))["N5"] == NOT_HELD
    fp32_div = _arm("fp32", "no lean", status="diverged", steps=500, diverged_at=499)
    fp32_open = _arm("fp32", "no lean", status="partial", steps=500)
    for changes in ({"fp32": None}, {"fp32": fp32_div}, {"fp32": fp32_open}):   # the control missing, shared, open
        assert _verdicts(_study_says(paper=div, **changes))["N5"] == INCONCLUSIVE, changes
    no_lean = _arm("paper", "no lean", status="diverged", steps=400, diverged_at=399)
    assert _verdicts(_study_says(paper=no_lean))["N5"] == INCONCLUSIVE   # nothing to attribute it to
    assert _verdicts(_study_says(paper=_arm("paper", "leans +", status="partial", steps=600)))["N5"] == INCONCLUSIVE


def test_an_incomplete_arm_is_judged_on_what_it_has_and_says_so():
    partial = _arm("fp32", "no lean", "no lean", status="partial", steps=677)
    c = judge_claims(_study_says(fp32=partial))[1]
    caveat = c["evidence"].rsplit(" (", 1)[1]   # the last parenthesis: the arm, how far it got, of how many
    assert c["verdict"] == HELD and caveat.startswith("fp32") and "incomplete" in caveat
    assert numbers(caveat)[:2] == [677, 1000]
    assert "may change" in caveat


# ---------------------------------------------------------------- fabricated run folders (mode b)

def _write_run(d, delta_l0, *, steps=100, probe_every=10, losses=None):
    """A metrics.jsonl with a loss every step and, every ``probe_every`` steps, delta and O z per
    layer: L0's delta z is ``delta_l0`` (its ratio 0.05 of the same sign), L1's alternate +-1."""
    d.mkdir(parents=True)
    with open(d / "metrics.jsonl", "w") as f:
        for s in range(steps):
            r = {keys.STEP: s, keys.LOSS_TRAIN: (losses or {}).get(s, 3.0 - s / steps)}
            if s % probe_every == 0:
                k = s // probe_every
                r.update({keys.DELTA_ERR_Z.key(0): delta_l0,
                          keys.DELTA_ERR_RATIO_ROW.key(0): math.copysign(0.05, delta_l0),
                          keys.DELTA_ERR_Z.key(1): (-1.0) ** k, keys.DELTA_ERR_RATIO_ROW.key(1): 0.01 * (-1.0) ** k,
                          keys.O_ERR_Z.key(0): 0.5, keys.O_ERR_RATIO_ROW.key(0): 0.001})
            if s % 50 == 49:
                r[keys.LOSS_VAL] = 2.5 - s / 1000
            f.write(json.dumps(r) + "\n")
    with open(d / "batches.jsonl", "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "indices": [s, s + 1]}) + "\n")
    return d


def test_mode_b_analyses_run_folders_and_trains_nothing(tmp_path, capsys):
    paper = _write_run(tmp_path / "p", 2.0)        # 10 probes of z +2: Stouffer +6.3, leans +
    fp32 = _write_run(tmp_path / "f", 0.1)
    fwd = _write_run(tmp_path / "w", -0.2, steps=60)  # incomplete: 60 of 100 steps
    out = tmp_path / "out"
    assert main(["natural", "--steps", "100", "--runs",
                 f"paper={paper},fp32={fp32}", f"paper-fp32fwd={fwd},paper-fix={tmp_path / 'absent'}",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "N1  held" in printed and "natural.md" in printed
    saved = json.loads((out / "natural.json").read_text())
    assert saved["mode"] == "analyse" and saved["preset"] == "nat512" and not (out / "runs").exists()
    o = {x["arm"]: x for x in saved["outcomes"]}
    assert (o["paper"]["status"], o["fp32"]["status"], o["paper-fp32fwd"]["status"], o["paper-fix"]["status"]) == \
        ("done", "done", "partial", "missing")
    l0 = o["paper"]["delta"][0]
    assert (l0["layer"], l0["probes"], l0["positive"], l0["verdict"]) == (0, 10, 10, "leans +")
    assert l0["stouffer_z"] == pytest.approx(2.0 * 10 / math.sqrt(10))
    assert o["paper"]["delta"][1]["verdict"] == "no lean" and o["paper"]["O"][0]["verdict"] == "no lean"
    assert (o["paper"]["last_val"], o["paper"]["last_val_step"]) == (pytest.approx(2.5 - 99 / 1000), 99)
    assert o["paper"]["steps"] == 100 and o["paper-fp32fwd"]["steps"] == 60 and o["paper"]["census"] is None
    state = o["paper-fp32fwd"]["state"]
    assert state.startswith("incomplete") and numbers(state)[:2] == [60, 100]
    v = {c["id"]: c for c in saved["claims"]}
    assert {k: c["verdict"] for k, c in v.items()} == {"N1": HELD, "N2": HELD, "N3": HELD, "N4": INCONCLUSIVE,
                                                        "N5": NOT_HELD}
    caveat = v["N3"]["evidence"].rsplit(" (", 1)[1]   # steps logged, of how many, the last probe judged
    assert caveat.startswith("paper-fp32fwd") and "incomplete" in caveat and numbers(caveat) == [60, 100, 50]
    assert "paper-fix not run" in v["N4"]["evidence"]
    assert saved["matching"]["batches"]["paper"] == {"compared": 100, "first_mismatch": None}
    assert saved["versions"]["flashguard"]
    md = (out / "natural.md").read_text()
    (claims,) = [table_dicts(t) for t in tables(md) if t[0] == ["claim", "verdict", "evidence"]]
    assert [(r["claim"], r["verdict"]) for r in claims] == \
        [(f"{c['id']}: {c['title']}", f"**{c['verdict']}**") for c in saved["claims"]]
    (arms,) = [{r["arm"].split()[0]: r for r in table_dicts(t)} for t in tables(md) if t[0][:2] == ["arm", "status"]]
    assert series_text(l0) in md and "attention.precision=paper" in arms["paper-fix"]["arm"]   # its overrides
    assert "incomplete" in arms["paper-fp32fwd"]["status"] and numbers(arms["paper-fp32fwd"]["status"]) == [59]
    assert "flashguard " in md.splitlines()[-1]


def test_mode_b_divergence_by_the_one_rule(tmp_path):
    # the loss doubles its running minimum at step 80: diverged there (no config: factor 2, no warm-up)
    paper = _write_run(tmp_path / "p", 2.0, losses={s: 9.0 for s in range(80, 100)})
    fp32 = _write_run(tmp_path / "f", 0.0)
    result = run_natural(get_natural_preset("nat512"), tmp_path / "out", steps=100,
                         runs={"paper": paper, "fp32": fp32}, log=lambda m: None)
    o = {x["arm"]: x for x in result["outcomes"]}
    assert (o["paper"]["status"], o["paper"]["diverged_at"]) == ("diverged", 80)
    c = {x["id"]: x for x in result["claims"]}
    assert c["N5"]["verdict"] == HELD and c["N5"]["numbers"]["harmed"]["diverged_at"] == 80
    assert c["N5"]["evidence"].startswith("paper diverged") and numbers(c["N5"]["evidence"])[0] == 80
    assert (c["N3"]["verdict"], c["N4"]["verdict"]) == (INCONCLUSIVE, INCONCLUSIVE)   # both fixes not run


def test_parse_runs():
    preset = get_natural_preset("nat512")
    assert parse_runs(["paper=/a,fp32=/b", "paper-fix=/c"], preset) == {"paper": Path("/a"), "fp32": Path("/b"),
                                                                       "paper-fix": Path("/c")}
    for bad, msg in ((["paper"], "not ARM=DIR"), (["nope=/a"], "unknown arm 'nope'"), (["paper=/a,paper=/b"], "twice"),
                     ([","], "no ARM=DIR")):
        with pytest.raises(ValueError, match=msg):
            parse_runs(bad, preset)


def test_presets_and_their_arm_configs():
    assert set(NATURAL_PRESETS) >= {"nat512", "natural-smoke"}
    nat = NATURAL_PRESETS["nat512"]
    assert [a.name for a in nat.arms] == ["fp32", "paper", "paper-fix", "paper-fp32fwd"] and nat.steps == 1000
    want = {"fp32": ("fp32", "none"), "paper": ("paper", "none"), "paper-fix": ("paper", "paper"),
            "paper-fp32fwd": ("paper-fp32fwd", "none")}
    for preset in (nat, NATURAL_PRESETS["natural-smoke"]):   # the kernels' presets: test_the_kernels_presets
        common = common_overrides(preset, False)
        for a in preset.arms:
            cfg = load_config(preset.config_path(), [*common, *a.overrides, f"train.steps={preset.steps}"])
            assert (cfg.attention.spec.precision, cfg.attention.spec.stabilizer) == want[a.name]
            assert cfg.train.divergence_factor == 2 and cfg.train.diagnostics_every == preset.diagnostics_every
            assert cfg.attention.spec.backend == "flash"
    cfg = load_config(nat.config_path(), [*common_overrides(nat, False), "train.steps=1000"])
    assert (cfg.model.preset, cfg.train.seed, cfg.data.doc_starts, cfg.train.diagnostics_every) == \
        ("tiny-cpu-512", 1337, True, 50)


# ---------------------------------------------------------------- the kernels' presets

KERNELS = ("sdpa", "fp32", "fa2", "torch-cpu")  # the preset's order: the question first
KERNEL_ROLES = {"reference": "fp32", "harmed": "sdpa", "lab_fix": None, "study_fix": None}


def test_the_kernels_presets():
    assert "attention.backend" in ARM_KEYS
    for name in ("nat512-kernels", "natural-kernels-smoke"):
        p = get_natural_preset(name)
        assert [a.name for a in p.arms] == list(KERNELS)
        assert {r: getattr(p, r) for r in KERNEL_ROLES} == KERNEL_ROLES
        common = common_overrides(p, False)
        for a in p.arms:
            spec = load_config(p.config_path(), [*common, *a.overrides, f"train.steps={p.steps}"]).attention.spec
            got = spec.backend if spec.backend != "flash" else spec.precision
            assert got == {"fp32": "fp32", "sdpa": "sdpa", "torch-cpu": "torch-cpu", "fa2": "fa2"}[a.name]
    nat = get_natural_preset("nat512-kernels")
    cfg = load_config(nat.config_path(), [*common_overrides(nat, False), "train.steps=1000"])
    assert (cfg.model.preset, cfg.train.seed, cfg.data.doc_starts, cfg.train.diagnostics_every, nat.steps) == \
        ("tiny-cpu-512", 1337, True, 50, 1000)
    assert cfg.attention.spec.block_k == 512   # torch's CPU kernel's key tile, which torch-cpu models
    assert "--preset nat512-kernels" in nat.about
    # a fix role may be None (no such arm); the others must name an arm
    with pytest.raises(ValueError, match="lab_fix.*'nope'"):
        NaturalPreset("x", "micro", 1, 1, arms=KERNEL_ARMS, harmed="sdpa", lab_fix="nope", study_fix=None)
    with pytest.raises(ValueError, match="harmed.*'paper'"):
        NaturalPreset("x", "micro", 1, 1, arms=KERNEL_ARMS, lab_fix=None, study_fix=None)


def _kernels_say(**changes):
    """sdpa leans + at L0, fp32 does not; the models of the kernel as given."""
    out = {"fp32": _arm("fp32", "no lean", "no lean"), "sdpa": _arm("sdpa", "leans +", "no lean"),
           "torch-cpu": _arm("torch-cpu", "leans +", "no lean"), "fa2": _arm("fa2", "no lean", "no lean")}
    out.update(changes)
    return {k: v for k, v in out.items() if v is not None}


def test_kernels_claims_judge_sdpa_both_ways_and_the_fix_claims_do_not_apply():
    roles = dict(KERNEL_ROLES)
    claims = judge_claims(_kernels_say(), **roles)
    assert {c["id"]: c["verdict"] for c in claims} == {"N1": HELD, "N2": HELD, "N3": NOT_APPLICABLE,
                                                       "N4": NOT_APPLICABLE, "N5": NOT_HELD}
    assert claims[0]["numbers"]["arm"] == "sdpa" and "sdpa leans + at L0" in claims[0]["evidence"]
    assert "sdpa" in claims[0]["title"] and "paper" not in claims[0]["title"] + claims[0]["rule"]
    assert all(c["rule"].startswith("not applicable") for c in claims[2:4])
    for sdpa in (_arm("sdpa", "no lean", "weak +"), _arm("sdpa", "leans -", "no lean")):
        v = {c["id"]: c["verdict"] for c in judge_claims(_kernels_say(sdpa=sdpa), **roles)}
        assert (v["N1"], v["N3"], v["N4"]) == (NOT_HELD, NOT_APPLICABLE, NOT_APPLICABLE)
    v = {c["id"]: c["verdict"] for c in judge_claims(_kernels_say(sdpa=None), **roles)}
    assert (v["N1"], v["N3"], v["N5"]) == (INCONCLUSIVE, NOT_APPLICABLE, INCONCLUSIVE)


def test_kernels_smoke_run_probes_torchs_kernel_and_judges_it(tiny_data, tmp_path, capsys):
    out = tmp_path / "k"
    data = [f'data.dir="{tiny_data}"']
    assert main(["natural", "--preset", "natural-kernels-smoke", "--out", str(out),
                 *data]) == 0
    assert "N3  not applicable" in capsys.readouterr().out
    saved = json.loads((out / "natural.json").read_text())
    assert saved["roles"] == KERNEL_ROLES and [a["name"] for a in saved["arms"]] == list(KERNELS)
    for o in saved["outcomes"]:   # every arm probed, sdpa included: delta and O across probes on both layers
        assert o["status"] in ("done", "diverged")
        assert [r["layer"] for r in o["delta"]] == [0, 1] and [r["layer"] for r in o["O"]] == [0, 1]
        assert o["delta"][0]["probes"] == 6 and o["delta"][0]["mean_ratio"] is not None
    sdpa = next(o for o in saved["outcomes"] if o["arm"] == "sdpa")
    assert sdpa["config"]["backend"] == "sdpa"
    probes = [r for r in read_jsonl(out / "runs" / "sdpa" / "metrics.jsonl") if keys.DELTA_ERR_Z.key(0) in r]
    assert len(probes) == 6 and not any(keys.TIE_RATE.key(0) in r for r in probes)   # the kernel's: no tiles
    claims = {c["id"]: c for c in saved["claims"]}
    assert claims["N1"]["numbers"]["arm"] == "sdpa" and claims["N1"]["verdict"] in (HELD, NOT_HELD)
    assert (claims["N3"]["verdict"], claims["N4"]["verdict"]) == (NOT_APPLICABLE, NOT_APPLICABLE)
    assert all(b["first_mismatch"] is None and b["compared"] == 12 for b in saved["matching"]["batches"].values())
    assert "**not applicable**" in (out / "natural.md").read_text()
    # a swapped folder is refused: a flash run is not the sdpa arm
    preset = get_natural_preset("natural-kernels-smoke")
    # named by the folder's setting and the arm's
    with pytest.raises(ValueError, match=r"--runs\W+sdpa=.*attention\.precision=fp32.*backend=sdpa"):
        run_natural(preset, tmp_path / "c", runs={"sdpa": out / "runs" / "fp32"}, log=lambda m: None)
    with pytest.raises(ValueError, match=r"--runs\W+fp32=.*attention\.backend=sdpa.*precision=fp32"):
        run_natural(preset, tmp_path / "c", runs={"fp32": out / "runs" / "sdpa"}, log=lambda m: None)


# ---------------------------------------------------------------- a smoke run (mode a)

def test_smoke_run_trains_every_arm_resumable_then_analyses_them(tiny_data, tmp_path, monkeypatch, capsys):
    preset = get_natural_preset("natural-smoke")
    out = tmp_path / "nat"
    data = [f'data.dir="{tiny_data}"']
    # the first arm is interrupted after its step-6 checkpoint
    interrupted(monkeypatch, 8, lambda: run_natural(preset, out, overrides=data, progress=False, log=lambda m: None))
    assert (out / "runs" / "fp32" / "checkpoints").is_dir()
    result = run_natural(preset, out, overrides=data, progress=False, log=lambda m: None)
    saved = json.loads((out / "natural.json").read_text())
    assert saved["mode"] == "train" and [a["dir"] for a in saved["arms"]] == [f"runs/{a}" for a in ARMS]
    assert all(o["status"] in ("done", "diverged") for o in saved["outcomes"])
    for o in saved["outcomes"]:   # every arm probed: delta and O across probes on both micro layers
        assert [r["layer"] for r in o["delta"]] == [0, 1] and [r["layer"] for r in o["O"]] == [0, 1]
        assert o["delta"][0]["probes"] == 6 and numbers(o["census"].split(":")[0]) == [10]   # the census at step 10
        # where delta's error is born: both parts on both layers for the arms with a bf16 delta
        split = {r["layer"]: r for r in o["delta_split"]}
        assert sorted(split) == [0, 1] and split[0]["own"]["probes"] == 6 and "from_o" in split[0]
    assert [c["id"] for c in saved["claims"]] == ["N1", "N2", "N3", "N4", "N5"]
    (born,) = [table_dicts(t) for t in tables((out / "natural.md").read_text()) if "part" in t[0]]   # delta's parts
    assert {r["layer"] for r in born} == {"L0", "L1"} and len({r["part"] for r in born}) == 2
    assert [c["verdict"] for c in saved["claims"]] == [c["verdict"] for c in result["claims"]]
    assert all(b["first_mismatch"] is None and b["compared"] == 12 for b in saved["matching"]["batches"].values())
    batches = [JsonlLog.read(out / "runs" / a / "batches.jsonl") for a in ARMS]
    assert all(b == batches[0] for b in batches)   # matched: the resumed arm included
    cfg = load_config(out / "runs" / "paper-fix" / "config.toml")
    assert (cfg.attention.spec.precision, cfg.attention.spec.stabilizer, cfg.train.steps) == ("paper", "paper", 12)
    # a rerun (through the CLI) trains nothing
    before = {a: (out / "runs" / a / "metrics.jsonl").stat().st_mtime_ns for a in ARMS}
    capsys.readouterr()
    assert main(["natural", "--preset", "natural-smoke", "--out", str(out), *data]) == 0
    assert "N1  " in capsys.readouterr().out
    assert before == {a: (out / "runs" / a / "metrics.jsonl").stat().st_mtime_ns for a in ARMS}
    # mode (b) on the same folders gives the same outcomes
    again = run_natural(preset, tmp_path / "b", runs={a: out / "runs" / a for a in ARMS}, log=lambda m: None)
    strip = lambda o: {k: v for k, v in o.items() if k not in ("metrics_age_s", "state")}  # noqa: E731
    assert [strip(o) for o in again["outcomes"]] == [strip(o) for o in result["outcomes"]]
    assert again["claims"] == result["claims"]
    # a swapped folder is refused: its config is another arm's arithmetic
    with pytest.raises(ValueError, match=r"--runs\W+paper=.*attention\.precision=fp32"):
        run_natural(preset, tmp_path / "c", runs={"paper": out / "runs" / "fp32"}, log=lambda m: None)


@pytest.mark.parametrize("args,msg", [
    (["--preset", "micro"], ("natural", "'micro'")),
    (["--seeds", "1"], ("--seeds", "natural")),            # the option, and the experiment it is not for
    (["--claims", "C1"], ("--claims", "natural")),
    (["--remedies"], ("--remedies", "natural")),
    (["--steps", "0"], ("--steps", "1")),
    (["attention.precision=fp32"], ("attention.precision", "arms")),   # the key, and who sets it
    (["attention.backend=sdpa"], ("attention.backend", "arms")),
    (["train.steps=5"], ("train.steps", "arms")),
    (["--runs", "paper"], ("ARM=DIR", "paper")),
    (["model.n_layer=2", "--runs", "paper=/x"], ("--runs", "model.n_layer=2")),   # no overrides with --runs
    (["--runs", "paper=/x", "model.n_layer=2"], ("--runs", "'model.n_layer'")),  # --runs takes the rest
    (["attention.block_q=0"], ("attention.block_q",)),   # any bad override: refused before anything trains
    (["--arms", "fp32,nope"], ("--arms", "'nope'", "paper-fix")),   # the arm, and the preset's arms
    (["--arms", " , "], ("--arms", "no arm given")),
    (["--arms", "fp32", "--runs", "fp32=/x"], ("--arms", "--runs")),  # train or analyse, not both
])
def test_bad_natural_arguments_name_the_problem(tiny_data, tmp_path, capsys, args, msg):
    code = cli_exit(["natural", "--preset", "natural-smoke", "--out", str(tmp_path / "x"),
                 *([] if "--runs" in args else [f'data.dir="{tiny_data}"']), *args]
                if "--preset" not in args else ["natural", "--out", str(tmp_path / "x"),
                                                *args])
    err = capsys.readouterr().err
    assert code == 2 and all(m in err for m in msg), err
    assert not (tmp_path / "x" / "runs").exists()


def test_arms_trains_only_the_named_arms_and_judges_what_is_there(tiny_data, tmp_path, capsys):
    out = tmp_path / "two"
    data = [f'data.dir="{tiny_data}"']
    assert main(["natural", "--preset", "natural-smoke", "--arms", "paper,fp32", "--out", str(out), *data]) == 0
    assert sorted(p.name for p in (out / "runs").iterdir()) == ["fp32", "paper"]
    saved = json.loads((out / "natural.json").read_text())
    status = {o["arm"]: o["status"] for o in saved["outcomes"]}
    assert status["fp32"] in ("done", "diverged") and status["paper"] in ("done", "diverged")
    assert status["paper-fix"] == status["paper-fp32fwd"] == "missing"
    assert "[1/2] fp32" in capsys.readouterr().out   # the preset's order, whatever the order given
