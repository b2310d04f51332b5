"""Freed memory kept for reuse (utils/allocator.py) against the C library's own thresholds.

    python benchmarks/allocator.py [--rounds 3] [--reference /path/to/attention.py]

The setting is per process, so each side runs in its own child process: one with
``FLASHGUARD_RETAIN_MEMORY=0`` (glibc's thresholds: large tensors mapped fresh and unmapped on
free), one as flashguard's command line runs (``retain_freed_memory()``). Rounds alternate which
side starts. A child times, one thread each, one attention forward+backward (B 2, H 12, T 1024,
D 64, bf16, causal: torch SDPA, ``paper``, ``paper-fp32fwd``, ``fa2``, and the study's code with
``--reference``) and one tiny-cpu training step (batch 16 x T 256, bf16 autocast, AdamW: sdpa,
flash + paper, flash + fa2), the median of ``--repeats`` calls after two warm-ups, with the page
faults (minor) and the kernel's CPU time per call from getrusage. The parent reports, per
workload, the median over rounds of each side and the ratio kept / default (the arithmetic is the
same: the bits do not change, only where the memory comes from), and each side's peak resident
memory (ru_maxrss of the child: kept memory and the heap's fragmentation raise it). Writes
benchmarks/results/allocator-1thread.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results"
ATTENTION = ("sdpa", "paper/none", "paper-fp32fwd/none", "fa2/none")
TRAIN = ("sdpa", "flash+paper", "flash+fa2")


def _timed(fn, repeats: int) -> dict:
    """Median seconds of ``fn()`` over ``repeats`` calls after two warm-ups, and per call the
    minor page faults and the kernel's CPU seconds."""
    for _ in range(2):
        fn()
    r0, times = resource.getrusage(resource.RUSAGE_SELF), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"median_s": statistics.median(times), "faults": (r1.ru_minflt - r0.ru_minflt) / repeats,
            "sys_s": (r1.ru_stime - r0.ru_stime) / repeats}


def child(args) -> None:
    import torch
    torch.set_num_threads(1)
    from machine import machine  # noqa: F401  (applies the process's allocator setting)
    from machine import retention_status
    from attention import fwd_bwd, inputs, make_fn
    import train as bench_train
    out = {"allocator": retention_status(), "attention": {}, "train": {}}
    q, k, v, do = inputs(1024)
    names = list(ATTENTION) + (["reference-code"] if args.reference else [])
    for name in names:
        fn = make_fn(name, args.reference)
        out["attention"][name] = _timed(lambda fn=fn: fwd_bwd(fn, q, k, v, do), args.repeats)
    for name in TRAIN:
        s = bench_train._Setup(name, 16)
        x, y = bench_train._batches(s.cfg, 16, 1)[0]
        out["train"][name] = _timed(lambda s=s, x=x, y=y: s.step(x, y), args.repeats)
    out["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # KiB on Linux
    print(json.dumps(out))


def _run_child(keep: bool, args) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLASHGUARD_RETAIN_MEMORY": "1" if keep else "0"}
    cmd = [sys.executable, __file__, "--_child", "--repeats", str(args.repeats)]
    if args.reference:
        cmd += ["--reference", args.reference]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"allocator benchmark: the child failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="child pairs (each side once a round)")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per workload in a child")
    ap.add_argument("--reference", help="path to the study's attention.py, to time it too")
    ap.add_argument("--json", default=str(RESULTS / "allocator-1thread.json"))
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be at least 1")
    if args.reference and not Path(args.reference).is_file():
        ap.error(f"--reference: no file {args.reference}")
    if args._child:
        child(args)
        return
    runs = {"kept": [], "default": []}
    for r in range(args.rounds):
        for keep in ((True, False) if r % 2 == 0 else (False, True)):
            runs["kept" if keep else "default"].append(_run_child(keep, args))
            print(f"round {r + 1}: {'kept' if keep else 'default'} done", file=sys.stderr)
    table = {"process: peak resident MiB": {side: statistics.median(run["max_rss_mib"] for run in runs[side])
                                            for side in runs}}
    for group in ("attention", "train"):
        for name in runs["kept"][0][group]:
            row = {}
            for side in ("default", "kept"):
                vals = [run[group][name] for run in runs[side]]
                row[side] = {key: statistics.median(v[key] for v in vals) for key in ("median_s", "faults", "sys_s")}
            row["kept_over_default"] = row["kept"]["median_s"] / row["default"]["median_s"]
            table[f"{group}: {name}"] = row
    print(f"{'workload':<34}{'default ms':>11}{'faults':>9}{'kept ms':>9}{'faults':>9}{'kept/default':>14}")
    for name, row in table.items():
        if name.startswith("process"):
            print(f"{name:<34}{row['default']:>11.0f}{'':>9}{row['kept']:>9.0f}{'':>9}{row['kept'] / row['default']:>14.2f}")
            continue
        d, k = row["default"], row["kept"]
        print(f"{name:<34}{d['median_s'] * 1e3:>11.1f}{d['faults']:>9.0f}{k['median_s'] * 1e3:>9.1f}"
              f"{k['faults']:>9.0f}{row['kept_over_default']:>14.2f}")
    from machine import machine
    from flashguard.utils.atomic import atomic_write_text
    result = {"machine": machine(), "threads": 1, "rounds": args.rounds, "repeats": args.repeats,
              "allocator": {side: runs[side][0]["allocator"] for side in runs}, "results": table}
    atomic_write_text(Path(args.json), json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
