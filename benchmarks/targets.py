"""The speed targets against what the benchmarks measured: benchmarks/results/README.md, and the
README's performance lines (between its ``<!-- perf -->`` markers), regenerated from the JSON the
benchmarks wrote. Nothing is timed here.

    python benchmarks/targets.py            # writes results/README.md and updates README.md
    python benchmarks/targets.py --check    # exit 1 if either file is out of date

Reads (one thread): attention-cpu-1thread.json (benchmarks/attention.py --reference ...),
time-split-1thread.json (time_split.py), train-cpu-1thread.json (train.py), natural-arm-1thread.json
(natural_arm.py) and natural-arm-1000-1thread.json (natural_arm.py --steps 1000: a whole arm timed,
which checks the extrapolation), diagnostics-cpu-1thread.json (diagnostics.py),
scaling-cpu-1thread.json (scaling.py), and the C kernels' before
and after: time-split-torch-cpu-1thread.json (time_split.py --tag torch-cpu, with torch-cpu~fallback
beside torch-cpu), bf16-gemm-1thread.json (bf16_gemm.py, on a CPU without AVX-512) and
allocator-1thread.json (allocator.py: freed memory kept, against glibc's defaults); the fused
softmax passes' before and after come from the attention JSON (attention.py --fallback: NAME~fallback
beside NAME). A missing file leaves
its targets "not measured". A target a CPU cannot meet is shown with its measured limit: the
GEMM time alone (time_split.py), which no rearrangement of the elementwise work goes below.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flashguard.utils.atomic import atomic_write_text
from flashguard.utils.table import markdown_table

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE.parent / "README.md"
START, END = "<!-- perf -->", "<!-- /perf -->"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _verdict(value: float | None, limit: float, at_most: bool) -> str:
    if value is None:
        return "not measured"
    return "met" if (value <= limit if at_most else value >= limit) else "not met"


def _split(split: dict | None, table: str) -> dict:
    return split[table] if split and table in split else {}


def attention_rows(att: dict | None, split: dict | None) -> list[list[str]]:
    med = att["results"]["1024"]["median_s"] if att else {}
    sp = _split(split, "attention")

    def ratio(a, b):
        return med[a] / med[b] if a in med and b in med else None

    def floor_vs_sdpa(name):  # the preset's GEMMs alone against SDPA's whole call
        if name not in sp or "sdpa" not in sp:
            return "-"
        return f"GEMMs alone {sp[name]['ms']['gemm'] / sp['sdpa']['wall_ms']:.2f}x"

    def floor_vs(name, base):  # base's call with its GEMMs replaced by the preset's
        if name not in sp or base not in sp:
            return "-"
        b = sp[base]
        return f"{(b['wall_ms'] - b['ms']['gemm'] + sp[name]['ms']['gemm']) / b['wall_ms']:.2f}x ({base} with {name}'s GEMMs)"

    def ref_limit():  # paper must run the reference code's own bf16 products (its bits are theirs)
        if "paper" not in sp or "reference-code" not in sp:
            return "-"
        return f"{sp['reference-code']['wall_ms'] / sp['paper']['ms']['gemm']:.2f}x (the reference code's call " \
               "against paper's GEMMs alone, which are its own)"

    fa2, fwd, ref = ratio("fa2/none", "sdpa"), ratio("paper-fp32fwd/none", "paper/none"), \
        ratio("reference-code", "paper/none")
    return [
        ["fa2 forward+backward <= 1.5x torch SDPA (T 1024)", _fmt(fa2, "x"), _verdict(fa2, 1.5, True),
         floor_vs_sdpa("fa2")],
        ["paper-fp32fwd <= 1.1x paper", _fmt(fwd, "x"), _verdict(fwd, 1.1, True), floor_vs("paper-fp32fwd", "paper")],
        ["paper >= 2x faster than the study's reference code", _fmt(ref, "x"), _verdict(ref, 2.0, False),
         ref_limit()],
    ]


def natural_row(nat: dict | None, full: dict | None = None) -> list[list[str]]:
    """The natural arm's target (benchmarks/natural_arm.py): minutes of a 1,000-step arm per arm,
    extrapolated from short runs, and where a whole 1,000-step run was timed (``full``), its wall time."""
    what = "natural arm (nat512: 1,000 steps, probes every 50) <= 20 min on one core"
    if not nat:
        return [[what, "-", "not measured", "-"]]
    res = nat["results"]
    arms = {n: r["minutes_per_1000"] for n, r in res.items() if not n.endswith("~fallback")}
    before = {n: res[n + "~fallback"]["minutes_per_1000"] for n in arms if n + "~fallback" in res}
    whole = _whole_runs(full)
    met = [n for n, m in arms.items() if m <= 20 and whole.get(n, m) <= 20]
    verdict = "met" if len(met) == len(arms) else (f"met by {', '.join(met)}" if met else "not met")
    text = ", ".join(f"{n} {m:.1f} min" + (f" ({before[n]:.1f} without the C kernels and kept memory)"
                                            if n in before else "") for n, m in arms.items())
    if whole:
        text += "; a whole 1,000-step run: " + ", ".join(f"{n} {m:.1f} min" for n, m in whole.items())
    missed = [n for n in arms if n not in met]
    # no arm-specific limit is measured: a missed arm's floor is its kernel's (the rows above)
    limit = "; ".join(f"{n}: its kernel's, as the {n} rows above" for n in missed) or "-"
    return [[what, text, verdict, limit]]


def _whole_runs(full: dict | None) -> dict:
    """Minutes of each arm timed whole (natural_arm.py --steps 1000), by arm."""
    return {n: r["wall_s"] / 60 for n, r in (full or {}).get("results", {}).items()
            if r.get("steps") == 1000 and not n.endswith("~fallback")}


def other_rows(train: dict | None, diag: dict | None, scaling: dict | None, split: dict | None) -> list[list[str]]:
    fa2 = train["x_sdpa"].get("flash+fa2") if train else None
    probe = diag["probe_in_plain_steps"] if diag else None
    slope = scaling["grid"].get("memory_slope") if scaling else None
    sp = _split(split, "train")
    step_floor = "-"
    if "flash+fa2" in sp and "sdpa" in sp:  # SDPA's step with its kernel swapped for fa2's attention GEMMs
        s, f = sp["sdpa"], sp["flash+fa2"]
        attn_gemm = f["ms"]["gemm"] - s["ms"]["gemm"]  # the model's own GEMMs are the same in both
        step_floor = f"{s['wall_ms'] / (s['wall_ms'] - s['ms']['sdpa kernel'] + attn_gemm):.2f}x (SDPA's step " \
                     "with its kernel replaced by fa2's GEMMs alone)"
    return [
        ["tiny-cpu training, flash + fa2 >= 0.9x SDPA tokens/s", _fmt(fa2, "x"), _verdict(fa2, 0.9, False),
         step_floor],
        ["a probe step <= 2 plain steps", _fmt(probe, " steps"), _verdict(probe, 2.0, True),
         _probe_floor(diag)],
        ["attention memory O(T) (log-log slope of peak memory, T >= 1024)",
         "-" if slope is None else f"flash presets {slope['flash_min']:.2f}-{slope['flash_max']:.2f} "
                                   f"(sdpa {slope['sdpa']:.2f}, math {slope['math']:.2f})",
         "not measured" if slope is None else ("met" if slope["o_t"] else "not met"), "-"],
    ]


def _probe_floor(diag: dict | None) -> str:
    if not diag or "reference_in_plain_steps" not in diag:
        return "-"
    ref = f"the fp64 reference's forward and dQ alone {diag['reference_in_plain_steps']:.2f} steps"
    if "trace_in_plain_steps" not in diag:
        return ref
    return (f"{diag['trace_in_plain_steps']:.2f} steps (the measurement alone: {ref}, then the layer's "
            f"arithmetic forward counting ties and its dQ)")


def _fmt(x, unit: str) -> str:
    return "-" if x is None else f"{x:.2f}{unit}"


def before_after(split: dict | None, name: str = "torch-cpu", base: str = "sdpa") -> list[str]:
    """The C kernels' before/after section from one time_split.py run of the attention table
    (tag ``torch-cpu``) holding ``NAME~fallback`` (FLASHGUARD_NATIVE=0) and ``NAME``: each
    config's wall ms, its ratio to SDPA in that run, and the speed-up."""
    rows_in = _split(split, "attention")
    before, after = rows_in.get(name + "~fallback"), rows_in.get(name)
    if not before or not after or base not in rows_in:
        return []
    b = rows_in[base]["wall_ms"]
    rows = [[n, f"{r['wall_ms']:.0f} ms", f"{r['wall_ms'] / b:.2f}x"] for n, r in rows_in.items()]
    return ["## Before and after: the C kernels (numerics/native.py)", "",
            f"Attention forward+backward, B 2, H 12, T {split['t']}, D 64, bf16, causal, one thread, one run "
            f"(time_split.py: the mean of three profiled calls per config; `{name}~fallback` ran with "
            f"FLASHGUARD_NATIVE=0, the PyTorch fallback; the C kernels: {split['machine']['native']}). "
            f"`{name}`: **{before['wall_ms'] / after['wall_ms']:.1f}x faster** with them: its exponential "
            "(fexp_u20) in C; the GPU presets' exp2 steps use fma32, and the bf16 and fp32 arithmetics the "
            "fused softmax passes (above; `torch-cpu`'s own exponential keeps it out of them); outputs "
            "bit-identical (tests/numerics/test_native.py, tests/train/test_loss_hash.py).", "",
            markdown_table(["config", "wall ms", "x SDPA"], rows), ""]


