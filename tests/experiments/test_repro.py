"""`flashguard repro`: the claims' verdict logic on fabricated run summaries and probe series, and a smoke run
of every run and claim on the micro preset (and the study's GPT-2 preset at reduced size)."""
import json
import math
import re

import pytest
from md_helpers import numbers
from run_helpers import cli_exit, interrupted

from flashguard import keys
from flashguard.cli import main
from flashguard.experiments.repro import CLAIMS, get_preset, judge_claims, run_repro, run_specs
from flashguard.train import JsonlLog


def _s(diverged_at=None, status=None, steps=100):
    return {"steps": steps, "final_loss": 1.0, "min_loss": 0.9, "diverged_at": diverged_at,
            "status": status or ("diverged" if diverged_at is not None else "done")}


def _verdicts(**runs):
    summaries = {n.replace("_", "-"): s for n, s in runs.items()}
    return {c["id"]: c["verdict"] for c in judge_claims(summaries, {}, 1, ["C1", "C2", "C3", "C4", "C8"])}


def test_verdicts_when_the_paper_run_diverges_and_the_ablations_behave_as_the_study_says():
    v = _verdicts(fp32=_s(), paper=_s(50), paper_fix=_s(), paper_fp32fwd=_s(), no_tiling=_s(60),
                  **{"flash_layer1": _s(70), "fp32_layer1": _s()}, delta_o_highp=_s(), delta_dp_p=_s(), pv_fp32=_s())
    assert v == {"C1": "held", "C2": "held", "C3": "held", "C4": "held", "C8": "held"}


def test_verdicts_when_the_ablations_contradict_the_study():
    v = _verdicts(fp32=_s(), paper=_s(50), paper_fix=_s(80), paper_fp32fwd=_s(), no_tiling=_s(),
                  **{"flash_layer1": _s(), "fp32_layer1": _s()}, delta_o_highp=_s(), delta_dp_p=_s(90), pv_fp32=_s())
    assert v == {"C1": "held", "C2": "not held", "C3": "not held", "C4": "not held", "C8": "not held"}


def test_nothing_to_localise_without_a_failure_and_fp32_failing_is_not_a_precision_effect():
    calm = _verdicts(fp32=_s(), paper=_s(), paper_fix=_s(), paper_fp32fwd=_s(), no_tiling=_s(),
                     **{"flash_layer1": _s(), "fp32_layer1": _s()}, delta_o_highp=_s(), delta_dp_p=_s(), pv_fp32=_s())
    assert calm["C1"] == "not held" and {calm[c] for c in ("C2", "C3", "C4", "C8")} == {"inconclusive"}
    assert _verdicts(fp32=_s(40), paper=_s(50))["C1"] == "inconclusive"
    assert _verdicts(fp32=_s(), paper=_s(status="partial"))["C1"] == "inconclusive"


def _probed_paper_run(tmp_path, n, *, rank1, cos, delta, layer=1):
    """A fabricated `paper` run folder: n probes of ``layer`` with these W_Q gradient-error
    rank-1 shares and cosines (functions of the probe index; no cosine at the first probe, as
    the probes write it) and mean delta errors."""
    run = tmp_path / f"paper-{len(list(tmp_path.iterdir()))}"
    run.mkdir()
    recs = []
    for i in range(n):
        r = {"step": 10 * i, "loss/train": 2.0, keys.WQ_ERR_RANK1_FRAC.key(layer): rank1(i),
             keys.DELTA_ERR_MEAN.key(layer): delta(i)}
        if i:
            r[keys.WQ_ERR_COS_PREV.key(layer)] = cos(i)
        recs.append(r)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def _mechanism(run, claim):
    (c,) = judge_claims({}, {"paper": run}, 1, [claim])
    return c


@pytest.mark.parametrize("rank1, cos, verdict", [
    (lambda i: 0.9, lambda i: 0.6 + 0.01 * i, "held"),             # rank one, and it points the same way
    (lambda i: 0.9, lambda i: (-1) ** i * 0.6, "not held"),         # rank one, direction does not persist
    (lambda i: 0.3, lambda i: 0.6, "not held"),                     # persists but spread over many directions
    (lambda i: 0.9, lambda i: -0.6, "not held"),                    # anti-aligned: the errors cancel
])
def test_c5_verdict_on_planted_gradient_error_structure(tmp_path, rank1, cos, verdict):
    c = _mechanism(_probed_paper_run(tmp_path, 20, rank1=rank1, cos=cos, delta=lambda i: 0.0), "C5")
    assert c["verdict"] == verdict, c["evidence"]
    assert c["numbers"]["probes"] == 20


