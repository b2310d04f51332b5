"""``flashguard prepare``: its arguments and entry live in flashguard.data.command."""
from __future__ import annotations

NAME, OVERRIDES = "prepare", False


def add(sub, values: str):
    from ..data.command import add_prepare_arguments
    p = sub.add_parser("prepare", help="tokenize a corpus into nanoGPT-style train.bin / val.bin")
    add_prepare_arguments(p)
    return p


def run(args) -> int:
    from ..data.command import run_prepare
    return run_prepare(args)
