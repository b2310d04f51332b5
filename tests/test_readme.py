"""The README and the guides say what the code does: short, commands that parse, links that resolve,
names that exist, no developer machine's paths."""
from __future__ import annotations

import importlib
import re
import shlex
from pathlib import Path

import pytest

from flashguard.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GUIDES = sorted((ROOT / "docs" / "guides").glob("*.md"))
DOCS_MD = sorted((ROOT / "docs").rglob("*.md"))
MACHINE_PATH = re.compile(r"/(?:work|tmp|root)/")


def _fences(text: str) -> list[str]:
    """The bodies of the fenced code blocks."""
    return re.findall(r"^```[\w-]*\n(.*?)^```$", text, flags=re.S | re.M)


def _commands(path: Path) -> list[list[str]]:
    """Every `flashguard ...` command line in the file's code blocks, as argv after `flashguard`
    (a command after `&&` or `.venv/bin/` included; the comment after `#` dropped)."""
    out = []
    for block in _fences(path.read_text()):
        for line in block.splitlines():
            for part in line.split("&&"):
                first = part.split()[:1]
                if first and Path(first[0]).name == "flashguard":
                    out.append(shlex.split(part, comments=True)[1:])
    return out


def _names(path: Path) -> set[str]:
    """Dotted names `flashguard.a.b` written in backticks (the text's code spans and blocks)."""
    text = path.read_text()
    spans = re.findall(r"`([^`\n]+)`", text) + _fences(text)
    return {m.rstrip(".") for s in spans for m in re.findall(r"(?<![\w/.])flashguard(?:\.[A-Za-z_]\w*)+", s)}


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def _links(path: Path) -> list[str]:
    """Relative link and image targets of a Markdown file (no scheme, no pure anchor)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def test_readme_is_short():
    assert len(README.read_text().splitlines()) <= 250


def test_readme_setup_commands_are_the_ci_commands():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("python3 -m venv")]
    first = _fences(README.read_text())[0].splitlines()
    assert len(ci) == 1 and ci[0] in first
    assert first[0] == "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/flashguard demo"


def test_readme_shows_check_audit_and_repro_commands():
    commands = {argv[0] for argv in _commands(README)}
    assert {"check", "audit", "demo", "repro"} <= commands


@pytest.mark.parametrize("path", [README, *GUIDES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_parses(path, capsys):
    commands = _commands(path)
    assert commands or path != README
    parser, _ = build_parser()
    for argv in commands:
        with pytest.raises(SystemExit) as e:
            main([*argv, "--help"])
        assert e.value.code == 0, argv
        # the whole line parses as written: options known, values valid; what argparse leaves over
        # is the key=value overrides some commands take
        _, extra = parser.parse_known_args(argv)
        assert all("=" in x and not x.startswith("-") for x in extra), (argv, extra)
    capsys.readouterr()


@pytest.mark.parametrize("path", [README, *GUIDES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_name_shown_exists(path):
    missing = []
    for name in sorted(_names(path)):
        try:
            _resolve(name)
        except (ImportError, AttributeError):
            missing.append(name)
    assert missing == []


@pytest.mark.parametrize("path", [README, *GUIDES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = [t for t in _links(path) if t and not (path.parent / t).exists()]
    assert broken == []


def test_no_machine_paths_in_readme_or_docs():
    found = [f"{p.relative_to(ROOT)}:{i}" for p in [README, *DOCS_MD]
             for i, line in enumerate(p.read_text().splitlines(), 1) if MACHINE_PATH.search(line)]
    assert len(DOCS_MD) > 10 and found == []


def test_no_issue_numbers_in_readme_or_guides():
    found = [f"{p.relative_to(ROOT)}:{i}" for p in [README, *GUIDES]
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\bissues? #?\d", line, re.I)]
    assert found == []
