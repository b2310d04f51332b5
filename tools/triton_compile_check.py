"""Compile flashguard's Triton attention kernels for a Hopper GPU (sm_90) on a machine without one.

    PYTHONPATH=src python tools/triton_compile_check.py            # the GPU defaults, bf16, D = 64 and 128
    PYTHONPATH=src python tools/triton_compile_check.py --all      # + fp32 / fp16 / unaligned / test tiles
    PYTHONPATH=src python tools/triton_compile_check.py --scan     # other tiles, to choose defaults
    PYTHONPATH=src python tools/triton_compile_check.py --quick    # one of each kernel (the test suite's)

Triton's front end, optimizer and its bundled ptxas run here as they would on the GPU, which
the CPU interpreter (TRITON_INTERPRET=1) skips: type errors, constexpr scoping, shared memory
and register use all show. Each line gives the kernel, its constexprs, warps and stages, shared
memory (bytes), registers per thread, spill stack (bytes), and the counts of Hopper matrix
instructions (HGMMA) and local-memory loads/stores (LDL/STL, spills) in the SASS. Arguments
are specialized as Triton's launcher specializes contiguous tensors: unit stride along the head
dim, pointers and ints divisible by 16 ("aligned"; T = 97, D = 59 are not). Exits 1 if a kernel
fails to compile or needs more shared memory than an H100 / H200 block may have.

TRITON_INTERPRET must be unset (Triton reads it when it is imported).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("tools/triton_compile_check.py: unset TRITON_INTERPRET (the kernels must be compiled, not interpreted)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashguard.attention import _triton_kernels as K  # noqa: E402
from flashguard.attention import triton_flash as tf  # noqa: E402

SM90_MAX_SHARED = 232448  # bytes a block may opt into on H100 / H200
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_F32_PTRS = {"LSE", "M_OUT", "DELTA", "DQ", "DK"}
_IO_PTRS = {"Q", "K", "V", "O", "DO"}


def compile_sm90(fn, dtype: str, num_warps: int, num_stages: int, aligned: bool = True, **constexprs):
    """The compiled kernel (triton.compile's result) of ``fn`` for sm_90; dtype 'bf16' / 'fp16' / 'fp32'."""
    f32_ptrs = _F32_PTRS | ({"DV"} if fn.__name__ == "_bwd_dkdv_kernel" else set())
    if "DROPOUT" in fn.arg_names:
        constexprs.setdefault("DROPOUT", False)  # attention dropout: off unless a case asks for it
    sig, attrs = {}, {}
    for i, n in enumerate(fn.arg_names):
        if n in constexprs or re.fullmatch(r"s[a-z]{1,3}d", n):  # s*d: the head-dim strides, 1
            constexprs.setdefault(n, 1)
            sig[n] = "constexpr"
            continue
        sig[n] = ("*" + dtype if n in _IO_PTRS else "*fp64" if n == "CONSTS" else "*i64" if n == "SEED"
                  else "*fp32" if n in f32_ptrs else "fp32" if n in ("scale", "beta", "tol", "drop_scale") else "i32")
        if aligned and sig[n] != "fp32":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                          "num_stages": num_stages})


def usage(kernel) -> dict:
    """Registers, spill stack, HGMMA and LDL/STL counts from the cubin (triton's bundled cuobjdump)."""
    out = {"shared": kernel.metadata.shared}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        res = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", res)
        if m:
            out["regs"], out["stack"] = int(m.group(1)), int(m.group(2))
        sass = subprocess.run([os.path.join(_BIN, "cuobjdump"), "--dump-sass", f.name],
                              capture_output=True, text=True).stdout
        out.update({op: len(re.findall(rf"\b{op}\b", sass)) for op in ("HGMMA", "LDL", "STL")})
    except OSError:
        pass
    finally:
        os.unlink(f.name)
    return out


