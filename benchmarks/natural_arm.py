"""The time of a natural-preconditions arm: nat512's set-up (tiny-cpu-512-docs: 16 x 512 tokens a
step, probes on every layer every 50 steps, an evaluation every 100) on one core.

    python benchmarks/natural_arm.py                       # paper and fa2 arms, 100 steps each
    python benchmarks/natural_arm.py --arms paper,sdpa,fa2 --steps 200 --fallback

Each arm is ``flashguard train tiny-cpu-512-docs`` in its own process (OMP_NUM_THREADS=1) for
``--steps`` steps, on the embedded short documents (prepared into a temporary folder unless
``--data`` names one), checkpoints off. The minutes of a 1,000-step arm are extrapolated from
the run's own records (metrics.jsonl): the median step without a probe times the steps without
one, the mean probe step (``time/step_s`` where ``time/diagnostics_s`` is) times 20 probes, the
mean evaluation (``time/eval_s``) times the 10 evaluations of 1,000 steps, and once the rest of
the wall time (start-up and writing, not scaled: at ``--steps 1000`` the estimate is the wall
time itself, which checks the extrapolation); the wall time of the run is recorded beside it.
``--fallback`` runs each arm a second time with ``FLASHGUARD_NATIVE=0`` and
``FLASHGUARD_RETAIN_MEMORY=0`` (no C kernels, glibc's allocator thresholds): the same arithmetic,
before this project's CPU speed-ups. Target (issue 25): an arm in at most 20 minutes on one core.
Writes benchmarks/results/natural-arm-1thread.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import machine  # noqa: E402

from flashguard import keys  # noqa: E402

RESULTS = HERE / "results"
CONFIG, STEPS, EVERY, EVAL_EVERY = "tiny-cpu-512-docs", 1000, 50, 100
ARMS = {"paper": [], "fa2": ["attention.precision=fa2"], "sdpa": ["attention.backend=sdpa"],
        "fp32": ["attention.precision=fp32"]}


def _flashguard(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flashguard.cli", *args], capture_output=True, text=True, env=env)


def run_arm(arm: str, steps: int, data: Path, fallback: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if fallback:
        env.update(FLASHGUARD_NATIVE="0", FLASHGUARD_RETAIN_MEMORY="0")
    with tempfile.TemporaryDirectory(prefix="fg-natural-arm-") as out:
        t0 = time.perf_counter()
        proc = _flashguard("train", CONFIG, "--out", out, f"data.dir={data}", f"train.steps={steps}",
                           f"train.diagnostics_every={EVERY}", f"train.eval_every={EVAL_EVERY}", "train.log_every=1",
                           "train.checkpoint_every=1000000", *ARMS[arm], env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"natural_arm: the {arm} arm failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
        rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_s = [r[keys.STEP_TIME] for r in rows if keys.STEP_TIME in r]
    evals = [r[keys.EVAL_TIME] for r in rows if keys.EVAL_TIME in r]
    probes = [r[keys.DIAGNOSTICS_TIME] for r in rows if keys.DIAGNOSTICS_TIME in r]
    plain = statistics.median(r[keys.STEP_TIME] for r in rows
                              if keys.STEP_TIME in r and keys.DIAGNOSTICS_TIME not in r)
    probed = [r[keys.STEP_TIME] for r in rows if keys.DIAGNOSTICS_TIME in r]
    if len(steps_s) != steps or len(evals) != steps // EVAL_EVERY:
        raise SystemExit(f"natural_arm: the {arm} arm logged {len(steps_s)} steps and {len(evals)} evaluations; "
                         f"expected {steps} and {steps // EVAL_EVERY}")
    rest = wall - sum(steps_s) - sum(evals)   # start-up, writing: once a run
    n_probes, n_evals = STEPS // EVERY, STEPS // EVAL_EVERY
    minutes = (plain * (STEPS - n_probes) + statistics.mean(probed) * n_probes
               + statistics.mean(evals) * n_evals + rest) / 60
    return {"steps": steps, "wall_s": wall, "plain_step_s": plain, "probe_s": statistics.mean(probes),
            "probed_step_s": statistics.mean(probed), "eval_s": statistics.mean(evals), "rest_s": rest,
            "minutes_per_1000": minutes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="paper,fa2", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--steps", type=int, default=100, help="steps a run (a multiple of 100: whole probe "
                                                            "and evaluation intervals)")
    ap.add_argument("--fallback", action="store_true", help="also run each arm without the C kernels and "
                                                            "the allocator setting")
    ap.add_argument("--data", help="a prepared embedded-docs folder (default: prepared into a temporary one)")
    ap.add_argument("--json", default=str(RESULTS / "natural-arm-1thread.json"))
    args = ap.parse_args()
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        ap.error(f"--arms: unknown {unknown or 'none given'}; valid: {', '.join(ARMS)}")
    if args.steps < 100 or args.steps % 100:
        ap.error("--steps must be a positive multiple of 100")
    with tempfile.TemporaryDirectory(prefix="fg-natural-data-") as tmp:
        data = Path(args.data) if args.data else Path(tmp) / "embedded-docs"
        if not args.data:
            proc = _flashguard("prepare", "embedded-docs", "--out", str(data), env=dict(os.environ))
            if proc.returncode != 0:
                raise SystemExit(f"natural_arm: preparing the data failed:\n{proc.stderr[-2000:]}")
        results = {}
        for arm in arms:
            for fallback in ((False, True) if args.fallback else (False,)):
                name = arm + ("~fallback" if fallback else "")
                results[name] = r = run_arm(arm, args.steps, data, fallback)
                print(f"{name:<16} {r['steps']} steps in {r['wall_s']:.0f} s: step {r['plain_step_s']:.2f} s, "
                      f"probe {r['probe_s']:.1f} s -> {r['minutes_per_1000']:.1f} min per 1,000 steps")
    from flashguard.utils.atomic import atomic_write_text
    out = {"machine": machine(), "threads": 1, "config": CONFIG, "every": EVERY, "results": results}
    atomic_write_text(Path(args.json), json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
