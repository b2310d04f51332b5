"""The command line as a new user meets it: --help, default output folders, refused arguments."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from flashguard.attention import STABILIZERS
from flashguard.cli import lab_out, main
from flashguard.experiments.repro.presets import PRESETS
from flashguard.numerics import POLICIES
from flashguard.train.shipped import shipped_configs


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())   # argparse wraps lines


def test_help_lists_the_valid_values_from_the_registries(capsys):
    top = _help(capsys)
    for command in ("demo", "showcase", "prepare", "train", "lab", "diagnose", "repro", "report"):
        assert f"{command} " in top
    assert "First look: `flashguard showcase`" in top   # prose check: user-facing summary
    values = [*POLICIES, *STABILIZERS, *shipped_configs(), *PRESETS]
    assert len(values) > 10
    for name in values:
        assert name in top, name
    for command in ("train", "lab", "repro"):
        text = _help(capsys, command)
        assert "Valid values:" in text and all(n in text for n in POLICIES) and all(n in text for n in STABILIZERS)
    squeezed = "".join(_help(capsys, "lab").split())   # argparse may break a name at its hyphen
    assert "testedin:" + ",".join(POLICIES) in squeezed


@pytest.mark.parametrize("command,words", [
    ("demo", ["corpus", "C1", "C5", "C6", "C8", "report.html", "--keep-checkpoints"]),   # names, keys, files
    ("showcase", ["noise floor"]),
    ("lab", ["ties", "noise floor", "lab-PRECISION"]),
    ("repro", ["C1-C6", "C8", "Resumable"]),
    ("train", ["tiny-cpu", "TOML"]),
])
def test_each_command_describes_itself(capsys, command, words):
    text = _help(capsys, command)
    for w in words:
        assert w in text, w


def _experiments() -> dict:
    """Each experiment command -> (its presets, the options it takes)."""
    from flashguard.experiments.edge.presets import EDGE_PRESETS
    from flashguard.experiments.injection.presets import INJECTION_PRESETS
    from flashguard.experiments.lr_sensitivity.presets import LR_PRESETS
    from flashguard.experiments.natural.presets import NATURAL_PRESETS
    trains = {"--preset", "--steps", "--out"}
    return {"repro": (PRESETS, trains | {"--claims", "--remedies"}),
            "injection": (INJECTION_PRESETS, trains | {"--seeds"}),
            "lr-sensitivity": (LR_PRESETS, trains | {"--seeds"}),
            "natural": (NATURAL_PRESETS, trains | {"--runs", "--arms"}),
            "early-warning": ({}, {"--runs", "--out"}),
            "edge": (EDGE_PRESETS, trains | {"--seeds"})}


@pytest.mark.parametrize("command", ["repro", "injection", "lr-sensitivity", "natural", "early-warning", "edge"])
def test_each_experiment_is_a_command_with_its_own_options_and_presets(capsys, command):
    presets, options = _experiments()[command]
    assert f" {command} " in _help(capsys)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    usage = " ".join(capsys.readouterr().out.split("\n\n")[0].split())   # argparse wraps lines
    assert set(re.findall(r"--[a-z-]+", usage)) == options
    choices = re.search(r"--preset \{([^}]*)\}", usage)
    assert (choices[1].split(",") if choices else []) == list(presets)


def test_lab_default_folder_is_named_by_precision(tmp_path, monkeypatch, capsys):
    import flashguard.experiments.lab as lab
    import flashguard.experiments.lab.report as report
    written = []
    monkeypatch.setattr(lab, "run_lab", lambda **kw: {"verdicts": {"(i)": "held"}, "answers": {}, "rows": [],
                                                      "runtime_s": 0.0, "policy": kw["precision"]})
    monkeypatch.setattr(report, "write_lab", lambda result, out: written.append(str(out)) or {"md": Path(out) / "lab.md"})
    monkeypatch.chdir(tmp_path)
    for args in ([], ["--precision", "paper"], ["--precision", "fp32"], ["--precision", "fa2-e4m3"],
                 ["--precision", "paper[pv=fp32]"], ["--precision", "fp32", "--out", "mine"]):
        assert main(["lab", "--quick", *args]) == 0
    assert written == ["lab", "lab", "lab-fp32", "lab-fa2-e4m3", "lab-paper_pv=fp32", "mine"]
    assert len({lab_out(p) for p in POLICIES}) == len(POLICIES)   # no two policies share a folder
    assert main(["lab", "--precision", "fp31"]) == 2               # a typo: refused before anything runs
    assert "'fp31'" in capsys.readouterr().err and len(written) == 6


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_demo_refuses_steps_below_one_before_doing_anything(tmp_path, monkeypatch, capsys, steps):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--steps", steps]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(rf"--steps\b.*>= 1\b.*{re.escape(steps)}$", err), err   # the option, its bound, the value
    assert not list(tmp_path.iterdir())   # no corpus prepared, no demo folder


def test_demo_drops_only_finished_runs_checkpoints(tmp_path):
    from flashguard.experiments.demo import _drop_checkpoints
    for name in ("done", "partial", "diverged"):
        (tmp_path / "runs" / name / "checkpoints").mkdir(parents=True)
        (tmp_path / "runs" / name / "checkpoints" / "ckpt_0000003.pt").write_bytes(b"x" * 100)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text("{}\n")
    result = {"runs": [{"dir": f"runs/{n}", "summary": {"status": n}} for n in ("done", "partial", "diverged")]}
    assert _drop_checkpoints(tmp_path, result) == 200
    assert [p.parent.parent.name for p in tmp_path.rglob("*.pt")] == ["partial"]   # still resumable
    assert all((tmp_path / "runs" / n / "metrics.jsonl").is_file() for n in ("done", "partial", "diverged"))
