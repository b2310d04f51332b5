"""`flashguard audit`: does *your* attention kernel lean under tied maxima?

Any attention kernel is measured as a black box with the lab's measurement: the lab's
problems of independent rows (ties planted, tail mass below / above half an ulp, T = 1024
across two tiles), the kernel's O and its delta = rowsum(dO * O) (fp32, from the stored bf16
O, as production backward passes take it) against fp64 on the same inputs, one value per
row, judged paired against the noise floor (the fp32 arithmetic with the kernel's input and
output formats, on the same rows). Built in, where the device has them:

* torch ``scaled_dot_product_attention`` per ``SDPBackend``: on CPU the fused flash kernel and the
  math kernel; on CUDA flash, memory-efficient and cuDNN;
* flashguard's PyTorch path per preset (white boxes: every intermediate visible; the GPU kernels'
  models ``fa2-cuda``, ``torch-flash-cuda``, ``fa3-cuda``, ``mem-efficient``, ``cudnn`` on their
  kernels' tiles, docs/kernels.md), and its
  Triton kernels on CUDA, or on CPU in Triton's interpreter (``triton_interpreter=True``,
  ``flashguard audit --triton-interpreter``: the kernels' own rounding steps, run one program
  at a time in NumPy; not a GPU's matmul order or speed);
* ``flash_attn.flash_attn_func`` when the package imports (CUDA).

    flashguard audit --quick --out audit     # audit.json, audit.md, audit.png
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from ..attention.error_stats import Z_CRIT
from ..attention.trace import Arithmetic
from ..utils.atomic import atomic_write_text
from ..utils.plotting import pyplot, save_png
from ..utils.table import markdown_table
from .lab.measure import Bench, BlackBox
from .lab.problems import Problem

__all__ = ["builtin_kernels", "audit_conditions", "run_audit", "write_audit", "use_triton_interpreter", "kernel_name",
           "GPU_PRESET_TILES", "GPU_PRESET_KERNELS", "gpu_preset_arithmetics", "run_gpu_presets_audit",
           "write_gpu_presets", "compare_gpu_presets", "require_cuda"]

FLASHGUARD_PRESETS = ("paper", "paper-fp32fwd", "fa2", "torch-cpu")


def _sdpa(sdp_backend):
    from torch.nn.attention import sdpa_kernel

    def fn(q, k, v):
        with sdpa_kernel(sdp_backend):
            return F.scaled_dot_product_attention(q, k, v)
    return fn


# the Triton kernels' arithmetics audited (fa2-structured presets, as the kernels implement them)
TRITON_PRESETS = ("fa2", "fa2-fp16")


def _triton_arithmetics() -> list:
    return [Arithmetic.of(p, kernel="triton", block_q=64, block_k=64) for p in TRITON_PRESETS]


def use_triton_interpreter() -> None:
    """Run the Triton kernels in Triton's CPU interpreter. Triton reads TRITON_INTERPRET when it
    is imported, so this must come before anything imports it (the audit command calls it first)."""
    import os
    import sys

    from ..attention import triton_available
    if not triton_available():
        raise ValueError("--triton-interpreter: the triton package is not installed (pip install triton)")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("--triton-interpreter: triton was already imported without TRITON_INTERPRET=1; "
                         "set TRITON_INTERPRET=1 before the first import of triton")
    os.environ["TRITON_INTERPRET"] = "1"


def builtin_kernels(device: str = "cpu", *, triton_interpreter: bool = False) -> list:
    """The kernels this device offers: BlackBox entries and flashguard Arithmetic entries. On CPU,
    ``triton_interpreter`` adds flashguard's Triton kernels run in Triton's interpreter."""
    from torch.nn.attention import SDPBackend
    out: list = []
    if device == "cpu":
        out += [BlackBox("torch sdpa: flash (CPU)", _sdpa(SDPBackend.FLASH_ATTENTION)),
                BlackBox("torch sdpa: math (CPU)", _sdpa(SDPBackend.MATH))]
        if triton_interpreter:
            use_triton_interpreter()
            out += _triton_arithmetics()
    else:
        out += [BlackBox(f"torch sdpa: {name} (CUDA)", _to_cuda(_sdpa(b)))
                for name, b in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                ("cudnn", SDPBackend.CUDNN_ATTENTION))]
        try:
            from flash_attn import flash_attn_func  # noqa: F401
            out.append(BlackBox("flash_attn.flash_attn_func (CUDA)", _to_cuda(_flash_attn)))
        except ImportError:
            pass
        from ..attention import triton_available
        if triton_available():
            out += _triton_arithmetics()
    out += [Arithmetic.of(p) for p in FLASHGUARD_PRESETS]
    out += gpu_preset_arithmetics()  # the GPU kernels' models, each on its kernel's tiles (CPU emulation)
    return out


def _to_cuda(fn):
    def run(q, k, v):
        return fn(q.cuda(), k.cuda(), v.cuda()).cpu()
    return run


def _flash_attn(q, k, v):  # flash_attn takes (B, T, H, D)
    from flash_attn import flash_attn_func
    return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def audit_conditions(quick: bool, seed: int = 0) -> list[Problem]:
    base = Problem(n_rows=1024 if quick else 3072, seed=seed)
    out = [replace(base, ties=k, tail=t) for k in (2, 8) for t in (0.25, 4.0)]
    out += [replace(base, ties=16, t=1024, tail=0.25), replace(base, ties=1, tail=0.25)]
    return out


def kernel_name(kern, device: str) -> str:
    """A kernel's row name: its label, and for a Triton arithmetic on CPU that it ran interpreted."""
    interpreted = getattr(kern, "kernel", None) == "triton" and device == "cpu"
    return kern.label() + (" (Triton CPU interpreter)" if interpreted else "")


