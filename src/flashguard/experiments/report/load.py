"""Read the report's inputs into one ``Study``: a repro folder, plain run folders, a lab folder.

Kinds of folder (``folder_kind``): a repro folder holds ``repro.json`` (``flashguard repro``) and
``runs/<name>/``; a training run folder holds ``metrics.jsonl`` (and ``config.toml``; made by
``flashguard train``); a watch folder holds ``watch.json`` and ``metrics.jsonl`` (``flashguard.watch``
on the user's own model: labelled as such, never as a flashguard training run); a lab folder holds
``lab.json`` (``flashguard lab``). Several run (or watch) folders given together are read like the
runs of one repro without claims. Anything else is a ValueError naming the folder and what was
expected.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ...utils.jsonl import read_metrics
from ..runs import summarize_run

__all__ = ["Run", "Lab", "Study", "folder_kind", "load_study"]

EXPECTED = ("a repro folder (repro.json), a training run folder (metrics.jsonl, config.toml), "
            "a watch folder of your model (watch.json, metrics.jsonl; flashguard.watch) or a lab folder (lab.json)")


@dataclass
class Run:
    name: str
    group: str             # main | ablation | remedy
    title: str
    dir: Path
    records: list[dict]    # metrics.jsonl, in file order ([] if the run never started)
    summary: dict          # steps, final_loss, min_loss, diverged_at, max_grad_norm, last_val, wall_s, status
    watch: dict | None = None   # watch.json of a watch folder (flashguard.watch on the user's model)


@dataclass
class Lab:
    dir: Path
    result: dict           # lab.json: verdicts, details, rows, ...
    figures: list[Path]    # the bias_vs_*.png next to it


@dataclass
class Study:
    kind: str              # "repro", "runs", "watch" (watch folders only) or "lab" (a lab folder alone)
    sources: list[Path]
    meta: dict             # preset, config, steps, seed, base_precision, focus_layer, versions
    runs: list[Run] = field(default_factory=list)
    claims: list[dict] = field(default_factory=list)
    remedies: list[dict] = field(default_factory=list)
    lab: Lab | None = None
    injection: dict | None = None   # injection.json of the repro's injection/ folder (the demo's causal comparison)
    natural: dict | None = None     # natural.json of the repro's natural/ folder (the natural runs, measured apart)
    notes: list[str] = field(default_factory=list)  # one line each: what was absent and so left out


def folder_kind(d: Path) -> str:
    """"repro", "run", "watch" or "lab"; ValueError for a missing folder or one of none of these kinds."""
    from ...diagnostics.run_state import is_watch_folder
    if not d.exists():
        raise ValueError(f"{d}: no such folder (expected {EXPECTED})")
    if not d.is_dir():
        raise ValueError(f"{d}: not a folder (expected {EXPECTED})")
    if (d / "metrics.jsonl").is_file() and not (d / "repro.json").is_file() and is_watch_folder(d):
        return "watch"
    for name, kind in (("repro.json", "repro"), ("metrics.jsonl", "run"), ("lab.json", "lab")):
        if (d / name).is_file():
            return kind
    raise ValueError(f"{d}: expected {EXPECTED}; it holds none of these files")


def _read_json(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read it as JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return obj


def _config(run_dir: Path):
    """The run's RunConfig, or None (no or unreadable config.toml: the report works without it)."""
    if not (run_dir / "config.toml").is_file():
        return None
    try:
        from ...train.config import load_config
        return load_config(run_dir / "config.toml")
    except (ValueError, OSError):
        return None


