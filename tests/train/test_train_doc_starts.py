"""data.doc_starts in the training loop: off draws what it drew before; on, every window
starts right after a separator, reproducibly; a dataset without a separator is refused."""
from __future__ import annotations

import pytest

from flashguard.cli import main
from flashguard.data import TokenDataset
from flashguard.train import ConfigError, JsonlLog, load_config, train

from run_helpers import MICRO, interrupted, micro_overrides, prepare_without_separator

# batches.jsonl of a 3-step micro run on the tiny corpus, recorded before data.doc_starts existed
BEFORE = [
    [85272, 40866, 32868, 15428, 43757, 94664, 37309, 4962],
    [40813, 61176, 43018, 56102, 15211, 29447, 11094, 19496],
    [37365, 58352, 42969, 92265, 43183, 26596, 27774, 79116],
]


def _batches(run):
    return [r["indices"] for r in JsonlLog.read(run / "batches.jsonl")]


def test_doc_starts_off_draws_the_batches_of_before(tiny_data, tmp_path):
    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"train.steps": 3, "train.eval_every": 0}))
    assert cfg.data.doc_starts is False          # the default
    train(cfg, tmp_path / "run", log_fn=lambda *a: None)
    assert _batches(tmp_path / "run") == BEFORE


def test_doc_starts_on_starts_every_window_after_a_separator_reproducibly(tiny_data, tmp_path):
    extra = {"train.steps": 3, "train.eval_every": 0, "data.doc_starts": "true"}
    for name in ("a", "b"):
        train(load_config(MICRO, micro_overrides(tiny_data, **extra)), tmp_path / name, log_fn=lambda *a: None)
    drawn = _batches(tmp_path / "a")
    assert drawn == _batches(tmp_path / "b") and drawn != BEFORE
    data = TokenDataset(tiny_data).tokens("train")
    assert all(data[i - 1] == TokenDataset(tiny_data).doc_separator for step in drawn for i in step)
    assert load_config(tmp_path / "a" / "config.toml").data.doc_starts is True   # saved with the run


def test_doc_starts_run_resumes_to_the_same_batches(tiny_data, tmp_path, monkeypatch):
    extra = {"data.doc_starts": "true", "train.eval_every": 0}
    train(load_config(MICRO, micro_overrides(tiny_data, **extra)), tmp_path / "full", log_fn=lambda *a: None)
    interrupted(monkeypatch, 4, lambda: train(load_config(MICRO, micro_overrides(tiny_data, **extra)), tmp_path / "cut",
                                              log_fn=lambda *a: None))
    train(load_config(MICRO, micro_overrides(tiny_data, **extra)), tmp_path / "cut", resume=True, log_fn=lambda *a: None)
    assert _batches(tmp_path / "cut") == _batches(tmp_path / "full")


def test_doc_starts_needs_a_separator_one_clear_line(tmp_path, capsys):
    data = prepare_without_separator(tmp_path, 4, "word " * 100)
    code = main(["train", str(MICRO), "--out", str(tmp_path / "run")]
                + micro_overrides(data, **{"data.doc_starts": "true"}))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "data.doc_starts:" in err[0] and "meta.json" in err[0]   # the key, and the file that lacks one


@pytest.mark.parametrize("value,msg", [("1", r"^data\.doc_starts.*\bbool\b"),
                                       ('"yes"', r"^data\.doc_starts.*\bbool\b")])
def test_doc_starts_is_a_bool(value, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(MICRO, [f"data.doc_starts={value}"])