def _fallback_pairs(med: dict) -> list[str]:
    """The configs timed both as NAME and as NAME~fallback (attention.py --fallback)."""
    return [n for n in med if n + "~fallback" in med]


def fused_section(att: dict | None, split: dict | None) -> list[str]:
    """The C kernels' before/after for the emulated arithmetics (numerics/fused_softmax.py above
    all) from attention.py --fallback: ``NAME~fallback`` (FLASHGUARD_NATIVE=0: torch's ops)
    interleaved with ``NAME`` in one run; the GEMM time beside them from time_split.py."""
    med = att["results"]["1024"]["median_s"] if att else {}
    pairs = _fallback_pairs(med)
    if not pairs or "sdpa" not in med:
        return []
    sp, b = _split(split, "attention"), med["sdpa"]
    rows = []
    for n in pairs:
        gemm = sp.get(n.split("/")[0], {}).get("ms", {}).get("gemm")
        rows.append([n.split("/")[0], f"{1e3 * med[n + '~fallback']:.0f} ms ({med[n + '~fallback'] / b:.2f}x)",
                     f"{1e3 * med[n]:.0f} ms ({med[n] / b:.2f}x)", f"{med[n + '~fallback'] / med[n]:.2f}x",
                     "-" if gemm is None else f"{gemm:.0f} ms"])
    m = att["machine"]
    return ["## Before and after: the fused softmax passes (numerics/fused_softmax.py)", "",
            f"Attention forward+backward, B 2, H 12, T 1024, D 64, bf16, causal, one thread, on {m['cpu']} "
            f"({m['capability']}): `python benchmarks/attention.py --fallback` (medians of interleaved runs, "
            f"torch SDPA {1e3 * b:.0f} ms in the same run; before: FLASHGUARD_NATIVE=0, each softmax step a "
            "torch op). The bits are the same (tests/numerics/test_fused_softmax.py, "
            "tests/attention/test_paper_golden.py, tests/train/test_loss_hash.py). The GEMMs (time_split.py, "
            "profiled) are what is left that the arithmetic fixes.", "",
            markdown_table(["preset", "before (x SDPA)", "after (x SDPA)", "speed-up", "its GEMMs"], rows), ""]


