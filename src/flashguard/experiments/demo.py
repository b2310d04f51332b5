"""`flashguard demo`: the README's main job, minutes on a 2-core CPU, from a fresh install.

1. prepares the embedded corpus (Python's standard library) if it is not there yet;
2. runs the rounding-bias lab in quick mode (where the bias comes from, with verdicts);
3. trains the `demo` repro preset: fp32 attention, the study's reference arithmetic with no
   fix, with the study's fix and with the lab's measured fix (`paper-fp32fwd`), same seed and
   batches, probed every 20 steps
   (claims C1, C5, C6, C8; an explosion itself takes far longer than a demo, so C1 and C8
   are expected to read "not held" / "inconclusive" here, and the report says why);
4. trains the causal comparison (`micro-demo` injection preset, seed 1, about two minutes): the
   micro model with the arithmetic's own delta error, with that error leaning (sign + with
   probability 0.75) at its own size, and with it zero-mean at 100x its size, on the same batches
   (claim I1: does the sign structure, not the size, explode a run?);
5. trains a short edge attribution (`micro-edge-demo`, seeds 1-2, about two minutes): at the lr
   where paper diverges and fp32 trains, paper with delta exact (no delta error at all) and
   production fa2 beside them - the demo's small sample of docs/edge, whose 10 seeds a arm answer
   whether the study's mechanism makes that divergence;
6. writes the report (report.md, self-contained report.html) and prints where it is, with the
   natural runs' verdicts (docs/natural/natural.json, measured apart: 40 minutes an arm) when it
   runs where that file is (``natural=``: another natural.json).

The console starts with what will run and why no explosion is expected, and ends with the
same plain-language summary report.md and report.html begin with (report/summary_text.py):
what ran, what held, and what to use in one's own bf16 training per arithmetic, read from
the lab's measured answers, with copy-paste recipes.

Every stage is resumable: rerunning the command skips what is finished. A run keeps one
checkpoint while it trains (to resume from) and none once it is finished, since the report
reads the runs' metrics only (``keep_checkpoints=True``: the last one of each run stays, for
``flashguard diagnose``). A tiny-cpu checkpoint is 39 MB (weights and optimizer state).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

__all__ = ["run_demo", "DEMO_CLAIMS"]

DEMO_CLAIMS = ("C1", "C5", "C6", "C8")


def run_demo(out: str | Path = "demo", *, data_dir: str | Path = "data/embedded", steps: int | None = None,
             keep_checkpoints: bool = False, progress: bool = True, log=print,
             natural: str | Path | None = None) -> dict:
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"--steps must be an integer >= 1 (steps per training run), got {steps!r}")
    from ..data import prepare_embedded
    from .lab import run_lab
    from .lab.report import write_lab
    from .report import write_report
    from .report.summary_text import intro_text, render_text, summary_from_repro
    from .injection import get_injection_preset, run_injection
    from .edge import get_edge_preset, run_edge
    from .repro import get_preset, run_repro

    t0 = time.perf_counter()
    out, data_dir = Path(out), Path(data_dir)
    preset = get_preset("demo")
    log(intro_text(steps or preset.steps).rstrip())
    if not (data_dir / "meta.json").is_file():
        log(f"[1/6] preparing the embedded corpus in {data_dir}")
        prepare_embedded(data_dir, progress=progress)
    else:
        log(f"[1/6] corpus: {data_dir}")
    if (out / "lab" / "lab.json").is_file():
        log("[2/6] lab: already done")
        lab = json.loads((out / "lab" / "lab.json").read_text())
    else:
        log("[2/6] rounding-bias lab (quick)")
        lab = run_lab(quick=True, precision="paper", seed=0, progress=lambda m: log(f"  {m}"))
        write_lab(lab, out / "lab")
    log("[3/6] matched training runs")
    result = run_repro(preset, out, claims=DEMO_CLAIMS, steps=steps,
                       overrides=[f'data.dir="{data_dir}"'], progress=progress, log=lambda m: log(f"  {m}"))
    log("[4/6] causal comparison: error injection on the micro model (real / leaning x1 / zero-mean x100)")
    # seed 1: one of the five seeds the micro-grid measured (the leaning arm diverged at all five)
    injection = run_injection(get_injection_preset("micro-demo"), out / "injection", steps=steps, seeds=[1],
                              overrides=[f'data.dir="{data_dir}"'], progress=False, log=lambda m: log(f"  {m}"))
    log("[5/6] edge attribution, the demo's small sample (2 seeds; docs/edge has 10 a arm)")
    edge = run_edge(get_edge_preset("micro-edge-demo"), out / "edge", steps=steps,
                    overrides=[f'data.dir="{data_dir}"'], log=lambda m: None)
    for line in _edge_lines(edge):
        log(f"  {line}")
    natural = _natural_result(out, Path(natural) if natural is not None else None, log)
    log("[6/6] report")
    paths = write_report([out], out / "report")
    if not keep_checkpoints:
        freed = _drop_checkpoints(out, result) + _drop_checkpoints(out / "injection", injection)
        if freed:
            log(f"  removed the finished runs' checkpoints ({freed / 1e6:.0f} MB; the report reads their metrics; "
                "--keep-checkpoints keeps the last one per run)")
    for c in result["claims"]:
        log(f"  {c['id']}  {c['verdict']:<12}  {c['evidence']}")
    log("")
    log(render_text(summary_from_repro(result, lab, out, injection, natural)).rstrip())
    log("")
    log(f"demo done in {time.perf_counter() - t0:.0f} s; report: {paths['html'].resolve()}")
    return {"repro": result, "injection": injection, "edge": edge, "report": paths}


# the full edge attribution, measured apart (10 seeds a arm): shown next to the demo's sample when
# the demo runs where it is
EDGE_RESULT = Path("docs/edge/micro-edge/edge.json")


def _edge_lines(edge: dict, full: Path = EDGE_RESULT) -> list[str]:
    """The edge sample as console lines: each arm's divergences, then the same arms in the full
    experiment when its result is at hand."""
    block = edge["by_lr"][0]
    lines = [f"peak lr {block['lr']:.3g}: " + "; ".join(f"{a['label']} {a['diverged']}/{a['finished']} diverged"
                                                      for a in block["arms"]) + " (2 seeds decide nothing)"]
    try:
        measured = json.loads(full.read_text())
        counts = {a["arm"]: a for a in measured["by_lr"][0]["arms"]}
    except (OSError, ValueError, KeyError, IndexError):
        return lines + [f"the full attribution (10 seeds a arm): flashguard edge (see {full.parent})"]
    same = [f"{a['label']} {counts[a['arm']]['diverged']}/{counts[a['arm']]['finished']}" for a in block["arms"]
            if a["arm"] in counts]
    return lines + [f"measured apart ({full}, {len(measured['seeds'])} seeds a arm): " + "; ".join(same)]


# the natural runs take about 40 minutes an arm on one core, far beyond a demo: it shows the result
# measured and committed in the repository (docs/natural/), when it runs where that is
NATURAL_RESULT = Path("docs/natural/natural.json")


def _natural_result(out: Path, path: Path | None, log) -> dict | None:
    """The natural runs' result (natural.json) copied into OUT/natural/ for the report, or None."""
    path = NATURAL_RESULT if path is None else path
    if not path.is_file():
        log(f"  natural runs: {path} not found (they are measured apart: flashguard natural)")
        return None
    try:
        natural = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        log(f"  natural runs: {path} is not valid JSON ({e}); left out")
        return None
    from ..utils.atomic import atomic_write_text
    (out / "natural").mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "natural" / "natural.json", json.dumps(natural, indent=1) + "\n")
    log(f"  natural runs: measured apart, read from {path}")
    return natural


def _drop_checkpoints(out: Path, result: dict) -> int:
    """Delete the checkpoints of the runs that finished (done or diverged); returns the bytes freed."""
    freed = 0
    for run in result["runs"]:
        ckpts = out / run["dir"] / "checkpoints"
        if run["summary"]["status"] in ("done", "diverged") and ckpts.is_dir():
            freed += sum(f.stat().st_size for f in ckpts.rglob("*") if f.is_file())
            shutil.rmtree(ckpts)
    return freed
