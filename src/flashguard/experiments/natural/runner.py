"""`flashguard natural`: the matched natural-preconditions runs (issue #12 item
4) and claims N1-N5 judged on them (analysis.py states every definition and rule).

    OUT/natural.json   preset, arms (overrides, folder), per-arm outcome, matching, claims, versions
    OUT/natural.md     the claims table, the arms table, the leans per layer, the rules
    OUT/runs/<ARM>/    each arm's training run (mode a; config.toml, metrics.jsonl, checkpoints/, ...)

Two modes. (a) Train: every arm of the preset by ``runs.train_run`` (a finished arm is
skipped, an interrupted one resumes from its last checkpoint), so rerunning the command continues
where it stopped; the results are rewritten after every arm. Checkpoints are kept (the
captured-problem lab reads a run's last one). (b) ``runs={arm: DIR}``: analyse run folders
trained elsewhere (e.g. by ``flashguard train``), training nothing; an arm not given or without
a metrics.jsonl is "not run", an unfinished one is judged on what it has, and the verdicts say so.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ...train import load_config
from ...train.divergence import DIVERGENCE_FACTOR, describe_rule
from ...utils.atomic import atomic_write_text
from ...utils.table import markdown_table
from ..repro.presets import RunSpec
from ..runs import check_steps, claims_table, markdown_footer, train_run, versions
from .analysis import (arm_outcome, judge_claims, matched_batches, missing_outcome, rules_text, series_text,
                       state_text)
from .presets import ARM_KEYS, NaturalPreset

__all__ = ["run_natural", "natural_markdown", "parse_runs", "common_overrides"]


def common_overrides(preset: NaturalPreset, progress: bool, overrides=()) -> list[str]:
    """The overrides every arm shares (train.steps is passed to train_run on its own)."""
    return [*preset.overrides, f"train.diagnostics_every={preset.diagnostics_every}",
            f"train.divergence_factor={DIVERGENCE_FACTOR:g}", f"train.progress={'true' if progress else 'false'}",
            *overrides]


def _check_overrides(overrides) -> None:
    taken = [o for o in overrides if o.split("=", 1)[0].strip() in ARM_KEYS]
    if taken:
        raise ValueError(f"{', '.join(taken)}: set by the natural experiment's arms ({', '.join(ARM_KEYS)}); "
                         "use --steps for the steps")


def _unknown_arms(option: str, unknown, preset: NaturalPreset) -> ValueError:
    """The error for arm names the preset does not have, naming them and the preset's arms."""
    word = "arm" if len(unknown) == 1 else "arms"
    return ValueError(f"{option}: unknown {word} {', '.join(map(repr, unknown))}; the arms of preset "
                      f"{preset.name!r}: {', '.join(a.name for a in preset.arms)}")


def parse_runs(items, preset: NaturalPreset) -> dict[str, Path]:
    """``--runs arm=DIR,arm=DIR`` (one or more arguments, each comma-separated) as {arm: DIR}."""
    text = ",".join(items) if not isinstance(items, str) else items
    out: dict[str, Path] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        arm, eq, d = part.partition("=")
        arm, d = arm.strip(), d.strip()
        if not eq or not arm or not d:
            raise ValueError(f"--runs: {part!r} is not ARM=DIR (arms: {', '.join(a.name for a in preset.arms)})")
        if arm not in {a.name for a in preset.arms}:
            raise _unknown_arms("--runs", [arm], preset)
        if arm in out:
            raise ValueError(f"--runs: arm {arm!r} given twice")
        out[arm] = Path(d)
    if not out:
        raise ValueError("--runs: no ARM=DIR given")
    return out


def _arithmetic(backend: str, precision, stabilizer) -> tuple:
    """What an arm's attention is: the backend, and for flash its precision and stabilizer."""
    return (backend,) if backend != "flash" else (backend, precision, stabilizer)


def _arithmetic_text(a: tuple, prefix: str = "attention.") -> str:
    if a[0] != "flash":
        return f"{prefix}backend={a[0]}"
    return f"{prefix}precision={a[1]} {prefix}stabilizer={a[2]}"


def _expected(preset: NaturalPreset) -> dict[str, tuple]:
    """Each arm's attention as its overrides make it (the config's spelling; _arithmetic)."""
    out = {}
    for a in preset.arms:
        spec = load_config(None, list(a.overrides)).attention.spec
        out[a.name] = _arithmetic(spec.backend, spec.precision, spec.stabilizer)
    return out


