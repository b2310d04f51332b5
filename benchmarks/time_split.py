"""Where the time goes: one attention forward+backward per precision, and one tiny-cpu training
step per attention backend, profiled op by op and summed by kind.

    python benchmarks/time_split.py                      # both tables, one thread
    python benchmarks/time_split.py --tag before         # results/time-split-before-1thread.{json,md}
    python benchmarks/time_split.py --presets fa2,paper --no-train
    python benchmarks/time_split.py --reference /path/to/attention.py   # + the study's code's row
    python benchmarks/time_split.py --presets sdpa,fa2,torch-cpu~fallback,torch-cpu --no-train --tag torch-cpu
                                                         # the C kernels' before (~fallback) and after

Kinds: ``gemm`` (bmm / mm / addmm: the matrix products), ``copy`` (dtype conversions and
contiguous copies: copy_, _to_copy), ``sdpa kernel`` (torch's own CPU flash kernel, the
baseline), ``gelu`` (the model's tanh GELU and its backward) and ``other`` (every other aten op:
the elementwise passes of the emulated softmax, roundings, masks, reductions, AdamW's update).
Self CPU time of aten ops only, so that nothing is counted twice; ``python`` is the wall time
the profiler saw minus the ops' sum (interpreter, autograd bookkeeping).

Each configuration is warmed up with ``--repeats`` untimed calls, then three calls are profiled
and their mean is reported; the profiler slows small ops, so treat the split as a proportion,
not as a timing (benchmarks/attention.py and train.py time). The "gemm / base wall" column
is the GEMM time alone against SDPA's whole call: no rearrangement of the elementwise work can
bring a preset below it without changing the products' arithmetic (the matmul rule,
numerics.arith.matmul: fp32 products of bf16 operands run as fp32 GEMMs on upcast copies on
CPU, about twice a bf16 GEMM's time, since torch's CPU bmm has no bf16-in / fp32-out form).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from flashguard.utils.atomic import atomic_write_text
from flashguard.utils.table import markdown_table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine  # noqa: E402
from attention import FALLBACK, fwd_bwd, inputs, make_fn, native_off  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ATTENTION = ("sdpa", "paper", "paper-fp32fwd", "fa2", "fp32")
TRAIN = ("sdpa", "flash+paper", "flash+fa2")
KINDS = ("gemm", "copy", "sdpa kernel", "gelu", "other", "python")
_GEMM = {"aten::bmm", "aten::mm", "aten::addmm", "aten::baddbmm"}
_COPY = {"aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous"}


def kind(op: str) -> str:
    if op in _GEMM:
        return "gemm"
    if op in _COPY:
        return "copy"
    if op.startswith("aten::_scaled_dot_product_flash_attention"):
        return "sdpa kernel"
    if op.startswith("aten::gelu"):
        return "gelu"
    return "other"


def split(fn, repeats: int, calls: int = 3) -> dict:
    """ms by kind of a call of ``fn`` (the mean over ``calls`` profiled calls after ``repeats``
    untimed ones), and its wall ms."""
    for _ in range(repeats):
        fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        wall = (time.perf_counter() - t0) * 1e3 / calls
    ms = dict.fromkeys(KINDS, 0.0)
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            ms[kind(e.key)] += e.self_cpu_time_total / 1e3 / calls
    ms["python"] = max(0.0, wall - sum(ms.values()))
    return {"wall_ms": wall, "ms": ms}


def attention_table(presets, t: int, repeats: int, reference: "str | None" = None) -> dict:
    """The attention rows; with ``reference`` (the study's attention.py) a ``reference-code`` row,
    whose bf16 products are the very ones ``paper`` must run to give its bits."""
    q, k, v, do = inputs(t)
    out = {}
    for p in [*presets, *(["reference-code"] if reference else [])]:
        name, fallback = p.removesuffix(FALLBACK), p.endswith(FALLBACK)
        fn = make_fn(name if name in ("sdpa", "reference-code") else f"{name}/none", reference)
        with native_off(fallback):
            out[p] = split(lambda fn=fn: fwd_bwd(fn, q, k, v, do), repeats)
    return out


def train_table(names, repeats: int) -> dict:
    import train as bench_train  # benchmarks/train.py: the same model, optimizer and batches
    out = {}
    for name in names:
        s = bench_train._Setup(name, 16)
        x, y = bench_train._batches(s.cfg, 16, 1)[0]
        out[name] = split(lambda s=s, x=x, y=y: s.step(x, y), repeats)
    return out


def markdown(title: str, rows: dict, base: str) -> list[str]:
    base_wall = rows[base]["wall_ms"] if base in rows else float("nan")
    body = [[name, f"{r['wall_ms']:.1f}", *(f"{r['ms'][k]:.1f}" for k in KINDS), f"{r['ms']['gemm'] / base_wall:.2f}"]
            for name, r in rows.items()]
    return [f"### {title}", "", markdown_table(["config", "wall ms", *KINDS, "gemm / base wall"], body), ""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=",".join(ATTENTION), help="attention presets (and sdpa)")
    ap.add_argument("--t", type=int, default=1024, help="sequence length of the attention table")
    ap.add_argument("--repeats", type=int, default=2, help="untimed calls before the three profiled ones")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-train", action="store_true", help="skip the training-step table")
    ap.add_argument("--tag", default="", help="name part of the results files (e.g. before, after)")
    ap.add_argument("--reference", help="path to the study's attention.py: its row too (the paper target's limit)")
    args = ap.parse_args()
    if args.reference and not Path(args.reference).is_file():
        ap.error(f"--reference: no file {args.reference}")
    torch.set_num_threads(args.threads)
    result = {"torch": torch.__version__, "machine": machine(), "threads": torch.get_num_threads(), "t": args.t,
              "attention": attention_table(args.presets.split(","), args.t, args.repeats, args.reference)}
    if not args.no_train:
        result["train"] = train_table(TRAIN, args.repeats)
    md = [f"# Where the time goes ({result['torch']}, {result['threads']} thread(s))", "",
          "Self CPU ms by kind of one call (benchmarks/time_split.py; a proportion, not a timing).", "",
          *markdown(f"Attention forward+backward, B 2, H 12, T {args.t}, D 64, bf16, causal", result["attention"],
                    "sdpa")]
    if "train" in result:
        md += markdown("tiny-cpu training step (batch 16 x T 256, bf16 autocast, AdamW)", result["train"], "sdpa")
    text = "\n".join(md)
    print(text)
    stem = RESULTS / f"time-split{'-' + args.tag if args.tag else ''}-{result['threads']}thread"
    atomic_write_text(stem.with_suffix(".json"), json.dumps(result, indent=1) + "\n")
    atomic_write_text(stem.with_suffix(".md"), text + "\n")


if __name__ == "__main__":
    main()
