"""Drive the CPU-reproduction search (repro issue): run each candidate configuration,
resumably, and rewrite the results table in docs/cpu-reproduction.md.

    PYTHONPATH=src python tools/cpu_search.py [--steps 1500] [--only NAME ...]

Each candidate is a precision policy string for configs/tiny-cpu.toml. A candidate's
stochastic-rounding control runs only when its round-to-nearest run diverges (only then is
it needed to tell bias from noise). Runs live in runs/search/NAME-MODE and resume from
their last checkpoint, so the script can be stopped and restarted at any time.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "src"))
from search_summary import HEADER, row, summarize  # noqa: E402

# name -> fields changed in the `paper` preset (the study's reference arithmetic)
FWD = ("scores", "stats", "pbar", "pv", "o_accum", "output")  # every forward intermediate
CANDIDATES = {
    **{f"fwd-e8m{m}": ",".join(f"{f}=e8m{m}" for f in FWD) for m in (2, 3, 4, 5, 6)},
    "opath-e8m4": "pv=e8m4,o_accum=e8m4,output=e8m4",
    "opath-e8m3": "pv=e8m3,o_accum=e8m3,output=e8m3",
    "lpath-e8m4": "stats=e8m4",
    "olpath-e8m4": "stats=e8m4,pv=e8m4,o_accum=e8m4,output=e8m4",
    "opath-e8m2": "pv=e8m2,o_accum=e8m2,output=e8m2",
}
COMMON = ["optim.schedule=constant", "train.checkpoint_every=250", "train.eval_every=100", "train.progress=false",
          "train.divergence_factor=2.0"]
ARGS = argparse.Namespace(tag="", config="tiny-cpu.toml", set=[])
TABLE_START, TABLE_END = "<!-- search-table -->", "<!-- /search-table -->"


def run_dir(name: str, mode: str) -> Path:
    return ROOT / "runs" / "search" / f"{ARGS.tag}{name}-{mode}"


def finished(run: Path, steps: int) -> bool:
    return (run / "divergence.json").exists() or (run / "checkpoints" / f"ckpt_{steps:07d}.pt").exists()


def run(name: str, mode: str, steps: int) -> Path:
    out = run_dir(name, mode)
    if finished(out, steps):
        return out
    cmd = [sys.executable, "-m", "flashguard.cli", "train", str(ROOT / "configs" / ARGS.config), "--out", str(out),
           f"attention.precision=paper[{CANDIDATES[name]},rounding={mode}]", f"train.steps={steps}", *COMMON, *ARGS.set]
    if (out / "checkpoints").is_dir():
        cmd.append("--resume")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(str(out) + ".log", "a") as log:
        subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False)
    return out


def write_table(doc: Path) -> None:
    rows = list(HEADER)
    for run_path in sorted((ROOT / "runs" / "search").glob("*")):
        if (run_path / "metrics.jsonl").exists():
            rows.append(row(summarize(run_path)))
    text = doc.read_text()
    head, _, rest = text.partition(TABLE_START)
    _, _, tail = rest.partition(TABLE_END)
    doc.write_text(head + TABLE_START + "\n" + "\n".join(rows) + "\n" + TABLE_END + tail)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--only", nargs="*", help="candidate names (default: all)")
    ap.add_argument("--table-only", action="store_true", help="only rewrite the table in the doc")
    ap.add_argument("--config", default="tiny-cpu.toml", help="a TOML under configs/")
    ap.add_argument("--tag", default="", help="prefix of the run folders (e.g. micro-)")
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    global ARGS
    args = ARGS = ap.parse_args()
    doc = ROOT / "docs" / "cpu-reproduction.md"
    if not args.table_only:
        for name in args.only or CANDIDATES:
            nearest = run(name, "nearest", args.steps)
            write_table(doc)
            if summarize(nearest)["diverged_at"] is not None:
                run(name, "stochastic", args.steps)
                write_table(doc)
    write_table(doc)


if __name__ == "__main__":
    main()