def quick_cases():
    """One of each kernel and path, for the test suite (a few seconds each)."""
    common = dict(F32_DOT=False, BF16_RNE=False)
    fwd = dict(ROW_SUM_ROUNDED=False, STORE_M=False)
    bm, bn, w, st = tf._fwd_config(128, False)
    yield (K._fwd_kernel, "bf16", w, st, True,
           dict(CAUSAL=True, STAB=2, BLOCK_M=bm, BLOCK_N=bn, D_PAD=128, DV_PAD=128, **fwd, **common))
    yield (K._fwd_kernel, "fp32", 4, 3, False,
           dict(CAUSAL=False, STAB=1, BLOCK_M=32, BLOCK_N=32, D_PAD=64, DV_PAD=32, ROW_SUM_ROUNDED=True,
                STORE_M=True, F32_DOT=True, BF16_RNE=False))
    (bm1, bn1), (bm2, bn2), w, st = tf._bwd_config(64, False)
    yield (K._bwd_dkdv_kernel, "bf16", w, st, True,
           dict(CAUSAL=True, BLOCK_M=bm1, BLOCK_N=bn1, D_PAD=64, DV_PAD=64, **common))
    yield (K._bwd_dq_kernel, "fp16", w, st, False,
           dict(CAUSAL=False, BLOCK_M=bm2, BLOCK_N=bn2, D_PAD=64, DV_PAD=32, **common))
    yield K._bwd_delta_kernel, "bf16", 4, 1, True, dict(BLOCK_M=64, DV_PAD=128)
    # attention dropout (the uint32 hash in each kernel)
    bm, bn, fw, fst = tf._fwd_config(64, False)
    yield (K._fwd_kernel, "bf16", fw, fst, True,
           dict(CAUSAL=True, STAB=0, BLOCK_M=bm, BLOCK_N=bn, D_PAD=64, DV_PAD=64, DROPOUT=True, **fwd, **common))
    yield (K._bwd_dkdv_kernel, "bf16", w, st, True,
           dict(CAUSAL=True, BLOCK_M=bm1, BLOCK_N=bn1, D_PAD=64, DV_PAD=64, DROPOUT=True, **common))
    yield (K._bwd_dq_kernel, "bf16", w, st, True,
           dict(CAUSAL=True, BLOCK_M=bm2, BLOCK_N=bn2, D_PAD=64, DV_PAD=64, DROPOUT=True, **common))


