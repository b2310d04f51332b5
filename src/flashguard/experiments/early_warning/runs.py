"""The finished training runs the early-warning evaluation reads, from one or more folders.

A run is a folder holding ``config.toml`` and ``metrics.jsonl`` (the trainer's layout; the
injection experiment puts them at ``runs/s<SEED>/<ARM>/``). Every folder given is searched
recursively, so a grid's top folder, its ``runs/`` folder, one seed's folder or a single run all
work, and a second grid folder (more seeds) adds its runs.

Only finished runs are used: the run summary (``experiments.runs.summarize_run``) must say ``done`` (all
configured steps, no divergence) or ``diverged``. A run still training (``partial``), a folder the
trainer moved aside (``<ARM>.incomplete-<k>``), a folder without a readable config (its seed and
warm-up would be unknown) and a second copy of the same run (identical config.toml: same arm,
same seed) are skipped, each with the reason, so that a folder being written can be read at any
moment. Whether a run diverged, and where, is the package's one rule
(``flashguard.train.divergence``: ``find_divergence`` with ``rule_of(config)``), nothing else.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from ... import keys
from ...train.config import load_config
from ...train.divergence import find_divergence, rule_of
from ...utils.jsonl import read_metrics
from ..runs import summarize_run

__all__ = ["Run", "load_runs", "find_run_dirs"]


@dataclass
class Run:
    id: str                      # unique label: <folder given>/<path below it>, e.g. micro-grid/runs/s1/real-a1
    path: Path
    seed: int
    arm: str                     # the run folder's name (the injection arm, e.g. coherent-p1-a100)
    warmup: int                  # optim.warmup_steps: the rule's and the monitor's warm-up
    steps: int                   # train.steps configured
    divergence_step: int | None  # by the one rule; None: the run finished without diverging
    divergence_reason: str | None
    records: list = field(repr=False, default_factory=list)  # metrics records, in step order
    injection: dict = field(default_factory=dict)            # rule, alpha, p of its [injection]
    rule: dict = field(default_factory=dict)                 # the divergence rule's parameters (rule_of)

    @property
    def diverged(self) -> bool:
        return self.divergence_step is not None

    @property
    def twin(self) -> bool:
        """A stable twin by construction (the issue's "the same batches with a zero-mean error, or
        none"): no injection, the arithmetic itself (real at alpha 1: bit-identical to none), or a
        zero-mean error of any size. Coherent, shuffled and scaled real errors lean by design."""
        rule, alpha = self.injection.get("rule", "none"), self.injection.get("alpha")
        return rule in ("none", "zero-mean") or (rule == "real" and alpha == 1.0)

    @property
    def stable(self) -> bool:
        """Counted for false alarms: a twin the divergence rule calls undiverged. A run that leans by
        design and did not diverge by the rule is neither divergent nor stable (``other``): the
        rule misses runs whose W_Q runs away before their loss falls (docs/cpu-reproduction.md), so
        an alarm there is no false alarm, and none there is no hit either."""
        return not self.diverged and self.twin

    @property
    def other(self) -> bool:
        return not self.diverged and not self.twin

    @property
    def last_step(self) -> int | None:
        return self.records[-1][keys.STEP] if self.records else None


def _moved_aside(root: Path, run_dir: Path) -> bool:
    return any(".incomplete-" in part for part in run_dir.relative_to(root).parts)


def find_run_dirs(root: str | Path, *, moved_aside: bool = False) -> list[Path]:
    """Run folders (holding a metrics.jsonl) at or below ``root``, in path order; folders the
    trainer moved aside (``*.incomplete-<k>``) only with ``moved_aside``."""
    root = Path(root)
    if (root / "metrics.jsonl").is_file():
        return [root]
    found, visited = [], set()
    # os.walk with followlinks: a seed folder may be a symbolic link to a grid trained elsewhere
    # (Path.rglob does not enter linked folders); real paths seen once, so a link loop ends
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in visited:
            dirnames[:] = []
            continue
        visited.add(real)
        if "metrics.jsonl" in filenames:
            d = Path(dirpath)
            if moved_aside or not _moved_aside(root, d):
                found.append(d)
    return sorted(found)


def _label(root: Path, run_dir: Path) -> str:
    rel = run_dir.relative_to(root).as_posix()
    return root.name if rel == "." else f"{root.name}/{rel}"


def load_runs(roots, *, log=None) -> tuple[list[Run], list[dict]]:
    """(runs, skipped): the finished runs below the folders ``roots`` (ordered by seed, then arm)
    and ``[{"path", "why"}]`` for each folder left out. A folder given that does not exist raises
    FileNotFoundError (a typo should not read as "no runs")."""
    runs, skipped, seen = [], [], {}
    for root in map(Path, roots):
        if not root.exists():
            raise FileNotFoundError(f"--runs: no folder {root}")
        for d in find_run_dirs(root, moved_aside=True):
            why = None
            cfg_file = d / "config.toml"
            if _moved_aside(root, d):
                why = "moved aside by the trainer (restarted before its first checkpoint)"
            elif not cfg_file.is_file():
                why = "no config.toml (seed and warm-up unknown)"
            else:
                try:
                    cfg = load_config(cfg_file)
                except (ValueError, OSError) as e:
                    why = f"unreadable config.toml: {e}"
            if why is None:
                text = cfg_file.read_bytes()
                digest = hashlib.sha256(text).hexdigest()
                if digest in seen:
                    why = f"same config.toml as {seen[digest]} (a copy of the same run)"
            if why is None:
                status = summarize_run(d)["status"]
                if status not in ("done", "diverged"):
                    why = f"not finished (status {status})"
            if why is None:
                records = sorted((r for r in read_metrics(d) if keys.STEP in r), key=lambda r: r[keys.STEP])
                rule = rule_of(cfg)
                step, reason = find_divergence(records, **rule)
                if step is None and (not records or records[-1][keys.STEP] + 1 < cfg.train.steps):
                    why = "metrics.jsonl changed while it was read"  # the summary saw it finished
            if why is not None:
                skipped.append({"path": str(d), "why": why})
                if log:
                    log(f"  skipped {d}: {why}")
                continue
            seen[digest] = _label(root, d)
            inj = cfg.injection
            runs.append(Run(id=_label(root, d), path=d, seed=int(cfg.train.seed), arm=d.name,
                            warmup=int(cfg.optim.warmup_steps), steps=int(cfg.train.steps),
                            divergence_step=step, divergence_reason=reason, records=records,
                            injection={"rule": inj.rule, "alpha": inj.alpha, "p": inj.p}, rule=rule))
    runs.sort(key=lambda r: (r.seed, r.arm, r.id))
    return runs, skipped