def _records(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []


def _plain_run(d: Path, name: str) -> Run:
    cfg = _config(d)
    records = _records(d)
    summary = summarize_run(d)
    title = "(no config.toml)"
    if cfg:
        a, layers = cfg.attention.spec, cfg.attention.layers
        title = f"{a.backend} attention, {a.precision} arithmetic, stabilizer {a.stabilizer}"
        if layers:
            title += "; per layer " + ", ".join(f"L{k}: {v}" for k, v in sorted(layers.items()))
    return Run(name, "main", title, d, records, summary)


def _watch_run(d: Path, name: str) -> Run:
    from ...diagnostics.run_state import watch_meta
    meta = watch_meta(d) or {}
    measured = sorted({m.get("precision") for m in (meta.get("measured") or {}).values() if m.get("precision")})
    kernels = sorted({m.get("kernel") for m in (meta.get("measured") or {}).values() if m.get("kernel")})
    title = f"your model ({meta.get('model') or 'nn.Module'}), watched by flashguard.watch"
    title += f", probes every {meta['every']} steps" if meta.get("every") else ""
    if kernels:
        title += f"; ran {', '.join(kernels)}"
    if measured:
        title += f"; measured in {', '.join(measured)}"
    summary = summarize_run(d)
    if summary.get("status") == "partial":   # no planned length to compare with: the user's run, as far as watched
        summary["status"] = "watched"
    return Run(name, "main", title, d, _records(d), summary, watch=meta)


def _load_lab(d: Path) -> Lab:
    if not d.is_dir() or not (d / "lab.json").is_file():
        what = "no lab.json" if d.is_dir() else "not a folder" if d.exists() else "no such folder"
        raise ValueError(f"{d}: {what} (expected a lab folder with lab.json, made by `flashguard lab`)")
    result = _read_json(d / "lab.json")
    if not isinstance(result.get("verdicts"), dict):
        raise ValueError(f"{d / 'lab.json'}: expected a lab result with \"verdicts\" (made by `flashguard lab`)")
    return Lab(d, result, sorted(d.glob("bias_vs_*.png")))


def _load_repro(d: Path, study: Study) -> None:
    repro = _read_json(d / "repro.json")
    runs = repro.get("runs")
    if not isinstance(runs, list) or not all(isinstance(r, dict) and "name" in r for r in runs):
        raise ValueError(f"{d / 'repro.json'}: expected \"runs\": a list of objects with a \"name\"")
    study.meta = {k: repro.get(k) for k in ("preset", "config", "steps", "seed", "base_precision", "focus_layer",
                                           "versions")}
    for r in runs:
        run_dir = d / r.get("dir", f"runs/{r['name']}")
        records = _records(run_dir)
        # repro.json's summary is the record; the metrics only fill what it leaves out
        summary = {**summarize_run(run_dir, repro.get("steps")), **(r.get("summary") or {})}
        if not records and summary.get("status") != "missing":
            study.notes.append(f"run {r['name']}: no metrics in {run_dir} (its curves are left out)")
        study.runs.append(Run(r["name"], r.get("group", "main"), r.get("title", ""), run_dir, records, summary))
    study.claims = list(repro.get("claims") or [])
    study.remedies = list(repro.get("remedies") or [])
    lab_dir = d / (repro.get("lab") or "lab")
    if lab_dir.is_dir() and (lab_dir / "lab.json").is_file():
        study.lab = _load_lab(lab_dir)
    elif repro.get("lab"):
        study.notes.append(f"lab: {lab_dir} has no lab.json (the lab section is left out)")
    study.injection = _optional_json(study, d / "injection" / "injection.json", "injection",
                                     "the injection section is left out")
    study.natural = _optional_json(study, d / "natural" / "natural.json", "natural",
                                   "the natural runs' verdicts are left out")


def _optional_json(study: Study, path: Path, what: str, left_out: str) -> dict | None:
    """A result file the study may hold: its JSON, or None when absent or unreadable (with a note)."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        study.notes.append(f"{what}: {path} is not valid JSON ({e}); {left_out}")
        return None


def _distinct(values) -> str | None:
    """The values, once each, comma-separated (runs given together may differ in seed or steps)."""
    return ", ".join(dict.fromkeys(str(v) for v in values)) or None


def load_study(dirs: list[Path | str], lab: Path | str | None = None) -> Study:
    """Read the folders; one repro folder, or any number of run folders; at most one lab folder
    (``lab``, else a lab folder in ``dirs``, else the repro's own ``lab/``)."""
    if not dirs:
        raise ValueError(f"no input folder (expected {EXPECTED})")
    paths = [Path(d) for d in dirs]
    kinds = [folder_kind(p) for p in paths]
    labs = [p for p, k in zip(paths, kinds) if k == "lab"]
    repros = [p for p, k in zip(paths, kinds) if k == "repro"]
    plain = [p for p, k in zip(paths, kinds) if k in ("run", "watch")]
    watched = {p for p, k in zip(paths, kinds) if k == "watch"}
    if len(repros) > 1 or (repros and plain):
        raise ValueError(f"{(repros + plain)[1]}: give one repro folder, or training run (or watch) folders, not both "
                         f"(with {repros[0]})")
    if len(labs) > 1:
        raise ValueError(f"{labs[1]}: give at most one lab folder (with {labs[0]})")
    kind = "repro" if repros else ("watch" if set(plain) <= watched else "runs") if plain else "lab"
    study = Study(kind=kind, sources=paths, meta={})
    if repros:
        _load_repro(repros[0], study)
    names: set[str] = set()
    for p in plain:
        name = p.resolve().name
        if name in names:  # two runs/paper from different places
            name = f"{p.resolve().parent.name}/{name}"
        while name in names:
            name += "'"
        names.add(name)
        study.runs.append(_watch_run(p, name) if p in watched else _plain_run(p, name))
    if plain:
        cfgs = [c for c in (_config(p) for p in plain if p not in watched) if c]
        study.meta = {"preset": _distinct(c.model.preset for c in cfgs),
                      "steps": _distinct(c.train.steps for c in cfgs), "seed": _distinct(c.train.seed for c in cfgs),
                      "base_precision": _distinct(c.attention.spec.precision for c in cfgs)}
    lab_dir = Path(lab) if lab is not None else labs[0] if labs else None
    if lab_dir is not None:
        study.lab = _load_lab(lab_dir)
    return study
