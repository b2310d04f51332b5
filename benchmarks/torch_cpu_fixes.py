"""What it costs a CPU user to take the lean out of torch's fused flash kernel (bf16).

The kernel leans because its fast exponential is 1 - 5.3e-5 at 0 (docs/audit/torch-cpu.md).
A user cannot change the kernel; they can pick another path that measured no lean
(docs/audit/audit.md): torch's math backend in bf16, the flash kernel in fp32 (its fp32 path
takes exp_u20, exact at 0, and rounds no P̄), or flashguard's ``fa2``. Forward + backward,
causal, bf16 inputs (B=2, H=12, D=64), interleaved runs in one process, medians, ratios
against the kernel measured in the same run.

    python benchmarks/torch_cpu_fixes.py --sizes 1024 --repeats 7 --json benchmarks/results/torch-cpu-fixes.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashguard import flash_attention
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, however this file is loaded
from machine import machine  # noqa: E402

B, H, D = 2, 12, 64


def _sdpa(backend, dtype=None):
    def fn(q, k, v):
        with sdpa_kernel(backend):
            if dtype is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype), is_causal=True).to(q.dtype)
    return fn


PATHS = {
    "torch flash, bf16 (leans)": _sdpa(SDPBackend.FLASH_ATTENTION),
    "torch math backend, bf16": _sdpa(SDPBackend.MATH),
    "torch flash, fp32 inputs": _sdpa(SDPBackend.FLASH_ATTENTION, torch.float32),
    "flashguard fa2": lambda q, k, v: flash_attention(q, k, v, is_causal=True, precision="fa2"),
}


def fwd_bwd(fn, q, k, v, do) -> float:
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    t0 = time.perf_counter()
    fn(*leaves).backward(do)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {"torch": torch.__version__, "machine": machine(), "threads": torch.get_num_threads(), "shape": [B, H, None, D], "sizes": {}}
    for t in (int(x) for x in args.sizes.split(",")):
        g = torch.Generator().manual_seed(0)
        q, k, v, do = (torch.randn(B, H, t, D, generator=g).bfloat16() for _ in range(4))
        times = {n: [] for n in PATHS}
        for fn in PATHS.values():
            fwd_bwd(fn, q, k, v, do)  # warm-up
        for _ in range(args.repeats):
            for n, fn in PATHS.items():
                times[n].append(fwd_bwd(fn, q, k, v, do))
        med = {n: statistics.median(x) for n, x in times.items()}
        base = med["torch flash, bf16 (leans)"]
        print(f"T={t}, {torch.get_num_threads()} threads, forward+backward, median of {args.repeats}")
        for n, m in med.items():
            print(f"  {n:<30}{m * 1e3:9.1f} ms {m / base:6.2f}x")
        out["sizes"][str(t)] = {n: {"median_s": m, "x_kernel": m / base} for n, m in med.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
