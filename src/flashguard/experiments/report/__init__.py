"""The report writer: a repro (or training runs, and a lab) as report.md, report.html and figures."""
from .command import add_report_arguments, run_report, write_report

__all__ = ["add_report_arguments", "run_report", "write_report"]