def bf16_section(data: dict | None) -> list[str]:
    """The C bf16 products' section (benchmarks/bf16_gemm.py), measured where they run: each
    product and call with torch's own products and with the C ones, in one run."""
    if not data:
        return []
    m = data["machine"]
    prod = [[name, f"{1e3 * r['torch']:.1f} ms", f"{1e3 * r['C']:.1f} ms", f"{r['torch'] / r['C']:.1f}x",
             f"{1e3 * r['fp32']:.1f} ms"] for name, r in data["products"].items()]
    slow = [r["torch"] / r["fp32"] for r in data["products"].values()]
    calls = data["calls"]
    pairs = []
    for name, t in calls.items():
        if name.endswith(", torch's products"):
            base = name[: -len(", torch's products")]
            c = calls.get(base + ", C products")
            if c:
                pairs.append([base, f"{1e3 * t:,.0f} ms", f"{1e3 * c:,.0f} ms", f"{t / c:.1f}x"])
    ref = calls.get("the study's reference code")
    paper = calls.get("paper attention, C products")
    ref_line = (f" The study's reference code (torch's products) took {1e3 * ref:,.0f} ms in the same run: "
                f"`paper` is **{ref / paper:.1f}x** faster than it here.") if ref and paper else ""
    return ["## torch's bf16 products in C, on a CPU without AVX-512 (numerics/bf16_gemm.py)", "",
            f"Measured on {m['cpu']} ({m['capability']}, {m['cores']} cores), one thread, by "
            "`python benchmarks/bf16_gemm.py` (medians of interleaved runs, the C path on and off in one "
            "process). There oneDNN has no bf16 kernel and torch multiplies bf16 matrices in ATen's portable "
            f"gemm, one output at a time: {min(slow):.0f}-{max(slow):.0f}x slower than an fp32 product of the "
            "same operands here. The C "
            "kernels sum in torch's own orders (ilp4, seq, dot8 by layout), verified against torch at "
            "first use, so outputs and training are bit for bit the same (tests/numerics/test_bf16_gemm.py, "
            "tests/train/test_loss_hash.py); on CPUs with oneDNN's bf16 kernels they are off.", "",
            markdown_table(["product (bf16)", "torch", "C", "speed-up", "fp32 product"], prod), "",
            markdown_table(["call", "torch's products", "C products", "speed-up"], pairs), "",
            *([ref_line.strip(), ""] if ref_line else [])]


