"""``flashguard diagnose``: its arguments and entry live in flashguard.diagnostics.command."""
from __future__ import annotations

NAME, OVERRIDES = "diagnose", False


def add(sub, values: str):
    from ..diagnostics.command import add_diagnose_arguments
    p = sub.add_parser("diagnose", help="run the mechanism probes on a run's checkpoint and batch, or show a watch folder's recorded probes")
    add_diagnose_arguments(p)
    return p


def run(args) -> int:
    from ..diagnostics.command import run_diagnose
    return run_diagnose(args)