def run_audit(kernels=None, *, quick: bool = False, seed: int = 0, device: str = "cpu",
              triton_interpreter: bool = False, progress=None) -> dict:
    """Measure ``kernels`` (default: ``builtin_kernels(device)``). On ``device="cuda"`` (refused
    where torch sees no CUDA device) the result also holds ``gpu_comparison``: each GPU preset's
    emulation against the real kernel it models, bit for bit (``compare_gpu_presets``)."""
    t0 = time.perf_counter()
    say = progress or (lambda m: None)
    if device == "cuda":
        require_cuda("flashguard audit --device cuda")
    kernels = builtin_kernels(device, triton_interpreter=triton_interpreter) if kernels is None else kernels
    bench, rows, verdicts = Bench(), [], {}
    conds = audit_conditions(quick, seed)
    for kern in kernels:
        name = kernel_name(kern, device)
        say(name)
        leaning = []
        for c in conds:
            try:
                m = bench.measure(c, kern)
            except (RuntimeError, NotImplementedError) as e:  # a kernel that refuses these shapes
                rows.append({"kernel": name, "condition": c.label(), "error": f"{type(e).__name__}: {e}"})
                continue
            rows.append({"kernel": name, **m.to_dict()})
            if c.ties > 1 and m.leans:
                leaning.append(c.label())
        tried = [r for r in rows if r["kernel"] == name and "error" not in r and r["problem"]["ties"] > 1]
        if not tried:
            verdicts[name] = "not measured (the kernel refused every problem)"
        else:
            verdicts[name] = (f"leans under ties in {len(leaning)} of {len(tried)} conditions" if leaning
                              else f"no lean beyond the floor in {len(tried)} tie conditions")
    out = {"quick": quick, "seed": seed, "device": device, "versions": {"torch": torch.__version__},
           "runtime_s": time.perf_counter() - t0, "unit": "one value per independent row", "rows": rows,
           "verdicts": verdicts}
    if device == "cuda":
        say("GPU presets against the real kernels")
        out["gpu_comparison"] = compare_gpu_presets(seed=seed)
        out["runtime_s"] = time.perf_counter() - t0
    return out