def allocator_section(data: dict | None) -> list[str]:
    """Freed memory kept for reuse (utils/allocator.py) against the C library's own thresholds,
    from one run of benchmarks/allocator.py (each side in its own child processes)."""
    if not data:
        return []
    m, res = data["machine"], data["results"]
    rows = []
    for name, r in res.items():
        if name.startswith("process"):
            continue
        d, k = r["default"], r["kept"]
        rows.append([name, f"{1e3 * d['median_s']:.0f} ms", f"{d['faults']:,.0f}", f"{1e3 * k['median_s']:.0f} ms",
                     f"{k['faults']:,.0f}", f"{r['kept_over_default']:.2f}x"])
    rss = res.get("process: peak resident MiB")
    rss_line = (f" Peak resident memory of a child process: {rss['default']:,.0f} MiB by default, "
                f"{rss['kept']:,.0f} MiB with memory kept (kept memory is reused; the heap's fragmentation "
                "can raise the peak).") if rss else ""
    return ["## Before and after: freed memory kept for reuse (utils/allocator.py)", "",
            f"Measured on {m['cpu']} ({m['capability']}, {m['cores']} cores), one thread, by "
            f"`python benchmarks/allocator.py` ({data['rounds']} rounds; each side in its own child "
            "process, alternating which starts; medians of the rounds' medians). Default: glibc's own "
            "thresholds, which map large tensors fresh and unmap them on free, so that each comes back "
            "as zeroed pages (`FLASHGUARD_RETAIN_MEMORY=0`). Kept: `retain_freed_memory()`, which "
            "flashguard's command line and these benchmarks call. Page faults are minor faults per call. "
            "The arithmetic is the same on either side (tests/utils/test_allocator.py: loss and "
            "parameter hashes alike)." + rss_line, "",
            markdown_table(["workload", "default", "faults", "kept", "faults", "kept / default"], rows), ""]


