"""GPU throughput of flashguard's Triton flash attention against torch's SDPA flash kernel.

    python benchmarks/gpu_attention.py --json results.json
    python benchmarks/gpu_attention.py --dims 64 --seqs 1024 4096 --json quick.json

Forward+backward (and forward alone) TFLOP/s, bf16, head dims 64 and 128, T = 1k .. 16k,
causal and not. As in the FlashAttention-2 paper's benchmark, batch * T = 16k tokens and
heads * head_dim = 2048, which fills the GPU at every T. Methods, all timed in the same run:
``triton-none`` and ``triton-safe`` (flashguard.attention.triton_flash_attention with that
stabilizer) and ``sdpa-flash`` (torch.nn.functional.scaled_dot_product_attention restricted
to SDPBackend.FLASH_ATTENTION). FLOPs: forward 4 * B * H * T^2 * D (half of it when causal),
backward 2.5 times the forward. Times are medians of triton.testing.do_bench (CUDA events).
Printed ratios: safe / none time (the stabilizer's overhead) and triton / SDPA throughput.
A configuration that fails (compile error, out of memory) is recorded with its error and the
sweep goes on. Each row also records max |O - O_sdpa| / max |O_sdpa| (a sanity check of the
output, not a precision measurement). On a machine without CUDA it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

TOKENS = 16384
HIDDEN = 2048


def flops(B, H, T, D, causal, mode):
    f = 4.0 * B * H * T * T * D * (0.5 if causal else 1.0)
    return f if mode == "fwd" else 3.5 * f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--methods", nargs="+", default=["triton-none", "triton-safe", "sdpa-flash"],
                    help="triton-<stabilizer> (none, paper, safe) and/or sdpa-flash")
    ap.add_argument("--tokens", type=int, default=TOKENS, help="batch * T")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="heads * head_dim")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="check this script on CPU: Triton's interpreter (set TRITON_INTERPRET=1), SDPA's "
                         "math backend, wall-clock timing; use tiny --seqs (the numbers mean nothing)")
    args = ap.parse_args(argv)
    dev = "cpu" if args.cpu_dry_run else "cuda"

    if not args.cpu_dry_run and not torch.cuda.is_available():
        print("benchmarks/gpu_attention.py needs a CUDA GPU; none here, nothing measured.")
        if args.json:
            args.json.write_text(json.dumps({"skipped": "no CUDA device"}, indent=1) + "\n")
        return 0

    import triton
    from triton.testing import do_bench
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from flashguard.attention import triton_flash_attention

    sdpa_backend = SDPBackend.MATH if args.cpu_dry_run else SDPBackend.FLASH_ATTENTION

    def bench(f):
        if not args.cpu_dry_run:
            return do_bench(f, warmup=args.warmup, rep=args.rep, return_mode="median")
        f()
        t0 = time.perf_counter()
        f()
        return (time.perf_counter() - t0) * 1e3

    def method_fn(name, causal):
        if name == "sdpa-flash":
            def run(q, k, v):
                with sdpa_kernel(sdpa_backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return run
        stab = name.removeprefix("triton-")
        return lambda q, k, v: triton_flash_attention(q, k, v, is_causal=causal, stabilizer=stab)

    info = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)", "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "tokens": args.tokens, "hidden": args.hidden, "dtype": "bf16"}
    print(json.dumps(info))
    causals = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    rows = []
    t_start = time.time()
    for D in args.dims:
        H = max(1, args.hidden // D)
        for T in args.seqs:
            B = max(1, args.tokens // T)
            g = torch.Generator(device=dev).manual_seed(0)
            q, k, v, do = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, generator=g)
                           for _ in range(4))
            for causal in causals:
                try:  # the output every method is compared with: torch's flash kernel
                    with torch.no_grad():
                        ref_o = method_fn("sdpa-flash", causal)(q, k, v).float()
                except Exception:
                    ref_o = None
                for name in args.methods:
                    row = dict(method=name, D=D, T=T, B=B, H=H, causal=causal)
                    fn = method_fn(name, causal)
                    try:
                        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                        o = fn(qg, kg, vg)
                        torch.autograd.grad(o, (qg, kg, vg), do)  # compiles / warms every kernel
                        if ref_o is not None:
                            row["o_diff_vs_sdpa"] = ((o.float() - ref_o).abs().max() / ref_o.abs().max()).item()

                        def fwd():
                            with torch.no_grad():
                                fn(q, k, v)

                        def fwd_bwd():
                            out = fn(qg, kg, vg)
                            torch.autograd.grad(out, (qg, kg, vg), do)

                        for mode, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                            ms = bench(f)
                            row[f"{mode}_ms"] = ms
                            row[f"{mode}_tflops"] = flops(B, H, T, D, causal, mode) / (ms * 1e-3) / 1e12
                        del o
                    except Exception as e:  # keep sweeping; the error is the result
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    rows.append(row)
                    if args.json:  # as it goes, so that a run cut short still leaves its rows
                        args.json.parent.mkdir(parents=True, exist_ok=True)
                        args.json.write_text(json.dumps({"info": info, "rows": rows, "partial": True}, indent=1) + "\n")
                    if dev == "cuda":
                        torch.cuda.empty_cache()
                    if "error" in row:
                        print(f"D={D:4d} T={T:6d} causal={causal!s:5} {name:12s} ERROR {row['error']}", flush=True)
                    else:
                        print(f"D={D:4d} T={T:6d} causal={causal!s:5} {name:12s} fwd {row['fwd_tflops']:7.1f} "
                              f"fwd+bwd {row['fwd_bwd_tflops']:7.1f} TFLOP/s ({row['fwd_bwd_ms']:.3f} ms)"
                              f"  max|o - sdpa|/max|sdpa| {row.get('o_diff_vs_sdpa', float('nan')):.2e}", flush=True)
            del q, k, v, do

    # ratios, per (D, T, causal)
    def get(method, D, T, causal, key):
        for r in rows:
            if (r["method"], r["D"], r["T"], r["causal"]) == (method, D, T, causal) and key in r:
                return r[key]
        return None

    ratios = []
    print("\n   D      T causal | safe/none time fwd, fwd+bwd | triton-none / sdpa TFLOP/s fwd, fwd+bwd")
    for D in args.dims:
        for T in args.seqs:
            for causal in causals:
                rec = dict(D=D, T=T, causal=causal)
                for mode in ("fwd", "fwd_bwd"):
                    a, b = get("triton-safe", D, T, causal, f"{mode}_ms"), get("triton-none", D, T, causal, f"{mode}_ms")
                    rec[f"safe_over_none_{mode}"] = a / b if a and b else None
                    a, b = (get("triton-none", D, T, causal, f"{mode}_tflops"),
                            get("sdpa-flash", D, T, causal, f"{mode}_tflops"))
                    rec[f"triton_over_sdpa_{mode}"] = a / b if a and b else None
                ratios.append(rec)
                fmt = lambda x: "   -  " if x is None else f"{x:6.3f}"  # noqa: E731
                print(f"{D:4d} {T:6d} {causal!s:6} | {fmt(rec['safe_over_none_fwd'])} {fmt(rec['safe_over_none_fwd_bwd'])}"
                      f"              | {fmt(rec['triton_over_sdpa_fwd'])} {fmt(rec['triton_over_sdpa_fwd_bwd'])}")
    summary = {}
    for key in ("safe_over_none_fwd", "safe_over_none_fwd_bwd", "triton_over_sdpa_fwd", "triton_over_sdpa_fwd_bwd"):
        vals = [r[key] for r in ratios if r[key]]
        summary[f"geomean_{key}"] = math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None
    summary["errors"] = sum("error" in r for r in rows)
    summary["seconds"] = round(time.time() - t_start, 1)
    print(json.dumps(summary))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"info": info, "rows": rows, "ratios": ratios, "summary": summary},
                                        indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
