"""``flashguard diagnose``: its arguments and entry live in flashguard.diagnostics.command."""
from __future__ import annotations

from .common import delegated

NAME, OVERRIDES = "diagnose", False


def _load():
    from ..diagnostics.command import add_diagnose_arguments, run_diagnose
    return add_diagnose_arguments, run_diagnose


add, run = delegated(NAME, "run the mechanism probes on a run's checkpoint and batch, or show a watch folder's "
                           "recorded probes", _load)