def _md(result: dict) -> str:
    rows = [r for r in result["rows"] if "error" not in r]
    conds = list(dict.fromkeys(r["condition"] for r in rows))
    kernels = list(dict.fromkeys(r["kernel"] for r in result["rows"]))
    by = {(r["kernel"], r["condition"]): r for r in rows}

    def cell(r, part):
        s = r[part]
        lean = r.get({"o_vs_floor": "o_leans", "delta_vs_floor": "delta_leans"}.get(part, ""))
        mark = "**" if (s["verdict"].startswith("biased") if lean is None else lean) else ""
        return f"{mark}{s['mean'] * 1e6:+.0f}{mark} ({s['z']:+.1f}, r {s['bias_ratio']:+.2f})"

    def table(part):
        return markdown_table(["kernel"] + conds, [[k] + [cell(by[(k, c)], part) if (k, c) in by else "refused"
                                                          for c in conds] for k in kernels])

    floor = {c: by[(kernels[0], c)]["o_floor"] for c in conds if (kernels[0], c) in by}
    md = [f"# Kernel audit ({'quick' if result['quick'] else 'full'}, {result['device']})", "",
          f"torch {result['versions']['torch']}; {result['runtime_s']:.0f} s. Problems: the lab's independent rows",
          "(`flashguard.experiments.lab.problems`). **Unit: one value per independent row.** Cells: the mean row",
          "error beyond the noise floor (the fp32 arithmetic with the kernel's input and output formats, same rows),",
          f"in 1e-6, with its z and bias ratio r; **bold**: a lean (|z| >= {Z_CRIT:.2f}, |r| >= 0.02).", "",
          "## Verdicts", ""]
    md += [f"* {k}: {v}" for k, v in result["verdicts"].items()]
    md += ["", "## O beyond the floor", "", table("o_vs_floor"), "", "## delta = rowsum(dO * O) beyond the floor", "",
           table("delta_vs_floor"), "", "Noise floor's own lean against fp64 (O): "
           + "; ".join(f"{c}: {s['mean'] * 1e6:+.0f} (z {s['z']:+.1f})" for c, s in floor.items()), ""]
    errs = [r for r in result["rows"] if "error" in r]
    if errs:
        md += ["## Refused", ""] + [f"* {r['kernel']} on {r['condition']}: {r['error']}" for r in errs] + [""]
    if result.get("gpu_comparison"):
        md += _comparison_md(result["gpu_comparison"])
    return "\n".join(md)


def write_audit(result: dict, out_dir) -> dict:
    plt = pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "audit.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out / "audit.md", _md(result))
    rows = [r for r in result["rows"] if "error" not in r]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    conds = list(dict.fromkeys(r["condition"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    w = 0.8 / max(len(kernels), 1)
    for i, k in enumerate(kernels):
        zs = [next((r["o_vs_floor"]["z"] for r in rows if r["kernel"] == k and r["condition"] == c), 0.0) for c in conds]
        ax.bar([j + i * w for j in range(len(conds))], zs, width=w, label=k)
    for y in (Z_CRIT, -Z_CRIT):
        ax.axhline(y, color="grey", lw=0.6, ls="--")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(conds))], [c.split(",v=")[0] for c in conds], fontsize=7)
    ax.set_yscale("symlog", linthresh=5)
    ax.set_ylabel("z of O's lean beyond the floor")
    ax.legend(fontsize=7)
    save_png(fig, out / "audit.png")
    return {"json": out / "audit.json", "md": out / "audit.md", "png": out / "audit.png"}


# --------------------------------------------------------------------------- the GPU presets
# (docs/kernels.md: every step of each preset mapped to the source line it models)

# Each GPU preset's tiles (block_q, block_k) for the audit's head dim 64, bf16, non-causal, from the
# kernels' launch code: FA2 flash_fwd_launch_template.h run_mha_fwd_hdim64 (128 x 128); FA3
# hopper/tile_size.h, headdim <= 64 on sm90 (192 x 192); the memory-efficient kernel's 64 x 64 "rf"
# instance for head dim <= 64 (kernels/cutlassF_bf16_aligned.cu); cuDNN's are not documented (flashguard's
# default). The kernels visit key tiles last to first (FA2, FA3), flashguard first to last.
GPU_PRESET_TILES = {"fa2-cuda": (128, 128), "torch-flash-cuda": (128, 128), "fa3-cuda": (192, 192),
                    "mem-efficient": (64, 64), "cudnn": (None, None)}

# the real kernel each preset models: (row label, how it is called on CUDA)
GPU_PRESET_KERNELS = {
    "fa2-cuda": ("flash_attn.flash_attn_func (CUDA)", "flash_attn"),
    "torch-flash-cuda": ("torch sdpa: flash (CUDA)", "sdpa_flash"),
    "fa3-cuda": ("flash_attn_interface.flash_attn_func (FA3, CUDA)", "flash_attn_3"),
    "mem-efficient": ("torch sdpa: efficient (CUDA)", "sdpa_efficient"),
    "cudnn": ("torch sdpa: cudnn (CUDA)", "sdpa_cudnn"),
}


