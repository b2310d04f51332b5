"""Plots of probe metrics from metrics.jsonl records (matplotlib, Agg backend).

Each function takes the records of a run (a list of dicts, e.g. ``monitor.read_metrics(run)``),
writes one PNG atomically (a reader never sees half a file) and returns its path; a figure
with nothing to show says so in its title instead of failing.

* ``plot_spectral_norms``  per-head W_Q (or W_K) spectral norm against step, a panel per layer
* ``plot_tie_rate``        tie rate (and the fraction of rows with >= 2 Pbar == 1) against step
* ``plot_delta_bias``      running sum of the mean delta error against step, per layer
* ``plot_singular_values`` the W_Q gradient error's top singular values, normalised by the
                           first, at several probe steps (is it rank one? does it stay so?)
* ``plot_monitor``         loss and gradient norm with the monitor's watch / warning steps
"""
from __future__ import annotations

import math
import re
from pathlib import Path

__all__ = ["plot_spectral_norms", "plot_tie_rate", "plot_delta_bias", "plot_singular_values", "plot_monitor",
           "series", "draw_head_norms"]


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path) -> Path:
    from ..utils.atomic import atomic_output
    path = Path(path)
    with atomic_output(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return path


def series(records: list[dict], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    """{key: (steps, values)} of every key matching the regex ``pattern`` (full match)."""
    rx = re.compile(pattern)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in records:
        step = r.get("step")
        if step is None:
            continue
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and rx.fullmatch(k):
                s, vals = out.setdefault(k, ([], []))
                s.append(step)
                vals.append(float(v))
    return out


def _layers(keys, rx: str) -> list[int]:
    found = set()
    for k in keys:
        m = re.search(rx, k)
        if m:
            found.add(int(m.group(1)))
    return sorted(found)


def _panels(n: int, title: str):
    plt = _plt()
    n = max(n, 1)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, constrained_layout=True)
    fig.suptitle(title)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat


def plot_spectral_norms(records: list[dict], path, *, which: str = "wq", layers=None) -> Path:
    """Per-head spectral norm of W_Q (``which="wq"``) or W_K against step."""
    data = series(records, rf"weights/{which}_spectral_norm/L\d+H\d+")
    found = _layers(data, r"/L(\d+)H")
    layers = [l for l in found if layers is None or l in layers]
    title = f"{'W_Q' if which == 'wq' else 'W_K'} spectral norm per head"
    fig, axes = _panels(len(layers), title if layers else title + " (no probe metrics)")
    for ax, layer in zip(axes, layers):
        draw_head_norms(ax, data, layer)
        ax.set_title(f"layer {layer}")
    return _save(fig, path)


def draw_head_norms(ax, data: dict[str, tuple[list[int], list[float]]], layer: int) -> int:
    """One line per head of ``layer`` from ``series(...)`` of per-head norm keys (``.../L<l>H<h>``),
    heads in order; returns how many were drawn (also used by the report's cross-run figure)."""
    keys = sorted((k for k in data if re.search(rf"/L{layer}H\d+$", k)), key=lambda k: int(k.rsplit("H", 1)[1]))
    for key in keys:
        ax.plot(*data[key], label="H" + key.rsplit("H", 1)[1])
    ax.set_xlabel("step")
    ax.set_ylabel("spectral norm")
    if keys:
        ax.legend(fontsize="small", ncol=2)
    return len(keys)


def plot_tie_rate(records: list[dict], path) -> Path:
    """Tie rate per layer (solid) and fraction of rows with >= 2 Pbar == 1 (dashed)."""
    plt = _plt()
    ties = series(records, r"numerics/tie_rate/L\d+")
    multi = series(records, r"numerics/pbar_one_multi/L\d+")
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for key in sorted(ties, key=lambda k: int(k.rsplit("L", 1)[1])):
        line, = ax.plot(*ties[key], label=f"ties {key.rsplit('/', 1)[1]}")
        m = key.replace("tie_rate", "pbar_one_multi")
        if m in multi:
            ax.plot(*multi[m], linestyle="--", color=line.get_color(), label=f">=2 Pbar=1 {key.rsplit('/', 1)[1]}")
    ax.set_title("tied row maxima" + ("" if ties else " (no probe metrics)"))
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of rows")
    if ties:
        ax.legend(fontsize="small", ncol=2)
    return _save(fig, path)


def plot_delta_bias(records: list[dict], path) -> Path:
    """Running sum of mean(delta_lp - delta_hp) per layer; a steady climb is the study's bias."""
    plt = _plt()
    cum = series(records, r"numerics/delta_err_cumsum/L\d+")
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for key in sorted(cum, key=lambda k: int(k.rsplit("L", 1)[1])):
        ax.plot(*cum[key], marker=".", label=key.rsplit("/", 1)[1])
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_title("cumulative delta error  sum of mean(delta_lp - delta_hp)" + ("" if cum else " (no probe metrics)"))
    ax.set_xlabel("step")
    ax.set_ylabel("running sum")
    if cum:
        ax.legend(fontsize="small")
    return _save(fig, path)


def plot_singular_values(records: list[dict], path, *, max_curves: int = 6) -> Path:
    """Top singular values of the W_Q gradient error (``grad/wq_err_sv<i>``), divided by the
    first, at up to ``max_curves`` evenly spaced probe steps; a panel per layer."""
    data = series(records, r"grad/wq_err_sv\d+/L\d+")
    layers = _layers(data, r"/L(\d+)$")
    fig, axes = _panels(len(layers), "W_Q gradient-error singular values / sv1"
                        + ("" if layers else " (no probe metrics)"))
    plt = _plt()
    for ax, layer in zip(axes, layers):
        keys = sorted((k for k in data if k.endswith(f"/L{layer}")),
                      key=lambda k: int(re.search(r"sv(\d+)", k).group(1)))
        by_step: dict[int, list[float]] = {}
        for k in keys:
            for s, v in zip(*data[k]):
                by_step.setdefault(s, []).append(v)
        steps = sorted(by_step)
        if len(steps) > max_curves:
            steps = [steps[round(i * (len(steps) - 1) / (max_curves - 1))] for i in range(max_curves)]
        cmap = plt.get_cmap("viridis")
        for j, s in enumerate(steps):
            sv = by_step[s]
            if sv and sv[0] > 0:
                ax.plot(range(1, len(sv) + 1), [v / sv[0] for v in sv], marker="o",
                        color=cmap(j / max(len(steps) - 1, 1)), label=f"step {s}")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("index")
        ax.set_ylabel("sv_i / sv_1")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize="small")
    return _save(fig, path)


def plot_monitor(records: list[dict], path) -> Path:
    """Training loss and gradient norm, with the steps the monitor said watch / warning."""
    plt = _plt()
    loss = series(records, r"loss/train").get("loss/train", ([], []))
    grad = series(records, r"grad/norm").get("grad/norm", ([], []))
    state = series(records, r"monitor/state").get("monitor/state", ([], []))
    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot(*loss, color="black", label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax2 = ax.twinx()
    finite = [(s, g) for s, g in zip(*grad) if math.isfinite(g) and g > 0]
    ax2.plot([s for s, _ in finite], [g for _, g in finite], color="tab:blue", alpha=0.5, label="grad norm")
    ax2.set_yscale("log")
    ax2.set_ylabel("gradient norm")
    for s, v in zip(*state):
        if v >= 2:
            ax.axvline(s, color="tab:red", alpha=0.15)
        elif v >= 1:
            ax.axvline(s, color="tab:orange", alpha=0.08)
    ax.set_title("monitor: watch (orange) / warning (red)")
    return _save(fig, path)
