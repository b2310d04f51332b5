"""A regular install: the configs ship as package data and are found by name; a built wheel runs
from a folder outside the checkout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashguard.train import ConfigError
from flashguard.train.shipped import find_config, shipped_configs

from run_helpers import ROOT

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))


def test_configs_are_declared_as_package_data():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "*.toml" in meta["tool"]["setuptools"]["package-data"]["flashguard.configs"]
    assert meta["tool"]["setuptools"]["packages"]["find"]["where"] == ["src"]
    link = ROOT / "src" / "flashguard" / "configs"   # the package data folder is the repository's configs/
    assert link.is_symlink() and os.readlink(link) == "../../configs"
    assert sorted(p.stem for p in link.glob("*.toml")) == CONFIGS


def test_shipped_configs_are_found_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)   # not the checkout
    assert CONFIGS and sorted(shipped_configs()) == CONFIGS
    for name in CONFIGS:
        for spelling in (name, f"{name}.toml"):
            assert find_config(spelling).read_text() == (ROOT / "configs" / f"{name}.toml").read_text()
    own = tmp_path / "mine.toml"                # a file is used as it is, also one named like a shipped config
    own.write_text("[train]\nsteps = 3\n")
    assert find_config(own) == own and find_config("mine.toml") == Path("mine.toml")
    (tmp_path / "micro.toml").write_text("[train]\nsteps = 4\n")
    assert find_config("micro.toml") == Path("micro.toml")
    with pytest.raises(ConfigError, match="'tiny-gpu'.*tiny-cpu"):
        find_config("tiny-gpu")
    with pytest.raises(ConfigError, match="neither a file"):
        find_config("elsewhere/tiny-cpu")       # a path is a path, not a name


def test_repro_presets_use_the_shipped_config_not_a_local_file(tmp_path, monkeypatch):
    from flashguard.experiments.repro.presets import PRESETS, config_path
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-cpu.toml").write_text("[train]\nsteps = 1\n")
    for preset in PRESETS.values():
        path = config_path(preset)
        assert path.read_text() == (ROOT / "configs" / preset.config).read_text()


def test_train_by_name_from_another_folder(tiny_data, tmp_path, monkeypatch, capsys):
    from flashguard.cli import main
    monkeypatch.chdir(tmp_path)
    code = main(["train", "micro", "--out", "run", f'data.dir="{tiny_data}"', "train.steps=2",
                 "train.eval_every=0", "train.checkpoint_every=0"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "metrics.jsonl").is_file()
    assert main(["train", "nonesuch", "--out", "run2"]) == 2
    assert "shipped: " in capsys.readouterr().err


def _source_copy(dest: Path) -> Path:
    """What a source distribution holds, without the checkout's build outputs (so that a build
    here never meets another one running in the checkout)."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    shutil.copytree(ROOT / "src", dest / "src", symlinks=True, ignore=skip)
    shutil.copytree(ROOT / "configs", dest / "configs")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    return dest


@pytest.mark.slow
def test_wheel_installs_and_runs_outside_the_checkout(tiny_data, tmp_path):
    """Builds the wheel offline (pip wheel with the environment's setuptools), installs it on
    its own into a folder, and from a folder outside the checkout trains a shipped config by
    name with the installed `flashguard` (the installed package, not the checkout's, imported)."""
    t0 = time.perf_counter()
    src = _source_copy(tmp_path / "source")
    wheels, target, work = tmp_path / "wheels", tmp_path / "installed", tmp_path / "work"
    work.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(src)],
                   check=True, capture_output=True, text=True, timeout=600)
    wheel = next(wheels.glob("flashguard-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=600)
    assert sorted(p.stem for p in (target / "flashguard" / "configs").glob("*.toml")) == CONFIGS
    assert not (target / "flashguard" / "configs").is_symlink()
    env = {**os.environ, "PYTHONPATH": str(target), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import flashguard; print(flashguard.__file__)"], cwd=work,
                           env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert Path(where).is_relative_to(target)
    run = subprocess.run([str(target / "bin" / "flashguard"), "train", "micro", "--out", "run",
                          f'data.dir="{tiny_data}"', "train.steps=2", "train.eval_every=0",
                          "train.checkpoint_every=0"], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "done: 2 steps" in run.stdout and (work / "run" / "metrics.jsonl").is_file()
    print(f"wheel built, installed and run in {time.perf_counter() - t0:.0f} s")