def _check_given(runs: dict[str, Path], preset: NaturalPreset) -> None:
    """Refuse a run folder whose config is another arm's attention (a swapped --runs)."""
    from .analysis import run_config
    want = _expected(preset)
    wrong = []
    for arm, d in runs.items():
        cfg = run_config(d)
        if cfg is None:
            continue
        got = _arithmetic(cfg["backend"], cfg["precision"], cfg["stabilizer"])
        if got != want[arm]:
            wrong.append(f"{arm}={d} has {_arithmetic_text(got)}, the arm is {_arithmetic_text(want[arm], '')}")
    if wrong:
        raise ValueError("--runs: " + "; ".join(wrong))


def _chosen_arms(preset: NaturalPreset, arms) -> list:
    """The preset's arms named by ``arms`` (None: all), in the preset's order."""
    if arms is None:
        return list(preset.arms)
    unknown = [a for a in arms if a not in {x.name for x in preset.arms}]
    if unknown:
        raise _unknown_arms("--arms", unknown, preset)
    if not arms:
        raise ValueError(f"--arms: no arm given; the arms of preset {preset.name!r}: "
                         f"{', '.join(a.name for a in preset.arms)}")
    return [a for a in preset.arms if a.name in arms]


def run_natural(preset: NaturalPreset, out: str | Path, *, runs: dict | None = None, steps: int | None = None,
                overrides=(), arms=None, progress: bool = True, log=print) -> dict:
    """Mode (a) (``runs`` None): train every arm (or those named in ``arms``) under
    OUT/runs/<arm>/, then judge every arm found there. Mode (b) (``runs`` = {arm: DIR}): judge
    those folders, training nothing. Returns the result written."""
    check_steps(steps)
    out = Path(out)
    steps = steps or preset.steps
    overrides = list(overrides)
    t0 = time.perf_counter()
    if runs is not None:
        if overrides:
            raise ValueError(f"{' '.join(overrides)}: key=value overrides train runs; --runs analyses finished "
                             "folders and trains nothing")
        runs = {a: Path(d) for a, d in runs.items()}
        unknown = [a for a in runs if a not in {x.name for x in preset.arms}]
        if unknown:
            raise _unknown_arms("runs", unknown, preset)
        _check_given(runs, preset)
        result = _write(out, preset, steps, runs, mode="analyse", common=None)
        result["wall_s"] = time.perf_counter() - t0
        return result
    chosen = _chosen_arms(preset, arms)
    _check_overrides(overrides)
    base = preset.config_path()
    common = common_overrides(preset, progress, overrides)
    for a in preset.arms:  # every arm's config must load before anything trains
        load_config(base, [*common, *a.overrides, f"train.steps={steps}"])
    dirs = {a.name: out / "runs" / a.name for a in preset.arms}
    for i, a in enumerate(chosen, 1):
        log(f"[{i}/{len(chosen)}] {a.name}: {a.label} ({' '.join(a.overrides)})")
        if train_run(RunSpec(a.name, "natural", a.label, a.overrides), base, common, steps, dirs[a.name], log):
            _write(out, preset, steps, dirs, mode="train", common=common)  # survives an interrupt
    result = _write(out, preset, steps, dirs, mode="train", common=common)
    result["wall_s"] = time.perf_counter() - t0
    return result


def _write(out: Path, preset: NaturalPreset, steps: int, dirs: dict[str, Path], *, mode: str, common) -> dict:
    now = time.time()
    outcomes = {}
    for a in preset.arms:
        if a.name in dirs:
            outcomes[a.name] = arm_outcome(dirs[a.name], steps, arm=a.name, overrides=a.overrides, now=now)
        else:
            outcomes[a.name] = missing_outcome(a.name, overrides=a.overrides)
    present = {n: (Path(o["dir"]) if o["status"] != "missing" else None) for n, o in outcomes.items()}
    matching = {"seeds": {n: (o["config"] or {}).get("seed") for n, o in outcomes.items() if o["config"]},
                "batches": matched_batches(present, preset.reference)}
    claims = judge_claims(outcomes, reference=preset.reference, harmed=preset.harmed, lab_fix=preset.lab_fix,
                          study_fix=preset.study_fix)
    rel = (lambda d: str(Path(d).relative_to(out))) if mode == "train" else str
    result = {"experiment": "natural", "preset": preset.name, "about": preset.about, "config": preset.config,
              "mode": mode, "steps": steps, "diagnostics_every": preset.diagnostics_every,
              "common_overrides": common,
              "arms": [{"name": a.name, "label": a.label, "overrides": list(a.overrides),
                        "dir": rel(dirs[a.name]) if a.name in dirs else None} for a in preset.arms],
              "roles": {"reference": preset.reference, "harmed": preset.harmed, "lab_fix": preset.lab_fix,
                        "study_fix": preset.study_fix},
              "divergence_rule": describe_rule(DIVERGENCE_FACTOR),
              "definitions": rules_text(reference=preset.reference, harmed=preset.harmed, lab_fix=preset.lab_fix,
                                        study_fix=preset.study_fix),
              "outcomes": [outcomes[a.name] for a in preset.arms], "matching": matching, "claims": claims,
              "versions": versions(), "figures": []}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "natural.json", json.dumps(result, indent=1, default=float) + "\n")
    atomic_write_text(out / "natural.md", natural_markdown(result))
    return result


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _leans(rows: list[dict]) -> str:
    return "<br>".join(series_text(r) for r in rows) if rows else "no probes"


