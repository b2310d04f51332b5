"""Plots of probe metrics from metrics.jsonl records (matplotlib, Agg backend).

Each ``plot_*`` function takes the records of a run (a list of dicts, e.g.
``flashguard.utils.jsonl.read_metrics(run)``), writes one PNG atomically (a reader never sees half a file) and
returns its path; a figure with nothing to show says so in its title instead of failing. Its
``*_figure`` twin (same arguments, no path) returns the matplotlib Figure instead, for callers
that want to look at or change it (close it with ``matplotlib.pyplot.close``). ``flashguard diagnose RUN_DIR
--plots`` (``command.write_plots``) writes them all for a run.

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

from .. import keys
from ..utils.plotting import pyplot, save_png

__all__ = ["plot_spectral_norms", "plot_tie_rate", "plot_delta_bias", "plot_singular_values", "plot_monitor",
           "spectral_norms_figure", "tie_rate_figure", "delta_bias_figure", "singular_values_figure",
           "monitor_figure", "series", "draw_head_norms"]


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


def _panels(n: int, title: str):
    plt = pyplot()
    n = max(n, 1)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False, constrained_layout=True)
    fig.suptitle(title)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat


def spectral_norms_figure(records: list[dict], *, which: str = "wq", layers=None):
    """Per-head spectral norm of W_Q (``which="wq"``) or W_K against step, a panel per layer."""
    metric = keys.SPECTRAL_NORM[which]
    data = series(records, metric.pattern(heads=True))
    found = sorted({metric.parse(k)[0] for k in data})
    layers = [l for l in found if layers is None or l in layers]
    title = f"{'W_Q' if which == 'wq' else 'W_K'} spectral norm per head"
    fig, axes = _panels(len(layers), title if layers else title + " (no probe metrics)")
    for ax, layer in zip(axes, layers):
        draw_head_norms(ax, data, layer)
        ax.set_title(f"layer {layer}")
    return fig


def plot_spectral_norms(records: list[dict], path, *, which: str = "wq", layers=None) -> Path:
    """Per-head spectral norm of W_Q (``which="wq"``) or W_K against step."""
    return save_png(spectral_norms_figure(records, which=which, layers=layers), path)


def _head_of(key: str, layer: int) -> int | None:
    """h of a per-head key ``<ns>/<name>/L<layer>H<h>`` of the schema, else None."""
    found = keys.parse(key)
    return found[2] if found is not None and found[1] == layer else None


def draw_head_norms(ax, data: dict[str, tuple[list[int], list[float]]], layer: int) -> int:
    """One line per head of ``layer`` from ``series(...)`` of per-head norm keys (``.../L<l>H<h>``),
    heads in order; returns how many were drawn (also used by the report's cross-run figure)."""
    heads = sorted((h, k) for k in data if (h := _head_of(k, layer)) is not None)
    for h, key in heads:
        ax.plot(*data[key], label=f"H{h}")
    ax.set_xlabel("step")
    ax.set_ylabel("spectral norm")
    if heads:
        ax.legend(fontsize="small", ncol=2)
    return len(heads)


def tie_rate_figure(records: list[dict]):
    """Tie rate per layer (solid) and fraction of rows with >= 2 Pbar == 1 (dashed)."""
    plt = pyplot()
    ties = series(records, keys.TIE_RATE.pattern())
    multi = series(records, keys.PBAR_ONE_MULTI.pattern())
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for layer in sorted(keys.TIE_RATE.parse(k)[0] for k in ties):
        line, = ax.plot(*ties[keys.TIE_RATE.key(layer)], label=f"ties L{layer}")
        m = keys.PBAR_ONE_MULTI.key(layer)
        if m in multi:
            ax.plot(*multi[m], linestyle="--", color=line.get_color(), label=f">=2 Pbar=1 L{layer}")
    ax.set_title("tied row maxima" + ("" if ties else " (no probe metrics)"))
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of rows")
    if ties:
        ax.legend(fontsize="small", ncol=2)
    return fig


def plot_tie_rate(records: list[dict], path) -> Path:
    """Tie rate per layer (solid) and fraction of rows with >= 2 Pbar == 1 (dashed)."""
    return save_png(tie_rate_figure(records), path)


def delta_bias_figure(records: list[dict]):
    """Running sum of mean(delta_lp - delta_hp) per layer; a steady climb is the study's bias."""
    plt = pyplot()
    cum = series(records, keys.DELTA_ERR_CUMSUM.pattern())
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for layer in sorted(keys.DELTA_ERR_CUMSUM.parse(k)[0] for k in cum):
        ax.plot(*cum[keys.DELTA_ERR_CUMSUM.key(layer)], marker=".", label=f"L{layer}")
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_title("cumulative delta error  sum of mean(delta_lp - delta_hp)" + ("" if cum else " (no probe metrics)"))
    ax.set_xlabel("step")
    ax.set_ylabel("running sum")
    if cum:
        ax.legend(fontsize="small")
    return fig


def plot_delta_bias(records: list[dict], path) -> Path:
    """Running sum of mean(delta_lp - delta_hp) per layer; a steady climb is the study's bias."""
    return save_png(delta_bias_figure(records), path)


def singular_values_figure(records: list[dict], *, max_curves: int = 6):
    """Top singular values of the W_Q gradient error (``grad/wq_err_sv<i>``), divided by the
    first, at up to ``max_curves`` evenly spaced probe steps; a panel per layer."""
    data = series(records, keys.WQ_ERR_SV_PATTERN)
    where = {k: keys.parse_sv(k) for k in data}                    # key -> (i, layer)
    layers = sorted({layer for _, layer in where.values()})
    fig, axes = _panels(len(layers), "W_Q gradient-error singular values / sv1"
                        + ("" if layers else " (no probe metrics)"))
    plt = pyplot()
    for ax, layer in zip(axes, layers):
        svs = sorted((i, k) for k, (i, l) in where.items() if l == layer)
        by_step: dict[int, list[float]] = {}
        for _, k in svs:
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
    return fig


def plot_singular_values(records: list[dict], path, *, max_curves: int = 6) -> Path:
    """Top singular values of the W_Q gradient error (``grad/wq_err_sv<i>``), divided by the
    first, at up to ``max_curves`` evenly spaced probe steps; a panel per layer."""
    return save_png(singular_values_figure(records, max_curves=max_curves), path)


def monitor_figure(records: list[dict]):
    """Training loss and gradient norm, with the steps the monitor said watch / warning."""
    plt = pyplot()
    loss = series(records, re.escape(keys.LOSS_TRAIN)).get(keys.LOSS_TRAIN, ([], []))
    grad = series(records, re.escape(keys.GRAD_NORM)).get(keys.GRAD_NORM, ([], []))
    state = series(records, re.escape(keys.MONITOR_STATE)).get(keys.MONITOR_STATE, ([], []))
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
    return fig


def plot_monitor(records: list[dict], path) -> Path:
    """Training loss and gradient norm, with the steps the monitor said watch / warning."""
    return save_png(monitor_figure(records), path)