def cases(all_paths: bool, scan: bool):
    common = dict(F32_DOT=False, BF16_RNE=False)
    fwd = dict(ROW_SUM_ROUNDED=False, STORE_M=False)
    for d in (64, 128):
        bm, bn, w, st = tf._fwd_config(d, False)
        for stab in (0, 1, 2):
            for causal in (False, True):
                yield (K._fwd_kernel, "bf16", w, st, True,
                       dict(CAUSAL=causal, STAB=stab, BLOCK_M=bm, BLOCK_N=bn, D_PAD=d, DV_PAD=d, **fwd, **common))
        (bm1, bn1), (bm2, bn2), w, st = tf._bwd_config(d, False)
        for causal in (False, True):
            yield (K._bwd_dkdv_kernel, "bf16", w, st, True,
                   dict(CAUSAL=causal, BLOCK_M=bm1, BLOCK_N=bn1, D_PAD=d, DV_PAD=d, **common))
            yield (K._bwd_dq_kernel, "bf16", w, st, True,
                   dict(CAUSAL=causal, BLOCK_M=bm2, BLOCK_N=bn2, D_PAD=d, DV_PAD=d, **common))
        yield K._bwd_delta_kernel, "bf16", 4, 1, True, dict(BLOCK_M=64, DV_PAD=d)
    if all_paths:  # what the GPU tests also run: fp32 (IEEE dots), fp16, shift output, rounded row sums,
        # unaligned sizes, 32 x 32 forward tiles, D_v != D
        yield (K._fwd_kernel, "fp32", 4, 3, False,
               dict(CAUSAL=False, STAB=1, BLOCK_M=32, BLOCK_N=32, D_PAD=64, DV_PAD=64, ROW_SUM_ROUNDED=True,
                    STORE_M=True, F32_DOT=True, BF16_RNE=False))
        yield (K._fwd_kernel, "fp16", 4, 3, False,
               dict(CAUSAL=True, STAB=2, BLOCK_M=32, BLOCK_N=32, D_PAD=32, DV_PAD=64, **fwd, **common))
        for dtype, f32 in (("fp32", True), ("fp16", False)):
            yield (K._bwd_dkdv_kernel, dtype, 4, 4, False,
                   dict(CAUSAL=True, BLOCK_M=32, BLOCK_N=128, D_PAD=64, DV_PAD=32, F32_DOT=f32, BF16_RNE=False))
            yield (K._bwd_dq_kernel, dtype, 4, 4, False,
                   dict(CAUSAL=False, BLOCK_M=128, BLOCK_N=32, D_PAD=64, DV_PAD=32, F32_DOT=f32, BF16_RNE=False))
    if scan:
        for d in (64, 128):
            for bm, bn, w, st in ((128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3),
                                  (64, 128, 4, 3), (128, 32, 4, 3)):
                yield (K._fwd_kernel, "bf16", w, st, True,
                       dict(CAUSAL=True, STAB=2, BLOCK_M=bm, BLOCK_N=bn, D_PAD=d, DV_PAD=d, **fwd, **common))
            for (bm, bn), w, st in (((32, 128), 4, 4), ((32, 128), 8, 3), ((64, 64), 4, 3), ((64, 128), 8, 3),
                                    ((32, 64), 4, 4), ((64, 64), 8, 3)):
                # dK/dV tiles (queries bm x keys bn); the dQ kernel gets the mirrored tile
                yield (K._bwd_dkdv_kernel, "bf16", w, st, True,
                       dict(CAUSAL=True, BLOCK_M=bm, BLOCK_N=bn, D_PAD=d, DV_PAD=d, **common))
                yield (K._bwd_dq_kernel, "bf16", w, st, True,
                       dict(CAUSAL=True, BLOCK_M=bn, BLOCK_N=bm, D_PAD=d, DV_PAD=d, **common))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="also the non-default paths the tests take")
    ap.add_argument("--scan", action="store_true", help="also other tile configurations")
    ap.add_argument("--quick", action="store_true", help="only one of each kernel and path (the test suite's)")
    ap.add_argument("--no-sass", action="store_true", help="skip cuobjdump (registers, HGMMA, spills)")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, target sm_90")
    failed = 0
    for fn, dtype, w, st, aligned, cx in (quick_cases() if args.quick else cases(args.all, args.scan)):
        show = {k: v for k, v in cx.items() if k in ("CAUSAL", "STAB", "BLOCK_M", "BLOCK_N", "D_PAD", "DV_PAD")
                or (k in ("ROW_SUM_ROUNDED", "STORE_M", "F32_DOT") and v)}
        label = f"{fn.__name__:18s} {dtype:4s} w{w} s{st} {'aligned  ' if aligned else 'unaligned'} " + \
            " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in show.items())
        t0 = time.time()
        try:
            kernel = compile_sm90(fn, dtype, w, st, aligned, **dict(cx))
        except Exception as e:  # a compile error is the result
            failed += 1
            print(f"{label}  FAILED {type(e).__name__}: {str(e).strip().splitlines()[-1][:200]}", flush=True)
            continue
        u = {"shared": kernel.metadata.shared} if args.no_sass else usage(kernel)
        over = u["shared"] > SM90_MAX_SHARED
        failed += over
        print(f"{label}  shared={u['shared']}{' (OVER THE LIMIT)' if over else ''} regs={u.get('regs', '?')} "
              f"stack={u.get('stack', '?')} HGMMA={u.get('HGMMA', '?')} LDL/STL={u.get('LDL', '?')}/{u.get('STL', '?')}"
              f"  {time.time() - t0:.1f}s", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
