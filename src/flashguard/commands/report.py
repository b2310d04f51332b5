"""``flashguard report``: its arguments and entry live in flashguard.experiments.report."""
from __future__ import annotations

NAME, OVERRIDES = "report", False


def add(sub, values: str):
    from ..experiments.report import add_report_arguments
    p = sub.add_parser("report", help="report.md and report.html with figures, from a repro, "
                                      "training runs and/or a lab folder")
    add_report_arguments(p)
    return p


def run(args) -> int:
    from ..experiments.report import run_report
    return run_report(args)
