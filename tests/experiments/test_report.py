"""`flashguard report`: report.md, report.html and figures from a synthetic repro folder."""
from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from flashguard.experiments.report import add_report_arguments, run_report, write_report
from md_helpers import headings, numbers, section, tables

PNG = b"\x89PNG\r\n\x1a\n"
STEPS = 120


def _records(kind: str, probes: bool) -> list[dict]:
    """Synthetic metrics: loss falls; "diverge" jumps at step 80 and turns non-finite at 90."""
    recs = []
    for step in range(STEPS):
        loss = 5.0 * math.exp(-step / 40) + 1.5
        if kind == "diverge" and step >= 80:
            loss = float("nan") if step >= 90 else 8.0 + step
        r = {"step": step, "loss/train": loss, "optim/lr": 1e-3, "grad/norm": 1.0 + step / 100}
        if step % 20 == 0:
            r["loss/val"] = loss + 0.1
        if probes and step % 10 == 0:
            grow = 1.0 + (0.03 if kind == "diverge" else 0.005) * step
            for layer in (0, 1):
                for h in range(2):
                    r[f"weights/wq_spectral_norm/L{layer}H{h}"] = grow * (1 + 0.1 * h)
                r[f"weights/wq_spectral_norm_max/L{layer}"] = grow * 1.1
                for i in range(1, 5):
                    r[f"grad/wq_err_sv{i}/L{layer}"] = 1e-4 / i ** 2
                r[f"grad/wq_err_rank1_frac/L{layer}"] = 0.8
                r[f"grad/wq_err_cos_sum/L{layer}"] = 0.5 if step else 0.0
                r[f"numerics/delta_err_mean/L{layer}"] = 1e-3
                r[f"numerics/delta_err_cumsum/L{layer}"] = 1e-3 * (step // 10 + 1)
        recs.append(r)
    return recs


def _write_run(d, kind="stable", probes=True, cut=False, precision="paper"):
    d.mkdir(parents=True)
    lines = "".join(json.dumps(r) + "\n" for r in _records(kind, probes))  # NaN written as NaN, as the trainer does
    if cut:
        lines += '{"step": 120, "loss/tr'
    (d / "metrics.jsonl").write_text(lines)
    (d / "config.toml").write_text(f'[attention]\nprecision = "{precision}"\n[optim]\nwarmup_steps = 5\n'
                                   f"[train]\nsteps = {STEPS}\n")
    return d


def _write_lab(d):
    d.mkdir(parents=True)
    result = {"quick": True, "policy": "paper", "seed": 0, "runtime_s": 1.0, "versions": {"torch": "x"}, "rows": [],
              "verdicts": {"i_tie_bias": "held", "ii_no_ties_no_bias": "not held"},
              "details": {"i_tie_bias": ["k=2: O biased +"], "ii_no_ties_no_bias": ["k=1: O biased -"]}}
    (d / "lab.json").write_text(json.dumps(result))
    (d / "lab.md").write_text("# lab\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1])
    fig.savefig(d / "bias_vs_k.png")
    plt.close(fig)
    return d


CLAIMS = [{"id": "C1", "title": "BF16 flash attention training explodes; fp32 attention does not", "verdict": "held",
           "evidence": "paper run diverged at step 80", "numbers": {"paper_diverged_at": 80}},
          {"id": "C2", "title": "the paper's fix removes it", "verdict": "not held", "evidence": "a | pipe"},
          {"id": "C3", "title": "localised to one layer", "verdict": "inconclusive", "evidence": "n/a"}]


@pytest.fixture
def repro(tmp_path):
    d = tmp_path / "repro"
    _write_run(d / "runs" / "paper", "diverge", cut=True)       # cut last line, a NaN loss, a jump
    _write_run(d / "runs" / "fp32", precision="fp32")
    _write_run(d / "runs" / "safe", probes=False)                 # no probe metrics at all
    _write_run(d / "runs" / "qk-layernorm")
    _write_lab(d / "lab")
    runs = [{"name": n, "group": g, "title": n, "dir": f"runs/{n}", "overrides": [],
             "summary": {"steps": STEPS, "final_loss": 1.6, "min_loss": 1.5,
                         "diverged_at": 80 if n == "paper" else None,
                         "max_grad_norm": 2.2, "last_val": 1.7, "wall_s": 1.0,
                         "status": "diverged" if n == "paper" else "done"}}
            for n, g in [("paper", "main"), ("fp32", "main"), ("safe", "main"), ("qk-layernorm", "remedy")]]
    runs.append({"name": "paper-fix", "group": "main", "title": "never started", "dir": "runs/paper-fix",
                 "summary": {"status": "missing"}})
    (d / "repro.json").write_text(json.dumps({
        "preset": "tiny-cpu", "config": "configs/tiny-cpu.toml", "steps": STEPS, "seed": 1337,
        "base_precision": "paper", "focus_layer": 1,
        "versions": {"flashguard": "0.1.0", "torch": "2.x", "python": "3.11"}, "runs": runs, "claims": CLAIMS,
        "remedies": [{"name": "qk-layernorm", "title": "QK-LayerNorm", "diverged_at": None, "final_loss": 1.6,
                      "min_loss": 1.5}], "lab": "lab"}))
    return d


def _check_png(path):
    from PIL import Image
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 1000, path
    with Image.open(path) as im:
        assert im.size[0] > 0 and im.size[1] > 0


def test_repro_report(repro, tmp_path):
    paths = write_report([repro], tmp_path / "out")
    md, page = paths["md"].read_text(), paths["html"].read_text()
    names = sorted(p.name for p in paths["figures"])
    assert names == sorted(["loss.png", "wq_norms.png", "wq_norms_layers.png", "grad_error.png", "delta_bias.png",
                            "bias_vs_k.png"])
    for p in paths["figures"]:
        _check_png(p)
        assert f"figures/{p.name}" in md
    # a row per claim with its verdict, in both files; verdict cells coloured in the HTML
    rows = [row for table in tables(md) for row in table[1:]]
    for c in CLAIMS:
        assert any(row[0] == c["id"] and f"**{c['verdict']}**" in row[1:] for row in rows), c["id"]
    assert "a \\| pipe" in md
    for cls in ("v-held", "v-not-held", "v-inconclusive"):
        assert f'<td class="{cls}">' in page
    # runs, remedies, lab verdicts, provenance
    # a run: its steps, losses and divergence step
    assert ["paper", "main", "paper", "120", "1.6", "1.5", "80"] in [row[:7] for row in rows]
    assert any(row[0] == "paper-fix" for row in rows) and "missing" in md
    assert "## Remedies" in md and "QK-LayerNorm" in md
    assert "(i) tied maxima" in md and "torch 2.x" in md and "seed 1337" in md
    # self-contained HTML: every image embedded, nothing fetched from elsewhere
    assert page.count("data:image/png;base64,") == len(paths["figures"])
    assert not re.search(r"""(src|href)\s*=\s*["'](?!data:)""", page)
    assert "<link" not in page and "@import" not in page
    assert not list((tmp_path / "out").rglob("*.tmp"))


def test_run_report_prints_the_html_path_and_defaults_out(repro, capsys):
    parser = argparse.ArgumentParser()
    add_report_arguments(parser)
    assert run_report(parser.parse_args([str(repro)])) == 0
    html = repro / "report" / "report.html"
    assert capsys.readouterr().out.strip() == f"report: {html.resolve()}"
    assert html.is_file()


def test_plain_run_folder_alone(tmp_path):
    run = _write_run(tmp_path / "run", "diverge", probes=False, cut=True)
    paths = write_report([run], tmp_path / "out")
    md = paths["md"].read_text()
    assert [p.name for p in paths["figures"]] == ["loss.png"]
    _check_png(paths["figures"][0])
    assert "No claims" in md and "| run | main |" in md and "diverged" in md
    # figures without data are skipped with a line saying so
    assert "W_Q norms: skipped" in md and "delta bias: skipped" in md and "No lab folder" in md


def test_several_run_folders_and_a_lab_folder(tmp_path):
    a = _write_run(tmp_path / "a" / "paper")
    b = _write_run(tmp_path / "b" / "paper", precision="fp32")
    lab = _write_lab(tmp_path / "lab")
    paths = write_report([a, b, lab], tmp_path / "out")
    md = paths["md"].read_text()
    assert "| paper | main |" in md and "| b/paper | main |" in md and "paper, fp32" in md
    assert "bias_vs_k.png" in [p.name for p in paths["figures"]]


@pytest.mark.parametrize("make", ["wrong_kind", "missing", "a_file", "empty_lab", "missing_lab"])
def test_bad_input_raises_value_error_naming_the_folder(make, tmp_path):
    bad = tmp_path / make
    if make == "wrong_kind":
        bad.mkdir()
        (bad / "notes.txt").write_text("x")
    elif make == "a_file":
        bad.write_text("x")
    elif make == "empty_lab":
        bad.mkdir()
    run = _write_run(tmp_path / "run")
    dirs, lab = ([run], bad) if make.endswith("lab") else ([bad], None)
    with pytest.raises(ValueError, match="expected") as e:
        write_report(dirs, tmp_path / "out", lab=lab)
    assert str(bad) in str(e.value) and "lab.json" in str(e.value)
    assert not (tmp_path / "out" / "report.md").exists()


def test_two_repro_folders_are_refused(repro):
    with pytest.raises(ValueError, match="one repro folder"):
        write_report([repro, repro], repro / "out")


def test_census_section_from_diagnose_json_and_none_without_probe_data(tmp_path):
    from flashguard import keys
    run = _write_run(tmp_path / "plain", probes=False)
    md = write_report([run], tmp_path / "r0")["md"].read_text()
    assert not any(h.startswith("Preconditions") for h in headings(md))   # no probe data: no section
    # a diagnosed checkpoint: one probe with planted ties at the sink and a positive delta lean
    metrics = {keys.TIE_RATE.key(0): 0.2, keys.EXACT_TIE_RATE.key(0): 0.2, keys.TIE_AT_SINK.key(0): 0.9,
               keys.TIE_AT_SINK_CHANCE.key(0): 0.05, keys.PBAR_ONE_MULTI.key(0): 0.2,
               keys.SINK_MASS.key(0, 0): 0.6, keys.V_SIGN_AGREE.key(0): 0.95, keys.O_ERR_Z_ROW.key(0): -9.0,
               keys.O_ERR_RATIO_ROW.key(0): -0.4, keys.DELTA_ERR_Z_ROW.key(0): 7.0,
               keys.DELTA_ERR_RATIO_ROW.key(0): 0.3}
    (run / "diagnostics").mkdir()
    (run / "diagnostics" / "diagnose_0000120.json").write_text(json.dumps({"step": 120, "metrics": metrics}))
    (run / "diagnostics" / "diagnose_0000121.json").write_text("{ not json")   # skipped, not fatal
    md = write_report([run], tmp_path / "r1")["md"].read_text()
    body = section(md, "Preconditions census")
    (run_line,) = [line for line in body.splitlines() if line.startswith("Run ")]   # where it was read, the step
    assert "`flashguard diagnose`" in run_line and "diagnostics/" in run_line and numbers(run_line)[0] == 120
    assert "7 present" in body and body.count("| **present** |") == 7
    html = (tmp_path / "r1" / "report.html").read_text()
    assert 'class="v-present"' in html