def require_cuda(what: str) -> None:
    """Refuse, naming the missing device, where torch sees no CUDA device."""
    if not torch.cuda.is_available():
        raise ValueError(f"{what}: no CUDA device here (torch {torch.__version__} sees none; "
                         f"torch.cuda.is_available() is False). The comparison of the GPU presets with the real "
                         f"kernels needs an NVIDIA GPU; on CPU run the emulation's audit instead "
                         f"(flashguard.experiments.audit.run_gpu_presets_audit)")


def gpu_preset_arithmetics(d: int = 64) -> list:
    """The GPU presets as audit entries, each on its kernel's tiles (for head dim ``d`` = 64; other
    head dims take flashguard's default tiles)."""
    from ..numerics.policy import GPU_PRESETS
    out = []
    for name in GPU_PRESETS:
        bq, bk = GPU_PRESET_TILES[name] if d == 64 else (None, None)
        out.append(Arithmetic.of(name, block_q=bq, block_k=bk) if bq else Arithmetic.of(name))
    return out


def run_gpu_presets_audit(*, quick: bool = False, seed: int = 0, progress=None) -> dict:
    """The audit's lean measurement of every GPU preset through the CPU emulation, beside ``fa2``
    and ``torch-cpu`` (the model validated on its kernel): O and delta beyond the fp32 noise floor,
    z and bias ratio per condition. Unvalidated on a GPU: see ``compare_gpu_presets``."""
    kernels = [Arithmetic.of("fa2"), Arithmetic.of("torch-cpu")] + gpu_preset_arithmetics()
    result = run_audit(kernels, quick=quick, seed=seed, device="cpu", progress=progress)
    result["what"] = "GPU presets, emulated on CPU (unvalidated on a GPU: no device lent)"
    return result


def write_gpu_presets(result: dict, out_dir, stem: str = "gpu-presets") -> dict:
    """OUT/gpu-presets.json and .md (the audit's tables for the emulated GPU presets)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{stem}.json", json.dumps(result, indent=1) + "\n")
    md = _md(result).replace("# Kernel audit", "# GPU presets, emulated on CPU: kernel audit", 1)
    md = md.replace("## Verdicts", "Every GPU preset here is **unvalidated on a GPU** (no device lent): these are "
                    "the emulation's numbers, each preset on its kernel's tiles (docs/kernels.md).\n\n## Verdicts", 1)
    atomic_write_text(out / f"{stem}.md", md)
    return {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}


# ---- the comparison with the real kernels (CUDA only)

def _real_kernel(kind: str):
    """fn(q, k, v, causal, scale) -> (o, lse or None) on CUDA tensors (B, H, T, D), or raises."""
    aten = torch.ops.aten
    if kind == "sdpa_flash":
        def fn(q, k, v, causal, scale):
            out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
            return out[0], out[1]
    elif kind == "sdpa_efficient":
        def fn(q, k, v, causal, scale):
            out = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
            return out[0], out[1][..., :q.shape[-2]]  # lse padded to a multiple of 32 rows
    elif kind == "sdpa_cudnn":
        def fn(q, k, v, causal, scale):
            out = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
            return out[0], out[1]
    elif kind == "flash_attn":
        from flash_attn import flash_attn_func

        def fn(q, k, v, causal, scale):
            o, lse, _ = flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), softmax_scale=scale, causal=causal,
                                        return_attn_probs=True)
            return o.transpose(1, 2), lse
    elif kind == "flash_attn_3":
        from flash_attn_interface import flash_attn_func as fa3

        def fn(q, k, v, causal, scale):
            out = fa3(*(x.transpose(1, 2) for x in (q, k, v)), softmax_scale=scale, causal=causal)
            o, lse = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
            return o.transpose(1, 2), lse
    else:
        raise ValueError(f"unknown kernel kind {kind!r}")
    return fn


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """Floats as integers in value order (so that adjacent floats differ by 1): bf16 or fp32."""
    idt = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[x.dtype]
    i = x.contiguous().view(idt).to(torch.int64)
    top = 1 << (8 * x.element_size() - 1)
    return torch.where(i < 0, -top - i, i)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of a's dtype (0 = bit-identical; NaNs compare
    as the largest distance)."""
    b = b.to(a.dtype)
    d = (_ordered(a) - _ordered(b)).abs()
    nan = torch.isnan(a) | torch.isnan(b)
    return torch.where(nan & ~(torch.isnan(a) & torch.isnan(b)), torch.iinfo(torch.int64).max, d)


