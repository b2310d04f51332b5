"""``flashguard prepare``: its arguments and entry live in flashguard.data.command."""
from __future__ import annotations

from .common import delegated

NAME, OVERRIDES = "prepare", False


def _load():
    from ..data.command import add_prepare_arguments, run_prepare
    return add_prepare_arguments, run_prepare


add, run = delegated(NAME, "tokenize a corpus into nanoGPT-style train.bin / val.bin", _load)
