"""How forward+backward time and peak memory of flashguard's emulated flash attention grow with
the sequence length T and the head dim D, for every precision preset that runs on a CPU, against
torch SDPA: what a T = 4096 run costs on a CPU.

    python benchmarks/scaling.py                        # the default grid (about 10 minutes at one thread)
    python benchmarks/scaling.py --quick                # T <= 2048; fp32, paper, paper-fp32fwd, fa2, sdpa
    python benchmarks/scaling.py --presets fa2,paper,math --repeats 5
    python benchmarks/scaling.py --no-memory --math-max-t 2048 --t-sizes 1024,4096,16384

Grid: T = 256, 512, ..., 8192 at D = 64 (the T sweep) and D = 32, 64, 128 at T = 1024 (the D
sweep); shape (B=1, H=4, T, D) (--batch, --heads), bf16 inputs, causal, forward+backward.
Configurations: every preset of flashguard's registry (numerics.policy.POLICIES), stabilizer none,
except the models of GPU kernels (GPU_PRESETS) and any preset that fails once at a tiny size on
this CPU (recorded as "not on CPU"); and two baselines, "sdpa" (torch's
scaled_dot_product_attention: the fused CPU flash kernel) and "math" (flashguard's
reference_attention in bf16: softmax(QK^T)V with the T x T matrix materialised; above
--math-max-t it is skipped and recorded as skipped).

Time: at each size every configuration runs once as warm-up, then --repeats times interleaved
round-robin in this one process (so that drift of a shared machine hits all alike); the median
is reported with its ratio to SDPA measured in the same run. Memory: the growth of the peak
resident set over one forward+backward in a fresh subprocess per (configuration, size), inputs
excluded, after one warm-up forward+backward at T = 64 (whose first-call paging of code and
buffers, tens of MiB, would otherwise swamp small shapes) (benchmarks/attention.py's sampler;
--no-memory skips it). The log-log slope of peak
memory against T over T >= 1024 says whether attention memory is O(T) (slope about 1 or less)
or O(T^2) (math: about 2).

These are ratios within one run on one machine, not timed tests: nothing passes or fails.
Writes benchmarks/results/scaling-cpu-<threads>thread.json, .md and .png (--out-dir), each
atomically; the figure only where matplotlib imports.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from flashguard.numerics.policy import GPU_PRESETS, POLICIES
from flashguard.utils.atomic import atomic_write_json, atomic_write_text
from flashguard.utils.table import markdown_table
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/machine.py, however this file is loaded
from machine import machine  # noqa: E402

HERE = Path(__file__).resolve().parent
T_SIZES = (256, 512, 1024, 2048, 4096, 8192)
D_SIZES = (32, 64, 128)
QUICK_T_MAX = 2048
QUICK_CONFIGS = ("sdpa", "fp32", "paper", "paper-fp32fwd", "fa2")
BASELINES = ("sdpa", "math")
SLOPE_MIN_T = 1024
O_T_SLOPE = 1.25  # a log-log memory slope at or below this reads as O(T) (T^2 is 2)


def _load_attention_bench():
    """benchmarks/attention.py as a module, under a name of its own (so that it shadows no
    ``attention`` package): its inputs, fwd_bwd, make_fn and measure_memory are reused."""
    spec = importlib.util.spec_from_file_location("flashguard_bench_attention", HERE / "attention.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_attention_bench()


def fn_name(config: str) -> str:
    """attention.py's name for a configuration: the baselines as they are, a preset with stabilizer none."""
    return config if config in BASELINES else f"{config}/none"