def _matching_text(result: dict) -> str:
    m = result["matching"]
    seeds = sorted({s for s in m["seeds"].values() if s is not None})
    parts = [f"seed{'s' if len(seeds) != 1 else ''} {', '.join(map(str, seeds)) or '-'}"]
    ref = result["roles"]["reference"]
    for arm, b in m["batches"].items():
        if b is None:
            parts.append(f"{arm}: no batches to compare with {ref}")
        elif b["first_mismatch"] is None:
            parts.append(f"{arm}: the same batches as {ref} at all {b['compared']} steps both logged")
        else:
            parts.append(f"{arm}: batches differ from {ref}'s from step {b['first_mismatch']}")
    return "; ".join(parts)


def natural_markdown(result: dict) -> str:
    outcomes = result["outcomes"]
    labels = {a["name"]: a for a in result["arms"]}
    how = ("trained here (OUT/runs/<arm>)" if result["mode"] == "train"
           else "analysed from run folders trained elsewhere (nothing trained)")
    lines = [f"# flashguard natural-preconditions runs: {result['preset']}", "",
             f"{result['about']}. Config `{result['config']}`, {result['steps']} steps an arm, probes every "
             f"{result['diagnostics_every']} steps; {how}. Divergence: {result['divergence_rule']}.", "",
             f"Matching: {_matching_text(result)}.", "", claims_table(result["claims"])]
    arms = []
    for o in outcomes:
        val = "-" if o["last_val"] is None else f"{o['last_val']:.3f} (step {o['last_val_step']})"
        arms.append([f"{o['arm']} (`{' '.join(labels[o['arm']]['overrides'])}`)", state_text(o, short=True),
                     f"{o['steps']}/{result['steps']}", val, _leans(o["delta"]), _leans(o["O"]), o["census"] or "-"])
    lines += ["", markdown_table(["arm", "status", "steps", "val loss", "delta across probes per layer",
                                  "O across probes per layer", "census"], arms)]
    lines += ["", "Each arm:", ""]
    lines += [f"- {o['arm']}: {o['state']}" + (f"; {o['dir']}" if o["dir"] else "") for o in outcomes]
    layers = [[o["arm"], what, f"L{r['layer']}", f"{r['probes']} ({r['first_step']}-{r['last_step']})", r["positive"],
               f"{r['stouffer_z']:+.2f}", _f(r["mean_ratio"], "+.4f"), r["verdict"]]
              for o in outcomes for what in ("delta", "O") for r in o[what]]
    lines += ["", "Per layer (Stouffer z over the probes, probes with a positive z, mean bias ratio, verdict):", "",
              markdown_table(["arm", "error", "layer", "probes (steps)", "positive", "Stouffer z", "mean ratio",
                              "verdict"], layers)]
    lines += _split_lines(outcomes)
    lines += ["", "Rules: " + result["definitions"]]
    lines += markdown_footer(result)
    return "\n".join(lines) + "\n"


def _split_lines(outcomes) -> list[str]:
    """The table of where delta's error is born (analysis: split_across_probes), for the arms
    whose probes wrote it."""
    rows = [(o["arm"], r) for o in outcomes for r in o.get("delta_split") or []]
    if not rows:
        return []
    cells = []
    for arm, r in rows:
        for part, name in (("from_o", "from O's error"), ("own", "delta's own rounding")):
            p = r.get(part)
            if p is not None:
                cells.append([arm, f"L{r['layer']}", _f(r["tied_row_frac"], ".2%"), name,
                              f"{p['probes']} ({p['positive']})", f"{p['stouffer_z']:+.2f}", _f(p["mean"], "+.3g"),
                              _f(p["tied"], "+.3g"), _f(p["untied"], "+.3g")])
    lines = ["", "Where delta's error is born, per layer: the part O's error carries (rowsum(dO * O_lp) in fp64 - "
                 "delta_ref) and the part delta's own bf16 product and sum add; each part's Stouffer z across the "
                 "probes (significant at |z| >= 3.29), and its mean over the probes of its mean over all rows, over "
                 "rows with several Pbar == 1 in a tile (tied) and over the others:", "",
             markdown_table(["arm", "layer", "tied rows", "part", "probes (z > 0)", "Stouffer z", "mean",
                             "mean, tied rows", "mean, untied rows"], cells)]
    return lines