@pytest.mark.parametrize("delta, verdict, why", [
    (lambda i: 1e-4 * (1 + 0.5 * math.sin(i)), "held", None),     # the study's bias: positive every probe
    (lambda i: (-1) ** i * 1e-4, "not held", "no consistent sign"),  # unbiased noise
    (lambda i: -1e-4, "not held", None),                            # biased, but the other way
])
def test_c6_verdict_on_a_planted_delta_bias(tmp_path, delta, verdict, why):
    c = _mechanism(_probed_paper_run(tmp_path, 20, rank1=lambda i: 0.9, cos=lambda i: 0.6, delta=delta), "C6")
    assert c["verdict"] == verdict, c["evidence"]
    assert why is None or why in c["evidence"]
    assert c["numbers"]["pos"] + c["numbers"]["neg"] == 20


def test_c5_c6_need_enough_probes_of_the_focus_layer(tmp_path):
    few = _probed_paper_run(tmp_path, 5, rank1=lambda i: 0.9, cos=lambda i: 0.6, delta=lambda i: 1e-4)
    other = _probed_paper_run(tmp_path, 20, rank1=lambda i: 0.9, cos=lambda i: 0.6, delta=lambda i: 1e-4, layer=0)
    for run in (few, other):
        for claim in ("C5", "C6"):
            assert _mechanism(run, claim)["verdict"] == "inconclusive"
    assert judge_claims({}, {}, 1, ["C5"])[0]["verdict"] == "inconclusive"   # no paper run


def test_run_specs_differ_from_the_paper_run_in_one_option():
    specs = {s.name: s for s in run_specs("paper[pv=e8m4]", 1, 256, remedies=True)}
    assert set(specs) >= {"fp32", "paper", "paper-fix", "paper-fp32fwd", "no-tiling", "fp32-layer1", "flash-layer1",
                          "delta-o-highp", "delta-dp-p", "pv-fp32", "qk-layernorm", "z-loss", "softcap"}
    assert specs["paper"].overrides == ("attention.precision=paper[pv=e8m4]",)
    assert specs["paper-fp32fwd"].overrides == ("attention.precision=paper[scores=fp32,stats=fp32,pv=fp32,o_accum=fp32,lse=fp32]",)
    assert {s.name: s for s in run_specs("paper", 1, 256)}["paper-fp32fwd"].overrides == (
        "attention.precision=paper-fp32fwd",)
    assert "attention.precision=paper[pv=e8m4,delta_source=dp_p]" in specs["delta-dp-p"].overrides
    assert "attention.precision=paper[pv=fp32]" in specs["pv-fp32"].overrides
    assert specs["flash-layer1"].overrides == ("attention.precision=fp32", "attention.layers.1.precision=paper[pv=e8m4]")


