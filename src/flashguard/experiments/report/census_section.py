"""The report's "Preconditions census" section: per run, the study's mechanism's preconditions
against the study's GPT-2 (``flashguard.diagnostics.census_table``), read from what the run
folder holds.

Where a run's census comes from, best first: its metrics.jsonl when the trainer's probes wrote
the census keys (the census over training); else the ``flashguard diagnose`` JSON files in
RUN_DIR/diagnostics/ that hold them (one probe per diagnosed checkpoint); else metrics.jsonl's
older probe records (the rows they cannot fill read n/a). A run with none of these has no table;
with no table at all the section is left out.
"""
from __future__ import annotations

import json
from pathlib import Path

from ... import keys
from ...diagnostics.across_probes import ACROSS_PROBES_UNIT
from ...diagnostics.census_table import LAYER_COLUMNS, census_from_records, census_legend, over_training
from ...utils.table import Table, fmt
from .load import Run, Study

__all__ = ["run_census", "census_blocks"]


def _has_census(records: list[dict]) -> bool:
    return any(keys.EXACT_TIE_RATE.matches(k) for r in records for k in r)


def _diagnose_records(run_dir: Path) -> list[dict]:
    """One record per readable diagnose JSON of the run ({step, **metrics}), by step."""
    by_step = {}
    for path in sorted((run_dir / "diagnostics").glob("diagnose_*.json")):
        try:
            res = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(res, dict) and isinstance(res.get("step"), int) and isinstance(res.get("metrics"), dict):
            by_step[res["step"]] = {**res["metrics"], keys.STEP: res["step"]}
    return [by_step[s] for s in sorted(by_step)]


def run_census(run: Run):
    """(Census, where it was read from) of one run, or (None, "") when the folder holds no probe data."""
    if _has_census(run.records):
        return census_from_records(run.records), "its probes in metrics.jsonl"
    diagnosed = _diagnose_records(run.dir)
    if _has_census(diagnosed):
        return census_from_records(diagnosed), "`flashguard diagnose` JSON in diagnostics/"
    found = census_from_records(run.records)
    return (found, "its probes in metrics.jsonl, recorded before the census existed") if found else (None, "")


def census_blocks(study: Study) -> list[tuple]:
    tables = []
    for run in study.runs:
        c, source = run_census(run)
        if c is None:
            continue
        rows = [[r.precondition, r.study, r.text, r.where or "-", over_training(r), r.verdict] for r in c.rows]
        steps = f"{len(c.steps)} probe{'s' if len(c.steps) != 1 else ''}, steps {c.steps[0]}-{c.steps[-1]}"
        tables += [("p", f"Run {run.name} ({source}; judged at step {c.step}; {steps}; layers "
                         f"{', '.join(f'L{l}' for l in c.layers)}): {fmt(c.summary().split(': ', 1)[1])}."),
                   ("table", Table(["precondition", "the study's GPT-2", "this run", "where", "over training",
                                    "verdict"], rows, verdict_col=5)),
                   ("table", Table([f"step {c.step}: layer"] + [h for h, _ in LAYER_COLUMNS],
                                   [[f"L{l}"] + [fmt(v) for v in vals.values()] for l, vals in c.per_layer.items()]))]
        across = [s for per in c.across.values() for s in per.values()]
        if across:
            tables.append(("table", Table(
                ["error, layer", "probes positive", "Stouffer z", "mean ratio", "across the probes"],
                [[f"{s.what} L{s.layer}", f"{s.positive}/{len(s.zs)}", f"{s.stouffer_z:+.1f}",
                  "-" if s.mean_ratio is None else f"{s.mean_ratio:+.3f}", s.verdict] for s in across],
                verdict_col=4)))
    if not tables:
        return []
    return [("h2", "Preconditions census"),
            ("p", "Does each run set up the study's mechanism? Per run, the preconditions the study found in its "
                  "GPT-2 (tied row maxima, at the sink, several Pbar exactly 1, attention sinks, V one-signed at the "
                  "tied keys, a leaning O and a positive delta error), measured by the probes with the arithmetic "
                  "each layer trained with, against what the study reports, with a verdict per row by the rules "
                  "below (`flashguard diagnose RUN --census` prints the same table for one checkpoint)."),
            *tables, ("list", census_legend() + [f"Across the probes: Stouffer's z of the probes' z of O's and delta's "
                                                 f"error per layer; unit: {ACROSS_PROBES_UNIT}."])]
