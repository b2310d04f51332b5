"""``flashguard report``: its arguments and entry live in flashguard.experiments.report."""
from __future__ import annotations

from .common import delegated

NAME, OVERRIDES = "report", False


def _load():
    from ..experiments.report import add_report_arguments, run_report
    return add_report_arguments, run_report


add, run = delegated(NAME, "report.md and report.html with figures, from a repro, "
                           "training runs and/or a lab folder", _load)