def test_repro_smoke_on_micro_every_claim_matched_batches_and_resume(tiny_data, tmp_path, monkeypatch):
    out = tmp_path / "repro"
    data = [f'data.dir="{tiny_data}"', "train.checkpoint_every=10"]
    # the first run is interrupted after its step-20 checkpoint
    interrupted(monkeypatch, 25, lambda: run_repro(get_preset("micro"), out, remedies=True, overrides=data,
                                                   progress=False, log=lambda m: None))
    result = run_repro(get_preset("micro"), out, remedies=True, overrides=data, progress=False, log=lambda m: None)
    saved = json.loads((out / "repro.json").read_text())
    assert saved["claims"] == json.loads(json.dumps(result["claims"]))
    assert [c["id"] for c in saved["claims"]] == list(CLAIMS)
    assert all(c["verdict"] in ("held", "not held", "inconclusive") and c["evidence"] for c in saved["claims"])
    assert len(saved["runs"]) == 13 and all(r["summary"]["status"] in ("done", "diverged") for r in saved["runs"])
    assert {m["name"] for m in saved["remedies"]} == {"paper", "qk-layernorm", "z-loss", "softcap", "fp32",
                                                      "paper-fix", "paper-fp32fwd"}
    # matched runs: the same batches, step for step (the interrupted run included)
    batches = {r["name"]: JsonlLog.read(out / r["dir"] / "batches.jsonl") for r in saved["runs"]}
    assert all(b == batches["paper"] for b in batches.values()) and len(batches["paper"]) == 40
    # the probes ran on the focus layer (C5/C6 read them)
    paper = JsonlLog.read(out / "runs" / "paper" / "metrics.jsonl")
    assert sum("numerics/delta_err_mean/L1" in r for r in paper) == 4
    text = (out / "claims.md").read_text()
    assert all(f"| {c}: " in text for c in CLAIMS)
    # a second call trains nothing
    before = {r["name"]: (out / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in saved["runs"]}
    run_repro(get_preset("micro"), out, remedies=True, overrides=data, progress=False, log=lambda m: None)
    assert before == {r["name"]: (out / r["dir"] / "metrics.jsonl").stat().st_mtime_ns for r in saved["runs"]}


def test_study_preset_starts_at_reduced_size(tiny_data, tmp_path, capsys):
    out = tmp_path / "gpt2"
    code = main(["repro", "--preset", "gpt2-124m-owt", "--claims", "C1", "--steps", "2", "--out", str(out),
                 f'data.dir="{tiny_data}"', "model.n_layer=2", "model.n_head=2", "model.n_embd=64",
                 "model.block_size=64", "data.batch_size=2", "train.grad_accum=1", "train.eval_every=0",
                 "train.progress=false"])
    assert code == 0
    saved = json.loads((out / "repro.json").read_text())
    assert saved["preset"] == "gpt2-124m-owt" and [c["id"] for c in saved["claims"]] == ["C1"]
    from flashguard.train import load_config
    cfg = load_config(out / "runs" / "paper" / "config.toml")
    assert cfg.model.preset == "gpt2-124m" and cfg.optim.lr == 0.001
    assert "C1" in capsys.readouterr().out


@pytest.mark.parametrize("args, msg", [
    (["--claims", "C9"], "C9"),
    (["--preset", "huge"], "huge"),
    (["model.n_layer=1"], "focus layer 1"),
    (["--seeds", "1"], "--seeds"),             # the other experiments' options are not repro's
    (["--runs", "x"], "--runs"),
])
def test_bad_repro_arguments_name_the_problem(tiny_data, tmp_path, capsys, args, msg):
    code = cli_exit(["repro", "--preset", "micro", "--out", str(tmp_path / "r"), f'data.dir="{tiny_data}"', *args]
                if "--preset" not in args else ["repro", "--out", str(tmp_path / "r"), *args])
    assert code == 2
    assert msg in capsys.readouterr().err


def test_demo_writes_the_report_and_resumes(tiny_data, tmp_path, capsys):
    """`flashguard demo` end to end at 3 steps per run (the real lab, runs and report)."""
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--data", str(tiny_data), "--steps", "3"]) == 0
    printed = capsys.readouterr().out
    html = (out / "report" / "report.html").read_text()
    assert f"report: {(out / 'report' / 'report.html').resolve()}" in printed
    saved = json.loads((out / "repro.json").read_text())
    assert [c["id"] for c in saved["claims"]] == ["C1", "C5", "C6", "C8"] and saved["lab"] == "lab"
    assert {r["name"] for r in saved["runs"]} == {"fp32", "paper", "paper-fix", "paper-fp32fwd"}
    assert html.count("data:image/png;base64,") >= 4 and "C8" in html
    assert (out / "lab" / "lab.json").exists()
    # the causal comparison ran its three arms (at --steps too) and the report shows it
    inj = json.loads((out / "injection" / "injection.json").read_text())
    assert inj["steps"] == 3 and {r["name"] for r in inj["runs"]} == {"real-a1", "coherent-p0.75-a1", "zero-mean-a100"}
    assert any(h.startswith("Error injection") for h in re.findall(r"<h2>(.*?)</h2>", html))   # its section
    # the edge sample: its four arms, two seeds, and the full result cited beside it
    edge = json.loads((out / "edge" / "edge.json").read_text())
    assert edge["steps"] == 3 and edge["seeds"] == [1, 2] and len(edge["runs"]) == 8
    assert "[5/6]" in printed   # the stage, and each arm's divergences in the sample
    assert all(f"{a['label']} {a['diverged']}/{a['finished']}" in printed for a in edge["by_lr"][0]["arms"])
    # finished runs keep no checkpoints (the report reads their metrics): megabytes, not 40 MB per checkpoint
    assert not list(out.rglob("*.pt"))
    (freed,) = [line for line in printed.splitlines() if "checkpoints" in line and " MB" in line]   # and says so
    assert numbers(freed)[0] > 0
    # a second call resumes: nothing is trained or measured again
    stamp = (out / "lab" / "lab.json").stat().st_mtime_ns
    assert main(["demo", "--out", str(out), "--data", str(tiny_data), "--steps", "3"]) == 0
    assert (out / "lab" / "lab.json").stat().st_mtime_ns == stamp
    assert "already done" in capsys.readouterr().out
