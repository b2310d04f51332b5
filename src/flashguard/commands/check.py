"""``flashguard check``: its arguments and entry live in flashguard.check.command."""
from __future__ import annotations

NAME, OVERRIDES = "check", False


def add(sub, values: str):
    from ..check.command import add_check_arguments
    p = sub.add_parser("check", help="is your model's bf16 attention at risk, and what to switch on? "
                                     "(a Hugging Face or flashguard checkpoint)")
    add_check_arguments(p)
    return p


def run(args) -> int:
    from ..check.command import run_check
    return run_check(args)
