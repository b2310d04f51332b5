"""Helpers shared by the tests that train: a tiny corpus and overrides for configs/micro.toml,
and a corpus without a document separator (for the doc_starts tests of data and train)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MICRO = ROOT / "configs" / "micro.toml"


def make_tiny_corpus(tmp_path_factory) -> Path:
    """A small byte-level corpus prepared by the real `prepare text` path."""
    from flashguard.data import prepare_text
    src = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["attention", "flash", "bf16", "rounding", "bias", "gradient", "softmax", "tie", "max", "row"]
    for i in range(40):
        (src / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words) for _ in range(400)) + "\n")
    out = tmp_path_factory.mktemp("data")
    prepare_text([str(src)], out, tokenizer="byte", progress=False, overwrite=True)
    return out


class NoSeparatorTokenizer:
    """Byte-level, but records no document separator (eot None): what doc_starts must refuse."""

    name, vocab_size, eot = "byte-no-sep", 256, None

    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode()


def prepare_without_separator(tmp_path: Path, files: int, text: str) -> Path:
    """``files`` copies of ``text`` under tmp_path/src, prepared by NoSeparatorTokenizer into tmp_path/d."""
    from flashguard.data import prepare_text
    src = tmp_path / "src"
    src.mkdir()
    for i in range(files):
        (src / f"{i}.txt").write_text(text)
    prepare_text(src, tmp_path / "d", tokenizer=NoSeparatorTokenizer(), progress=False)
    return tmp_path / "d"


def micro_overrides(data: Path, **extra) -> list[str]:
    """Overrides of configs/micro.toml for a seconds-long run on the test corpus."""
    items = {"data.dir": f'"{data}"', "train.progress": "false", "train.steps": "6",
             "train.checkpoint_every": "3", "train.eval_every": "3", "train.eval_batches": "1"}
    items.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in items.items()]


def crash_at(monkeypatch, step: int) -> None:
    """Make the training loop raise KeyboardInterrupt when it reaches ``step`` (a simulated
    crash after the checkpoints before it); undo with ``monkeypatch.undo()``."""
    import flashguard.train.loop as loop
    real = loop.learning_rate

    def crashing(s, *a):
        if s == step:
            raise KeyboardInterrupt("simulated crash")
        return real(s, *a)

    monkeypatch.setattr(loop, "learning_rate", crashing)


def interrupted(monkeypatch, step: int, run) -> None:
    """Call ``run()`` with the training loop interrupted at ``step`` (crash_at): it must stop on
    the KeyboardInterrupt; the patch is undone after (``monkeypatch.undo()``)."""
    crash_at(monkeypatch, step)
    with pytest.raises(KeyboardInterrupt):
        run()
    monkeypatch.undo()


def cli_exit(argv: list[str]) -> int:
    """``flashguard ARGV``'s exit status, whether the command returned it or argparse exited with
    it (an option the command does not take, a value its parser refuses)."""
    from flashguard.cli import main
    try:
        return main(argv)
    except SystemExit as e:
        return e.code
