"""``flashguard report RUN_DIR... [--out DIR] [--lab DIR]``: report.md, report.html and figures.

Inputs: a repro folder (``flashguard repro``), or training run folders (``flashguard train``),
and optionally a lab folder (``flashguard lab``; a repro's own ``lab/`` is used by default).
Bad input is a ValueError naming the folder (the CLI's exit code 2).

Wiring (flashguard.cli)::

    add_report_arguments(sub.add_parser("report", help="..."))
    ...
    if args.command == "report":
        return run_report(args)
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ...utils.atomic import atomic_write_text
from .figures import FIGURE_NAMES, copy_lab_figures, make_figures
from .load import load_study
from .write import build_document, render_html, render_markdown

__all__ = ["add_report_arguments", "run_report", "write_report"]


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR",
                        help="a repro folder (repro.json), or training run folders (metrics.jsonl), "
                             "and optionally a lab folder (lab.json)")
    parser.add_argument("--out", default=None, help="output folder (default: FIRST_DIR/report)")
    parser.add_argument("--lab", default=None, help="lab folder made by `flashguard lab` (default: the repro's lab/)")


def write_report(dirs: list[Path | str], out: Path | str, lab: Path | str | None = None) -> dict:
    """Read the folders, write ``out``/report.md, report.html and figures/*.png (each atomically);
    returns {"md": path, "html": path, "figures": [paths]}."""
    study = load_study(dirs, lab)
    out = Path(out)
    fig_dir = out / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    figures, skipped = make_figures(study, fig_dir) if study.runs else ([], [])
    lab_figures = copy_lab_figures(study, fig_dir)
    # a figure skipped this time must not survive from an earlier report into this one's folder
    produced = {f.path.name for f in figures + lab_figures}
    for old in [fig_dir / n for n in FIGURE_NAMES] + sorted(fig_dir.glob("bias_vs_*.png")):
        if old.name not in produced:
            old.unlink(missing_ok=True)
    doc = build_document(study, figures, skipped, lab_figures, out)
    md = atomic_write_text(out / "report.md", render_markdown(doc))
    html = atomic_write_text(out / "report.html", render_html(doc))
    return {"md": md, "html": html, "figures": [f.path for f in figures + lab_figures]}


def run_report(args) -> int:
    out = Path(args.out) if args.out else Path(args.dirs[0]) / "report"
    paths = write_report(args.dirs, out, lab=args.lab)
    print(f"report: {paths['html'].resolve()}")
    return 0