def results_markdown(rows: list[list[str]], sources: dict, sections: list[str] = ()) -> str:
    have = ", ".join(n for n, d in sources.items() if d is not None) or "none"
    return "\n".join([
        "# Speed targets on CPU (one thread)", "", f"Machine: {machines(sources)}.", "",
        "Regenerated by `python benchmarks/targets.py` from the JSON beside this file (" + have + "). "
        "Ratios are measured inside one run (interleaved, medians), so that a shared machine's load "
        "hits both sides alike. The limit column is what the matrix products alone would allow "
        "(time_split.py's GEMM time; a limit above the target means no rearrangement of the "
        "elementwise work can meet it without changing the products' arithmetic: on CPU, fp32 "
        "products of bf16 operands run as fp32 GEMMs on upcast copies, since torch's CPU bmm has "
        "no bf16-in / fp32-out form).", "",
        markdown_table(["target", "measured", "verdict", "limit"], rows), "", *sections])


def machines(sources: dict) -> str:
    """The machine(s) the sources were measured on (benchmarks/machine.py), by source."""
    seen: dict[str, list[str]] = {}
    for name, d in sources.items():
        if d is None:
            continue
        m = d.get("machine")
        what = f"{m['cpu']} ({m['capability']}, {m['cores']} cores)" if m else "not recorded"
        seen.setdefault(what, []).append(name)
    if len(seen) == 1:
        return next(iter(seen))
    return "; ".join(f"{what}: {', '.join(names)}" for what, names in seen.items())


