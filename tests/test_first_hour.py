"""The first hour as a new user meets it (issue 13 item 8): one check each, with a known answer."""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import flashguard
from flashguard.cli import lab_out, main
from flashguard.numerics import POLICIES

ROOT = Path(__file__).resolve().parents[1]


def _help(capsys, *args) -> str:
    with pytest.raises(SystemExit) as e:
        main([*args, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _subcommand_help() -> dict[str, str]:
    """Each command's one-line help, as the top-level parser holds it."""
    seen = {}
    real = argparse._SubParsersAction.add_parser

    def spy(self, name, **kw):
        seen[name] = kw.get("help")
        return real(self, name, **kw)
    argparse._SubParsersAction.add_parser = spy
    try:
        with pytest.raises(SystemExit):
            main(["--help"])
    finally:
        argparse._SubParsersAction.add_parser = real
    return seen


def test_help_describes_the_first_commands_in_one_line_each_and_lists_valid_values(capsys):
    helps = _subcommand_help()
    capsys.readouterr()
    for command in ("demo", "repro", "showcase", "lab"):
        assert helps.get(command) and "\n" not in helps[command] and len(helps[command]) < 120, command
    top = " ".join(_help(capsys).split())
    for command in ("demo", "repro", "showcase", "lab"):
        assert f"{command} {' '.join(helps[command].split())}" in top
    assert "Valid values:" in top and all(p in top for p in POLICIES)


def test_readme_points_to_showcase_as_the_first_look():
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set-up"):]
    first = setup[:setup.index("\n\n", setup.index("\n\n") + 2)]   # the section's first paragraph
    assert "first look" in first.lower() and "`flashguard showcase`" in first   # prose check: user-facing summary
    assert setup.index("flashguard showcase") < setup.index("flashguard demo")


def test_lab_policy_without_out_leaves_the_other_policies_results(tmp_path, monkeypatch, capsys):
    import flashguard.experiments.lab as lab
    import flashguard.experiments.lab.report as report

    def write(result, out):   # stands in for the lab's writer: one file naming the policy
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "lab.json").write_text(result["policy"])
        return {"md": Path(out) / "lab.md"}
    monkeypatch.setattr(lab, "run_lab", lambda **kw: {"verdicts": {"(i)": "held"}, "answers": {}, "rows": [],
                                                      "runtime_s": 0.0, "policy": kw["precision"]})
    monkeypatch.setattr(report, "write_lab", write)
    monkeypatch.chdir(tmp_path)
    for policy in ("paper", "fp32", "fa2-e4m3"):
        assert main(["lab", "--quick", "--precision", policy]) == 0
    assert {p: (tmp_path / lab_out(p) / "lab.json").read_text() for p in ("paper", "fp32", "fa2-e4m3")} == \
        {"paper": "paper", "fp32": "fp32", "fa2-e4m3": "fa2-e4m3"}


@pytest.mark.parametrize("steps", ["0", "-1"])
def test_demo_steps_below_one_is_refused_clearly(tmp_path, monkeypatch, capsys, steps):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--steps", steps]) == 2
    err = capsys.readouterr().err
    prog, _, message = err.partition(": error: ")   # one argparse-style line: the command, then the problem
    assert prog == "flashguard demo" and message.startswith("--steps") and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("where,value,key", [
    ("override", "attention.precision=papr", "attention.precision"),
    ("override", 'attention.precision="paper[pvv=fp32]"', "attention.precision"),
    ("override", "attention.layers.1.precision=papr", "attention.layers.1.precision"),
    ("override", "attention.stabilizer=saf", "attention.stabilizer"),
    ("file", 'precision = "papr"', "attention.precision"),
])
def test_a_precision_typo_names_the_config_key_not_a_class(tmp_path, capsys, where, value, key):
    if where == "file":
        cfg = tmp_path / "mine.toml"
        cfg.write_text(f'[model]\npreset = "micro"\n[attention]\n{value}\n')
        args = ["train", str(cfg), "--out", str(tmp_path / "run")]
    else:
        args = ["train", "micro", "--out", str(tmp_path / "run"), value]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    prog, _, message = err.partition(": error: ")
    assert prog == "flashguard train" and message.startswith(f"{key}: "), err   # the config key first
    assert len(err.split("\n")) == 1
    assert not re.search(r"PrecisionPolicy|Stabilizer\b|SpecError|ConfigError|Traceback", err), err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.bfloat16, torch.bfloat16),
                                    (torch.bfloat16, torch.bfloat16, torch.float16),
                                    (torch.float16, torch.float32, torch.float16)])
def test_mixed_input_dtypes_are_refused_as_torch_sdpa_refuses_them(dtypes):
    q, k, v = (torch.randn(1, 2, 16, 8).to(d) for d in dtypes)
    with pytest.raises(RuntimeError):
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with pytest.raises(TypeError, match="same dtype"):
        flashguard.scaled_dot_product_attention(q, k, v)
    with flashguard.override_sdpa(precision="paper"), pytest.raises(TypeError, match="same dtype"):
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    same = [x.to(torch.bfloat16) for x in (q, k, v)]   # and one dtype is accepted by both
    assert flashguard.scaled_dot_product_attention(*same).shape == torch.nn.functional.scaled_dot_product_attention(
        *same).shape


def _default_outs(capsys) -> list[str]:
    """The folders the commands write into by default, read from their --help."""
    outs = []
    for command in ("demo", "audit"):
        text = " ".join(_help(capsys, command).split())
        outs += re.findall(r"--out OUT output folder \(default: ([\w./-]+)\)", text)
    demo = " ".join(_help(capsys, "demo").split())
    outs += re.findall(r"--data DATA corpus folder, prepared there if missing \(default: ([\w./-]+)\)", demo)
    outs += [lab_out("paper")] + [lab_out(p) for p in POLICIES] + [lab_out("paper[pv=fp32]")]
    outs += ["demo/report", "runs/tiny"]   # report's default (FIRST_DIR/report) and the README's train examples
    return outs


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs the git checkout")
def test_default_output_folders_are_gitignored(capsys):
    outs = _default_outs(capsys)
    assert {"demo", "audit", "data/embedded", "lab", "lab-fp32"} <= set(outs)
    for out in outs:
        probe = f"{out}/some-file"
        r = subprocess.run(["git", "check-ignore", "-q", "--no-index", probe], cwd=ROOT)
        assert r.returncode == 0, f"{out}/ is not ignored by .gitignore"
