"""`flashguard repro`: train a preset's matched runs one after another, then judge the claims.

    OUT/repro.json     preset, versions, every run's overrides and summary, the claims
    OUT/claims.md      the claims table (and the runs and remedies tables)
    OUT/runs/NAME/     each training run (config.toml, metrics.jsonl, batches.jsonl, checkpoints/)

Resumable: a finished run is skipped, an interrupted one resumes from its last checkpoint
(rerun the same command). A run that stopped before its first checkpoint is moved aside to
NAME.incomplete-K and started again, so nothing written is lost.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from ...train import load_config
from ...train.divergence import DIVERGENCE_FACTOR, describe_rule
from ...train.loop import gpt_config
from ...utils.atomic import atomic_write_text
from ...utils.table import markdown_table
from ..runs import check_steps, claims_table, markdown_footer, summarize_run, train_run, versions
from .claims import CLAIMS, judge_claims
from .presets import CLAIM_RUNS, ReproPreset, config_path, run_specs

__all__ = ["run_repro", "claims_markdown"]


def _needed(claims, focus: int) -> set[str]:
    names = {"fp32", "paper", "paper-fix", "paper-fp32fwd"}
    for c in claims:
        names |= {n.format(L=focus) for n in CLAIM_RUNS[c]}
    return names


def run_repro(preset: ReproPreset, out: str | Path, *, claims=None, remedies: bool = False, steps: int | None = None,
              overrides: list[str] | tuple = (), progress: bool = True, log=print) -> dict:
    check_steps(steps)
    claims = list(claims or CLAIMS)
    unknown = [c for c in claims if c not in CLAIMS]
    if unknown:
        raise ValueError(f"--claims: unknown claim(s) {', '.join(unknown)}; known: {', '.join(CLAIMS)}")
    out = Path(out)
    base = config_path(preset)
    focus = preset.focus_layer
    common = [*preset.overrides, f"train.diagnostics_every={preset.diagnostics_every}",
              f"train.diagnostics_layers=[{focus}]", f"train.divergence_factor={DIVERGENCE_FACTOR}",
              f"train.progress={'true' if progress else 'false'}", *overrides]
    cfg0 = load_config(base, [*common, f"attention.precision={preset.precision}"])  # validates the overrides first
    steps = steps or preset.steps or cfg0.train.steps
    model = gpt_config(cfg0)
    block, n_layer = model.block_size, model.n_layer
    if focus >= n_layer:
        raise ValueError(f"repro preset {preset.name!r}: focus layer {focus} does not exist ({n_layer} layers)")
    needed = _needed(claims, focus) | ({"qk-layernorm", "z-loss", "softcap"} if remedies else set())
    specs = [s for s in run_specs(preset.precision, focus, block, remedies=remedies) if s.name in needed]

    t0 = time.perf_counter()
    for i, spec in enumerate(specs, 1):
        log(f"[{i}/{len(specs)}] {spec.name}: {spec.title}")
        train_run(spec, base, common, steps, out / "runs" / spec.name, log)
        _write(out, preset, specs, claims, steps, focus, common, remedies, cfg0.train.seed)  # survives an interrupt
    result = _write(out, preset, specs, claims, steps, focus, common, remedies, cfg0.train.seed)
    result["wall_s"] = time.perf_counter() - t0
    return result


def _write(out: Path, preset, specs, claims, steps, focus, common, remedies, seed) -> dict:
    dirs = {s.name: out / "runs" / s.name for s in specs}
    summaries = {s.name: summarize_run(dirs[s.name], steps) for s in specs}
    runs = [{"name": s.name, "group": s.group, "title": s.title, "dir": f"runs/{s.name}",
             "overrides": [*common, *s.overrides], "summary": summaries[s.name]} for s in specs]
    verdicts = judge_claims(summaries, {n: d for n, d in dirs.items() if summaries[n]["status"] != "missing"}, focus, claims)
    result = {"preset": preset.name, "about": preset.about, "config": preset.config, "steps": steps,
              "seed": seed,
              "base_precision": preset.precision, "focus_layer": focus,
              "divergence_rule": describe_rule(DIVERGENCE_FACTOR),
              "versions": versions(), "runs": runs, "claims": verdicts,
              "remedies": _remedies(runs) if remedies else [], "lab": "lab" if (out / "lab" / "lab.json").exists() else None}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "repro.json", json.dumps(result, indent=1, default=float) + "\n")
    atomic_write_text(out / "claims.md", claims_markdown(result))
    return result


REMEDY_ROWS = ("paper", "qk-layernorm", "z-loss", "softcap", "fp32", "paper-fix", "paper-fp32fwd")


def _remedies(runs) -> list[dict]:
    by = {r["name"]: r for r in runs}
    return [{"name": n, "title": by[n]["title"], "diverged_at": by[n]["summary"]["diverged_at"],
             "final_loss": by[n]["summary"]["final_loss"], "min_loss": by[n]["summary"]["min_loss"],
             "last_val": by[n]["summary"]["last_val"], "status": by[n]["summary"]["status"]} for n in REMEDY_ROWS if n in by]


def _f(x, fmt=".3f") -> str:
    return "-" if x is None else format(x, fmt)


def claims_markdown(result: dict) -> str:
    lines = [f"# flashguard repro: {result['preset']}", "",
             f"{result['about']}. Flash runs in `{result['base_precision']}`; {result['steps']} steps, seed "
             f"{result['seed']}, focus layer {result['focus_layer']}. Divergence: {result['divergence_rule']}.", "",
             claims_table(result["claims"])]
    runs = [[r["name"], r["group"], r["title"], r["summary"]["steps"], _f(r["summary"]["final_loss"]),
             _f(r["summary"]["min_loss"]), _f(r["summary"]["diverged_at"], "d"), r["summary"]["status"]]
            for r in result["runs"]]
    lines += ["", markdown_table(["run", "group", "what differs", "steps", "final loss", "min loss", "diverged at",
                                  "status"], runs)]
    if result.get("remedies"):
        remedies = [[m["title"], _f(m["diverged_at"], "d"), _f(m["final_loss"]), _f(m["min_loss"]), _f(m.get("last_val"))]
                    for m in result["remedies"]]
        lines += ["", markdown_table(["remedy", "diverged at", "final train loss", "min train loss", "last val loss"],
                                     remedies)]
    lines += markdown_footer(result)
    return "\n".join(lines) + "\n"
