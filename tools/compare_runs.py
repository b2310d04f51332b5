"""Record a fixed set of micro training runs, and compare two such sets number for number.

A refactor of the training loop must leave every number of a run where it was. ``record``
trains the scenarios below (each seconds long on one CPU thread) into OUT/<scenario>;
``compare`` then checks two recordings file by file:

* metrics.jsonl: the same records, key for key, with exactly equal values (floats compared as
  float.hex), except the wall-time keys (``time/...``);
* batches.jsonl, config.toml and divergence.json: identical (divergence.json's paths are
  compared relative to their run folder);
* the checkpoints: the same files, with identical parameter, optimizer and RNG bytes.

    OMP_NUM_THREADS=1 .venv/bin/python tools/compare_runs.py record /tmp/before --data data/embedded
    (change the code)
    OMP_NUM_THREADS=1 .venv/bin/python tools/compare_runs.py record /tmp/after --data data/embedded
    OMP_NUM_THREADS=1 .venv/bin/python tools/compare_runs.py compare /tmp/before /tmp/after

``--data`` is a prepared corpus (``flashguard prepare embedded --out DIR``); the exit status of
``compare`` is 0 when every scenario matches, 1 otherwise.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MICRO = ROOT / "configs" / "micro.toml"
STEPS = 30

# scenario -> (overrides beyond the common ones, the step a first attempt crashes at (then resumed) or None)
SCENARIOS = {
    "plain": ({}, None),
    "resume": ({}, 17),
    "diagnostics": ({"train.diagnostics_every": 5}, None),
    "diagnostics-resume": ({"train.diagnostics_every": 5}, 12),
    "injection": ({"injection.rule": '"coherent"', "injection.p": 0.75}, None),
    "injection-resume": ({"injection.rule": '"coherent"', "injection.p": 0.75}, 21),
    "grad-accum": ({"train.grad_accum": 2, "train.log_every": 4}, None),
    "diverge-stop": ({"train.divergence_factor": 1.05}, None),
    "diverge-continue": ({"train.divergence_factor": 1.05, "train.on_divergence": '"continue"'}, None),
    "replay": ({}, None),   # replays plain's batches (recorded before it)
}


def _overrides(data: Path, extra: dict) -> list[str]:
    items = {"data.dir": f'"{data}"', "train.progress": "false", "train.steps": str(STEPS),
             "train.checkpoint_every": "10", "train.eval_every": "10", "train.eval_batches": "2",
             "train.keep_last": "5"}
    items.update({k: str(v) for k, v in extra.items()})
    return [f"{k}={v}" for k, v in items.items()]


def _crash_hook(at: int):
    from flashguard.train.hooks import TrainHook

    class Crash(TrainHook):
        def step_begin(self, step, model):
            if step == at:
                raise KeyboardInterrupt(f"simulated crash at step {at}")
    return Crash()


def _record(out: Path, data: Path, only: list[str] | None) -> None:
    import torch

    from flashguard.diagnostics import DiagnosticsHook
    from flashguard.train import load_config, train
    torch.set_num_threads(1)
    quiet = lambda *a, **k: None  # noqa: E731
    for name, (extra, crash) in SCENARIOS.items():
        if only and name not in only:
            continue
        run = out / name
        cfg = load_config(MICRO, _overrides(data, extra))
        if name == "replay":
            train(cfg, run, replay=out / "plain", log_fn=quiet, hooks=[DiagnosticsHook()])
        elif crash is None:
            train(cfg, run, log_fn=quiet, hooks=[DiagnosticsHook()])
        else:
            try:
                train(cfg, run, log_fn=quiet, hooks=[DiagnosticsHook(), _crash_hook(crash)])
            except KeyboardInterrupt:
                pass
            train(cfg, run, resume=True, log_fn=quiet, hooks=[DiagnosticsHook()])
        print(f"recorded {name}")


def _value(v):
    return float(v).hex() if isinstance(v, float) else v


def _metrics(path: Path) -> list[dict]:
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: _value(v) for k, v in r.items() if not k.startswith("time/")} for r in recs]


def _checkpoint_digest(path: Path) -> str:
    """sha256 of a checkpoint's tensors and plain values, in key order (not of the pickle's bytes)."""
    import torch
    h = hashlib.sha256()

    def walk(prefix: str, x) -> None:
        if isinstance(x, torch.Tensor):
            h.update(f"{prefix}:{x.dtype}:{tuple(x.shape)}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if x.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(f"{prefix}/{k}", x[k])
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(f"{prefix}[{i}]", v)
        else:
            h.update(f"{prefix}={_value(x)!r}".encode())
    walk("", torch.load(io.BytesIO(path.read_bytes()), map_location="cpu", weights_only=False))
    return h.hexdigest()


def _divergence(path: Path, run: Path) -> dict:
    d = json.loads(path.read_text())
    for k in ("last_good_checkpoint", "how_to_replay"):
        if isinstance(d.get(k), str):
            d[k] = d[k].replace(str(run), "RUN")
    d["metrics"] = {k: _value(v) for k, v in d["metrics"].items() if not k.startswith("time/")}
    return {k: _value(v) for k, v in d.items()}


def _compare_run(a: Path, b: Path) -> list[str]:
    problems = []
    for f in ("metrics.jsonl", "batches.jsonl", "config.toml", "divergence.json"):
        fa, fb = a / f, b / f
        if fa.exists() != fb.exists():
            problems.append(f"{f}: in one run only")
            continue
        if not fa.exists():
            continue
        if f == "metrics.jsonl":
            ma, mb = _metrics(fa), _metrics(fb)
            if ma != mb:
                first = next((i for i, (x, y) in enumerate(zip(ma, mb)) if x != y), min(len(ma), len(mb)))
                problems.append(f"metrics.jsonl: {len(ma)} vs {len(mb)} records, first difference at record {first}")
        elif f == "divergence.json":
            if _divergence(fa, a) != _divergence(fb, b):
                problems.append("divergence.json differs")
        elif fa.read_bytes() != fb.read_bytes():
            problems.append(f"{f} differs")
    ca = sorted(p.relative_to(a).as_posix() for p in (a / "checkpoints").glob("*.pt"))
    cb = sorted(p.relative_to(b).as_posix() for p in (b / "checkpoints").glob("*.pt"))
    if ca != cb:
        problems.append(f"checkpoints: {ca} vs {cb}")
    for rel in sorted(set(ca) & set(cb)):
        if _checkpoint_digest(a / rel) != _checkpoint_digest(b / rel):
            problems.append(f"{rel}: tensors differ")
    return problems


def _compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.iterdir() if p.is_dir()} | {p.name for p in b.iterdir() if p.is_dir()})
    bad = 0
    for name in names:
        if not (a / name).is_dir() or not (b / name).is_dir():
            print(f"{name}: recorded in one set only")
            bad += 1
            continue
        problems = _compare_run(a / name, b / name)
        n = len(_metrics(a / name / "metrics.jsonl"))
        print(f"{name}: " + ("; ".join(problems) if problems else f"identical ({n} records, checkpoints equal)"))
        bad += bool(problems)
    print(f"{len(names) - bad} of {len(names)} scenarios identical")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="train the scenarios into OUT/<scenario>")
    rec.add_argument("out", type=Path)
    rec.add_argument("--data", type=Path, required=True, help="a prepared corpus folder")
    rec.add_argument("--only", nargs="*", help="scenario names (default: all)")
    cmp = sub.add_parser("compare", help="compare two recordings")
    cmp.add_argument("a", type=Path)
    cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        _record(args.out, args.data.resolve(), args.only)
        return 0
    return _compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
