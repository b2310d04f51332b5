"""``flashguard check``: its arguments and entry live in flashguard.check.command."""
from __future__ import annotations

from .common import delegated

NAME, OVERRIDES = "check", False


def _load():
    from ..check.command import add_check_arguments, run_check
    return add_check_arguments, run_check


add, run = delegated(NAME, "is your model's bf16 attention at risk, and what to switch on? "
                           "(a Hugging Face or flashguard checkpoint)", _load)
