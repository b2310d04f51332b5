"""``flashguard audit``: does an attention kernel lean under tied maxima (or, --decompose, where)."""
from __future__ import annotations

from .common import wrap

NAME, OVERRIDES = "audit", False


def add(sub, values: str):
    au = sub.add_parser("audit", help="does your attention kernel lean under tied maxima? (torch SDPA backends, "
                                      "flashguard presets, Triton, flash-attn)",
                        description=wrap("Measures each attention kernel this device offers as a black box on the "
                                         "lab's problems of independent rows: O and delta against fp64, one value "
                                         "per row, paired against the fp32 noise floor. Writes OUT/audit.md, "
                                         "audit.json and audit.png."))
    au.add_argument("--quick", action="store_true", help="1,024 rows per condition instead of 3,072")
    au.add_argument("--out", default="audit", help="output folder (default: audit)")
    au.add_argument("--device", default="cpu", help="cpu (default) or cuda: which kernels are audited")
    au.add_argument("--decompose", action="store_true",
                    help="instead: where torch's CPU flash kernel leans, step by step: the kernel, its faithful model "
                         "(precision torch-cpu) and the model with one step changed at a time, with the model's bit "
                         "agreement with the kernel (OUT/torch-cpu-decomposition.md; 7 s quick, on one core)")
    au.add_argument("--seed", type=int, default=0)
    au.add_argument("--triton-interpreter", action="store_true",
                    help="on CPU, also audit flashguard's Triton kernels (fa2, fa2-fp16) in Triton's CPU interpreter "
                         "(their rounding steps, not a GPU's matmul order; the full audit took 170 s with them on one core)")
    return au


def _check_device(args) -> None:
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.triton_interpreter and args.device != "cpu":
        raise ValueError("--triton-interpreter is for --device cpu (on cuda the Triton kernels run compiled)")
    if args.device == "cuda" and not __import__("torch").cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")


def run(args) -> int:
    from ..experiments.audit import run_audit, write_audit
    _check_device(args)
    if args.decompose:
        return _decompose(args)
    result = run_audit(quick=args.quick, seed=args.seed, device=args.device,
                       triton_interpreter=args.triton_interpreter, progress=lambda m: print(f"  {m}"))
    paths = write_audit(result, args.out)
    for k, v in result["verdicts"].items():
        print(f"{k}: {v}")
    print(f"tables in {paths['md']}")
    return 0


def _decompose(args) -> int:
    if args.device != "cpu":
        raise ValueError("--decompose measures torch's CPU flash kernel: use --device cpu")
    from ..experiments.kernel_decomposition import decompose_torch_cpu, write_decomposition
    dec = decompose_torch_cpu(quick=args.quick, seed=args.seed, progress=lambda m: print(f"  {m}"))
    print("the step responsible:", "; ".join(dec["responsible"]) or "none found")
    print(f"tables in {write_decomposition(dec, args.out)}")
    return 0
