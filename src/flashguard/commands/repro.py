"""``flashguard repro``: its arguments and entry live in flashguard.experiments.repro.command."""
from __future__ import annotations

import argparse

from .common import wrap

NAME, OVERRIDES = "repro", True


def add(sub, values: str):
    from ..experiments.repro.command import add_repro_arguments
    p = sub.add_parser(
        "repro", help="the study's claims as matched training runs, with verdicts",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=wrap("Trains a preset's matched runs (same seed, same batches): fp32 attention, the "
                         "reference arithmetic with no fix, the study's fix, paper-fp32fwd, and the study's localisation "
                         "ablations; judges claims C1-C6, C8 (held / not held / inconclusive, with the numbers "
                         "behind each) into OUT/claims.md and OUT/repro.json. Resumable: rerun the same command."))
    add_repro_arguments(p)
    p.epilog = "\n\n".join(filter(None, [p.epilog, "Valid values:\n" + values]))
    return p


def run(args) -> int:
    from ..experiments.repro.command import run_repro_command
    return run_repro_command(args)