def cpu_presets() -> tuple[list[str], dict[str, str]]:
    """The registry's presets that run here (tried once at a tiny size), and the others with why not."""
    ok, skipped = [], {}
    q = torch.randn(1, 1, 32, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    for name in POLICIES:
        if name in GPU_PRESETS:
            skipped[name] = "GPU kernel model (numerics.policy.GPU_PRESETS)"
            continue
        try:
            bench.fwd_bwd(bench.make_fn(fn_name(name), None), q, q, q, q)
            ok.append(name)
        except Exception as e:  # noqa: BLE001 - any failure means: not on this CPU
            skipped[name] = f"not on CPU: {type(e).__name__}: {e}"
    return ok, skipped


def select_configs(available: list[str], skipped: dict[str, str], only: list[str] | None = None,
                   quick: bool = False) -> list[str]:
    """sdpa, math and the CPU presets, in registry order; --presets keeps the named ones (else
    --quick keeps QUICK_CONFIGS). sdpa is always kept: every ratio is against it."""
    configs = list(BASELINES) + available
    if only:
        for name in only:
            if name in skipped:
                raise SystemExit(f"--presets: {name!r} is skipped here ({skipped[name]})")
            if name not in configs:
                raise SystemExit(f"--presets: unknown {name!r}; choose from {', '.join(configs)}")
        configs = [c for c in configs if c in only or c == "sdpa"]
    elif quick:
        configs = [c for c in configs if c in QUICK_CONFIGS]
    return configs


def time_configs(configs: list[str], t: int, d: int, b: int, h: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of each forward+backward: one warm-up call each, then ``repeats`` round-robin rounds."""
    q, k, v, do = bench.inputs(t, b, h, d)
    fns = {c: bench.make_fn(fn_name(c), None) for c in configs}
    for c in configs:
        bench.fwd_bwd(fns[c], q, k, v, do)
    times = {c: [] for c in configs}
    for _ in range(repeats):
        for c in configs:
            t0 = time.perf_counter()
            bench.fwd_bwd(fns[c], q, k, v, do)
            times[c].append(time.perf_counter() - t0)
    return times


def run_point(configs: list[str], t: int, d: int, opts) -> dict:
    """Time (and, with opts.memory, peak memory) of every configuration at one (T, D)."""
    skipped = {}
    if "math" in configs and t > opts.math_max_t:
        skipped["math"] = f"skipped: T = {t} > --math-max-t {opts.math_max_t} (T x T materialised)"
    run = [c for c in configs if c not in skipped]
    t0 = time.perf_counter()
    times = time_configs(run, t, d, opts.batch, opts.heads, opts.repeats)
    med = {c: statistics.median(ts) for c, ts in times.items()}
    point = {"T": t, "D": d, "median_s": med, "x_sdpa": {c: med[c] / med["sdpa"] for c in run},
             "times_s": times, "skipped": skipped, "time_wall_s": time.perf_counter() - t0}
    if opts.memory:
        t0 = time.perf_counter()
        shape = (opts.batch, opts.heads, d)
        point["peak_mib"] = {c: bench.measure_memory(fn_name(c), t, None, shape, warmup=True) for c in run}
        point["memory_wall_s"] = time.perf_counter() - t0
    return point


def loglog_slope(xs, ys) -> float | None:
    """Least-squares slope of log y against log x over the points with y > 0 (None under two)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def memory_slopes(points: list[dict], configs: list[str], min_t: int = SLOPE_MIN_T) -> dict:
    """Each configuration's log-log slope of peak memory against T over T >= min_t, and the
    verdict: do the flash presets' slopes all stay at or below O_T_SLOPE (O(T))?"""
    slopes = {}
    for c in configs:
        pts = [(p["T"], p["peak_mib"][c]) for p in points if p["T"] >= min_t and c in p.get("peak_mib", {})]
        slopes[c] = loglog_slope([x for x, _ in pts], [y for _, y in pts])
    flash = [s for c, s in slopes.items() if c not in BASELINES and s is not None]
    return {"min_t": min_t, "per_config": slopes,
            "flash_min": min(flash) if flash else None, "flash_max": max(flash) if flash else None,
            "flash_median": statistics.median(flash) if flash else None,
            "math": slopes.get("math"), "sdpa": slopes.get("sdpa"),
            "o_t": (max(flash) <= O_T_SLOPE) if flash else None}


def run_grid(configs: list[str], opts, log=print) -> dict:
    """The T sweep (opts.t_sizes at opts.t_sweep_d) and the D sweep (opts.d_sizes at opts.d_sweep_t)."""
    out = {}
    for sweep, sizes in (("t_sweep", [(t, opts.t_sweep_d) for t in opts.t_sizes]),
                         ("d_sweep", [(opts.d_sweep_t, d) for d in opts.d_sizes])):
        out[sweep] = []
        for t, d in sizes:
            point = run_point(configs, t, d, opts)
            out[sweep].append(point)
            wall = point["time_wall_s"] + point.get("memory_wall_s", 0.0)
            fastest = min((c for c in point["median_s"] if c != "sdpa"), key=point["median_s"].get, default="sdpa")
            log(f"  {sweep} T={t:<5} D={d:<4} {wall:7.1f} s   sdpa {1e3 * point['median_s']['sdpa']:.1f} ms, "
                f"{fastest} x{point['x_sdpa'][fastest]:.2f} (fastest other)")
    out["memory_slope"] = memory_slopes(out["t_sweep"], configs) if opts.memory else None
    return out


def _cell_time(point: dict, c: str) -> str:
    if c in point["skipped"]:
        return "skipped"
    return f"{1e3 * point['median_s'][c]:.4g} ms ({point['x_sdpa'][c]:.2f}x)"


def _cell_mem(point: dict, c: str) -> str:
    if c in point["skipped"]:
        return "skipped"
    return f"{point['peak_mib'][c]:.1f}" if "peak_mib" in point else "-"


def _fmt_slope(s) -> str:
    return "-" if s is None else f"{s:.2f}"


def memory_statement(ms: dict | None) -> str:
    """The md's answer to: is attention memory O(T)?"""
    if ms is None:
        return "Memory was not measured (--no-memory): no O(T) slope."
    if ms["flash_max"] is None:
        return f"Too few T >= {ms['min_t']} with memory for a slope: no O(T) verdict."
    verdict = ("yes: every flash preset's slope is at most "
               if ms["o_t"] else "no: some flash preset's slope is above ") + f"{O_T_SLOPE}"
    return (f"Is attention memory O(T)? Log-log slope of peak memory against T over T >= {ms['min_t']}: "
            f"flash presets {_fmt_slope(ms['flash_min'])} to {_fmt_slope(ms['flash_max'])} (median "
            f"{_fmt_slope(ms['flash_median'])}), sdpa {_fmt_slope(ms['sdpa'])}, math {_fmt_slope(ms['math'])} "
            f"(O(T) is 1, O(T^2) is 2) - {verdict}.")


def markdown(result: dict) -> str:
    """The report: the T sweep's times and memory, the O(T) statement, the D sweep."""
    configs, sh, grid = result["configs"], result["shape"], result["grid"]
    tp, dp = grid["t_sweep"], grid["d_sweep"]
    ms = grid["memory_slope"]
    skipped = "; ".join(f"{k} ({v})" for k, v in result["skipped_presets"].items()) or "none"
    subset = " Configurations: a subset (--quick / --presets)." if result["quick"] or result["presets"] else ""
    runs = f"{result['repeats']} run{'s' * (result['repeats'] != 1)}"
    lines = [f"# Attention scaling on CPU ({result['threads']} thread{'s' * (result['threads'] != 1)})", "",
             f"torch {result['torch']}, CPU {result['machine']['capability']}; shape (B={sh['B']}, H={sh['H']}, T, D), bf16 inputs, "
             f"causal, forward+backward; median of {runs} interleaved round-robin after a warm-up; x = ratio "
             "to torch SDPA measured in the same run. Ratios within one run on one machine, not timed tests. "
             "Peak MiB: growth of the peak resident set over one forward+backward in a fresh process (after a "
             f"warm-up call at T = 64), inputs excluded. Presets not run: {skipped}.{subset}", "",
             f"## Time against T (D = {result['t_sweep_d']})", "",
             markdown_table(["config"] + [f"T={p['T']}" for p in tp], [[c] + [_cell_time(p, c) for p in tp] for c in configs]),
             "", f"## Peak memory against T (D = {result['t_sweep_d']}), MiB", ""]
    if ms is None:
        lines.append("Not measured (--no-memory).")
    else:
        lines.append(markdown_table(["config"] + [f"T={p['T']}" for p in tp] + [f"slope (T >= {ms['min_t']})"],
                            [[c] + [_cell_mem(p, c) for p in tp] + [_fmt_slope(ms["per_config"][c])]
                             for c in configs]))
    lines += ["", memory_statement(ms), "", f"## Time (and peak MiB) against D (T = {result['d_sweep_t']})", ""]
    mem = all("peak_mib" in p for p in dp)

    def d_cell(p, c):
        return _cell_time(p, c) + (f", {_cell_mem(p, c)} MiB" if mem and c not in p["skipped"] else "")
    rows = [[c] + [d_cell(p, c) for p in dp] for c in configs]
    lines.append(markdown_table(["config"] + [f"D={p['D']}" for p in dp], rows) if dp else "Not run (no --d-sizes).")
    return "\n".join(lines) + "\n"


def _guides(ax, xs, y0):
    """T and T^2 guide lines through (xs[0], y0)."""
    for k, style in ((1, ":"), (2, "--")):
        ax.plot(xs, [y0 * (x / xs[0]) ** k for x in xs], style, color="0.4", lw=1, label=f"~T^{k}" if k > 1 else "~T")


def write_figure(result: dict, path) -> Path | None:
    """Log-log time against T per configuration, and peak memory against T, each with T and T^2
    guides (flashguard.utils.plotting: Agg, written atomically). None, with a note, without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no figure (pip install matplotlib)")
        return None
    from flashguard.utils.plotting import pyplot, save_png

    plt = pyplot()
    tp, configs = result["grid"]["t_sweep"], result["configs"]
    panels = [("median_s", "forward+backward, s")] + ([("peak_mib", "peak RSS growth, MiB")]
                                                         if all("peak_mib" in p for p in tp) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.4), squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, (key, ylabel) in zip(axes[0], panels):
        for i, c in enumerate(configs):
            pts = [(p["T"], p[key][c]) for p in tp if c in p[key] and p[key][c] > 0]
            if pts:
                ax.plot(*zip(*pts), "o-" if c not in BASELINES else "s--", color=cmap(i % 20), lw=1.4, ms=3, label=c)
        firsts = [p[key][c] for p in tp[:1] for c in configs if c in p[key] and p[key][c] > 0]
        if firsts:
            _guides(ax, [p["T"] for p in tp], statistics.median(firsts))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (sequence length)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    sh = result["shape"]
    fig.suptitle(f"attention on CPU, {result['threads']} thread(s): B={sh['B']}, H={sh['H']}, "
                 f"D={result['t_sweep_d']}, bf16, causal", fontsize=9)
    return save_png(fig, path)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"T <= {QUICK_T_MAX}; configs {', '.join(QUICK_CONFIGS)}")
    ap.add_argument("--presets", type=_names,
                    help="comma-separated configurations to run (presets, math, sdpa; sdpa is always run)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per configuration and size (median)")
    ap.add_argument("--batch", type=int, default=1, help="B")
    ap.add_argument("--heads", type=int, default=4, help="H")
    ap.add_argument("--t-sizes", type=_ints, default=list(T_SIZES), help="the T sweep's sequence lengths")
    ap.add_argument("--t-sweep-d", type=int, default=64, help="the T sweep's head dim")
    ap.add_argument("--d-sizes", type=_ints, default=list(D_SIZES), help="the D sweep's head dims")
    ap.add_argument("--d-sweep-t", type=int, default=1024, help="the D sweep's sequence length")
    ap.add_argument("--math-max-t", type=int, default=4096, help="skip the math baseline above this T (O(T^2) memory)")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory subprocesses")
    ap.add_argument("--out-dir", type=Path, default=HERE / "results", help="where the json, md and png go")
    args = ap.parse_args(argv)
    if args.quick:
        args.t_sizes = [t for t in args.t_sizes if t <= QUICK_T_MAX]
    return args


def main(argv=None) -> dict:
    opts = parse_args(argv)
    start = time.perf_counter()
    threads = torch.get_num_threads()
    available, skipped = cpu_presets()
    configs = select_configs(available, skipped, opts.presets, opts.quick)
    print(f"torch {torch.__version__}, {threads} thread(s), CPU {torch.backends.cpu.get_cpu_capability()}; "
          f"configs: {', '.join(configs)}" + (f"; not run: {', '.join(skipped)}" if skipped else ""))
    grid = run_grid(configs, opts)
    result = {"torch": torch.__version__, "machine": machine(), "threads": threads,
              "shape": {"B": opts.batch, "H": opts.heads, "dtype": "bfloat16", "causal": True,
                        "pass": "forward+backward"},
              "t_sweep_d": opts.t_sweep_d, "d_sweep_t": opts.d_sweep_t, "repeats": opts.repeats,
              "math_max_t": opts.math_max_t, "memory": opts.memory, "quick": opts.quick, "presets": opts.presets,
              "configs": configs, "skipped_presets": skipped, "grid": grid}
    result["elapsed_s"] = time.perf_counter() - start
    stem = opts.out_dir / f"scaling-cpu-{threads}thread"
    md = markdown(result)
    atomic_write_json(stem.with_suffix(".json"), result, indent=1)
    atomic_write_text(stem.with_suffix(".md"), md)
    fig = write_figure(result, stem.with_suffix(".png"))
    print("\n" + md)
    print(f"{result['elapsed_s']:.0f} s; wrote {stem}.json, .md" + (", .png" if fig else ""))
    return result


if __name__ == "__main__":
    main()