def readme_lines(sources: dict) -> str:
    att, train, diag = sources["attention"], sources["train"], sources["diagnostics"]
    out = [f"- Machine: {machines(sources)}."]
    if att:
        med = att["results"]["1024"]["median_s"]
        out.append(f"- Attention forward+backward, B 2 x H 12 x T 1024 x D 64, one thread: torch SDPA "
                   f"{1e3 * med['sdpa']:.0f} ms, `paper` {1e3 * med['paper/none']:.0f} ms, `fa2` "
                   f"{1e3 * med['fa2/none']:.0f} ms.")
    if train:
        t = train["median_tokens_per_s"]
        out.append("- tiny-cpu training, one thread: " + ", ".join(f"{k} {v:,.0f}" for k, v in t.items()) +
                   " tokens/s.")
    tc = _split(sources.get("torch-cpu split"), "attention")
    if {"sdpa", "torch-cpu", "torch-cpu~fallback"} <= tc.keys():
        out.append(f"- `torch-cpu` (the model of torch's CPU kernel) forward+backward at that size: "
                   f"{tc['torch-cpu']['wall_ms'] / tc['sdpa']['wall_ms']:.1f}x SDPA with the C kernels, "
                   f"{tc['torch-cpu~fallback']['wall_ms'] / tc['sdpa']['wall_ms']:.1f}x in their PyTorch fallback.")
    nat = sources.get("natural arm")
    if nat:
        res = nat["results"]
        whole = _whole_runs(sources.get("natural arm (1,000 steps)"))
        out.append("- A natural-preconditions arm (nat512's set-up: tiny-cpu at T 512, 1,000 steps, probes every 50) "
                   "on one core: " + ", ".join(f"{n} {r['minutes_per_1000']:.1f} min" for n, r in res.items()
                                               if not n.endswith("~fallback")) +
                   (" (from 100 steps each; a whole run of 1,000: " +
                    ", ".join(f"{n} {m:.1f} min" for n, m in whole.items()) + ")" if whole else "") + ".")
    if diag:
        out.append(f"- A probe of every layer costs {diag['probe_in_plain_steps']:.1f} plain steps "
                   f"({100 * diag['implied_overhead']['50']:.0f} % at `diagnostics_every=50`).")
    med = att["results"]["1024"]["median_s"] if att else {}
    done = _fallback_pairs(med)
    if done:
        out.append("- The fused softmax passes (C, the same bits), forward+backward at that size: " + ", ".join(
            f"`{n.split('/')[0]}` {1e3 * med[n + '~fallback']:.0f} -> {1e3 * med[n]:.0f} ms" for n in done) + ".")
    al = sources.get("allocator")
    if al:
        r = al["results"]
        parts = [f"{name.split(': ', 1)[1]} {r[name]['kept_over_default']:.2f}x"
                 for name in ("attention: paper/none", "attention: fa2/none", "attention: reference-code",
                              "train: flash+fa2") if name in r]
        out.append("- Freed memory kept for reuse (flashguard's command line; `FLASHGUARD_RETAIN_MEMORY=0` "
                   "turns it off) against glibc's defaults, time kept / default: " + ", ".join(parts) +
                   " (attention at T 1024, the tiny-cpu step).")
    bf = sources.get("bf16 products")
    if bf:
        c = bf["calls"]
        step = [k[: -len(", C products")] for k in c if k.startswith("tiny-cpu step") and k.endswith(", C products")]
        if step:
            parts = [f"{name[len('tiny-cpu step, '):]} {c[name + ', torch' + chr(39) + 's products']:.1f} s -> "
                     f"{c[name + ', C products']:.1f} s" for name in step]
            out.append(f"- On a CPU without AVX-512 ({bf['machine']['cpu']}, {bf['machine']['capability']}) torch's "
                       "bf16 products are ATen's scalar gemm; flashguard runs them in C, bit for bit: a tiny-cpu "
                       "training step " + ", ".join(parts) + ".")
    out.append("- Targets, limits and scaling with T and D: [benchmarks/results/](benchmarks/results/README.md).")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if results/README.md or README.md is stale")
    args = ap.parse_args()
    sources = {"attention": _load("attention-cpu-1thread.json"), "time split": _load("time-split-1thread.json"),
               "train": _load("train-cpu-1thread.json"), "diagnostics": _load("diagnostics-cpu-1thread.json"),
               "scaling": _load("scaling-cpu-1thread.json"),
               "torch-cpu split": _load("time-split-torch-cpu-1thread.json"),
               "natural arm": _load("natural-arm-1thread.json"),
               "natural arm (1,000 steps)": _load("natural-arm-1000-1thread.json"),
               "bf16 products": _load("bf16-gemm-1thread.json"), "allocator": _load("allocator-1thread.json")}
    rows = attention_rows(sources["attention"], sources["time split"]) + \
        other_rows(sources["train"], sources["diagnostics"], sources["scaling"], sources["time split"]) + \
        natural_row(sources["natural arm"], sources["natural arm (1,000 steps)"])
    own_section = ("bf16 products", "allocator")   # each names its machine itself
    results = results_markdown(rows, {k: v for k, v in sources.items() if k not in own_section},
                               fused_section(sources["attention"], sources["time split"])
                               + before_after(sources["torch-cpu split"])
                               + allocator_section(sources["allocator"]) + bf16_section(sources["bf16 products"]))
    readme = README.read_text()
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} block for the performance lines")
    head, rest = readme.split(START, 1)
    new_readme = head + START + "\n" + readme_lines(sources) + "\n" + END + rest.split(END, 1)[1]
    target = RESULTS / "README.md"
    stale = [p for p, text in ((target, results), (README, new_readme))
             if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"stale: {p.relative_to(HERE.parent)} (run python benchmarks/targets.py)")
        return 1 if stale else 0
    atomic_write_text(target, results)
    atomic_write_text(README, new_readme)
    print(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
