"""The first hour, issue 22 item 4: what the shipped tiny-cpu config trains is said where a new user
looks, and an option that is really a config key is answered with the override to write."""
from __future__ import annotations

from pathlib import Path

import pytest

from flashguard.cli import main
from flashguard.train import load_config
from flashguard.train.shipped import config_precision, find_config, shipped_configs

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_cpu_says_on_its_first_line_that_it_trains_the_reference_arithmetic_on_purpose():
    first = find_config("tiny-cpu").read_text().split("\n", 1)[0]
    assert first.startswith("#") and "paper" in first and "on purpose" in first.lower()
    text = find_config("tiny-cpu").read_text()
    assert "attention.precision=fa2" in text.split("[data]")[0]     # the switch, in the header comment
    # and it still trains it: experiments and pinned loss hashes depend on it
    assert load_config(find_config("tiny-cpu")).attention.spec.precision == "paper"
    assert config_precision(find_config("tiny-cpu")) == "paper"


def test_train_help_lists_what_each_shipped_config_trains(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name, path in shipped_configs().items():
        assert f"{name} ({config_precision(path)})" in text, name
    assert "tiny-cpu (paper)" in text and "on purpose" in text and "attention.precision=fa2" in text


@pytest.mark.parametrize("argv,fix", [
    (["train", "tiny-cpu", "--steps", "10"], "train.steps=10"),             # no --out either: this first
    (["train", "tiny-cpu", "--out", "x", "--steps=10"], "train.steps=10"),
    (["train", "tiny-cpu", "--out", "x", "--lr", "1e-3"], "optim.lr=1e-3"),
    (["train", "tiny-cpu", "--out", "x", "--batch-size", "4"], "data.batch_size=4"),
    (["train", "tiny-cpu", "--out", "x", "--precision", "fa2"], "attention.precision=fa2"),
    (["train", "tiny-cpu", "--out", "x", "--seed", "3"], "train.seed=3 or injection.seed=3"),
    (["repro", "--preset", "micro", "--out", "x", "--lr", "1e-3"], "optim.lr=1e-3"),
])
def test_an_option_that_is_a_config_key_names_the_override(argv, fix, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    usage, message = err.strip().split("\n")[0], err.strip().split("\n")[-1]
    assert usage.split()[:3] == ["usage:", "flashguard", argv[0]]           # the command's usage, not the top level
    prog, _, problem = message.partition(": error: ")
    option = next(a.split("=")[0] for a in argv if a.startswith("--") and a not in ("--out", "--preset"))
    assert prog == f"flashguard {argv[0]}" and option in problem and f"set {fix} " in problem   # the option, the key
    assert not list(tmp_path.iterdir())                                     # nothing ran


def test_an_unknown_option_that_is_no_config_key_is_refused_as_before(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "tiny-cpu", "--out", "x", "--bogus", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.split()[:3] == ["usage:", "flashguard", "train"] and "unrecognized" in err and "--bogus 3" in err


def test_no_user_facing_text_cites_a_file_users_do_not_have():
    # the project's working notes (paper-notes, shared/) are not shipped: text a user reads states
    # the fact or cites the study itself
    files = [*(ROOT / "src" / "flashguard").rglob("*.py"), *(ROOT / "configs").glob("*.toml"), ROOT / "README.md",
             *(p for p in (ROOT / "docs").rglob("*") if p.suffix in (".md", ".txt", ".json", ".html"))]
    cited = [f"{p.relative_to(ROOT)}:{i}" for p in files
             for i, line in enumerate(p.read_text(errors="replace").split("\n"), 1)
             if "paper-notes" in line or "shared/" in line]
    assert len(files) > 50 and cited == []


def test_the_census_legend_cites_the_study():
    from flashguard.diagnostics.census_table import census_legend
    first, *rest = census_legend()
    assert "Qiu" in first and "arXiv 2510.04212" in first
    assert len(rest) >= 7 and not any("paper-notes" in line for line in rest)