def _agreement(model: torch.Tensor, real: torch.Tensor) -> dict:
    d = ulp_distance(real, model)
    return {"bit_exact": float((d == 0).double().mean()), "max_ulp": int(d.max()), "n": int(d.numel())}


def comparison_inputs(seed: int = 0) -> list:
    """(label, q, k, v, causal) bf16 CPU tensors, head dim 64: random inputs, causal and not, T not
    a multiple of any tile, and one of the audit's tie problems."""
    from .lab.problems import make_problem
    g = torch.Generator().manual_seed(seed)
    out = []
    for t, causal in ((1024, False), (1024, True), (777, False)):
        q, k, v = (torch.randn(2, 4, t, 64, generator=g).bfloat16() for _ in range(3))
        out.append((f"random B2 H4 T{t}{' causal' if causal else ''}", q, k, v, causal))
    p = audit_conditions(True, seed)[0]
    q, k, v, _ = make_problem(replace(p, n_rows=256))
    out.append((f"ties: {p.label()}", q.bfloat16(), k.bfloat16(), v.bfloat16(), False))
    return out


def _emulated(name: str, q, k, v, causal: bool, scale: float):
    from ..attention.options import run_forward
    arith = next(a for a in gpu_preset_arithmetics(q.shape[-1]) if a.precision.name == name)
    fwd = run_forward(q, k, v, arith.options, causal=causal, scale=scale)
    return fwd.o, fwd.lse.squeeze(-1)


def compare_gpu_presets(*, seed: int = 0, presets=None) -> list:
    """Each GPU preset's emulation (on CPU) against the real kernel it models (on CUDA), on
    ``comparison_inputs``: the fraction of bit-identical elements of O (bf16) and of lse (fp32) and
    the largest ulp distance of each. A kernel that is not importable or refuses the call is
    reported with its error. Needs a CUDA device (``require_cuda``)."""
    require_cuda("compare_gpu_presets")
    from ..numerics.policy import GPU_PRESETS
    rows = []
    cases = comparison_inputs(seed)
    for name in presets or GPU_PRESETS:
        label, kind = GPU_PRESET_KERNELS[name]
        try:
            fn = _real_kernel(kind)
        except ImportError as e:
            rows.append({"preset": name, "kernel": label, "error": f"not importable: {e}"})
            continue
        for case, q, k, v, causal in cases:
            scale = 1.0 / q.shape[-1] ** 0.5
            try:
                o_r, lse_r = fn(q.cuda(), k.cuda(), v.cuda(), causal, scale)
            except (RuntimeError, NotImplementedError, TypeError) as e:
                rows.append({"preset": name, "kernel": label, "case": case, "error": f"{type(e).__name__}: {e}"})
                continue
            o_m, lse_m = _emulated(name, q, k, v, causal, scale)
            row = {"preset": name, "kernel": label, "case": case, "o": _agreement(o_m, o_r.cpu())}
            if lse_r is not None:
                row["lse"] = _agreement(lse_m.float(), lse_r.float().cpu().reshape(lse_m.shape))
            rows.append(row)
    return rows


def _comparison_md(rows: list) -> list:
    md = ["## GPU presets against the real kernels", "",
          "Each preset's emulation (CPU) against the kernel it models (CUDA), same bf16 inputs: the share of",
          "bit-identical elements and the largest distance in ulps (O in bf16, lse in fp32).", ""]
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["preset"], r["kernel"], r.get("case", "all"), r["error"], None, None, None])
            continue
        lse = r.get("lse")
        cells.append([r["preset"], r["kernel"], r["case"], f"{r['o']['bit_exact']:.4f}", r["o"]["max_ulp"]]
                     + ([f"{lse['bit_exact']:.4f}", lse["max_ulp"]] if lse else ["n/a", "n/a"]))
    header = ["preset", "kernel", "case", "O bit-exact", "O max ulp", "lse bit-exact", "lse max ulp"]
    return md + [markdown_table(header, cells), ""]


if __name__ == "__main__":  # python -m flashguard.experiments.audit OUT [--quick]: the GPU presets' CPU audit
    import sys
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    res = run_gpu_presets_audit(quick="--quick" in sys.argv, progress=lambda m: print(f"  {m}", flush=True))
    for kname, verdict in res["verdicts"].items():
        print(f"{kname}: {verdict}")
    print(f"tables in {write_gpu_presets(res, args[0] if args else 'audit')['md']}")
