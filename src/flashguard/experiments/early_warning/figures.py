"""The early-warning evaluation's figures (matplotlib, Agg; written atomically).

``lead_times``: per detector, the lead times of its hits as points over a box (median and
quartiles), at the default thresholds on every divergent run (left) and at the calibrated
thresholds on the held-out half (right); the axis label counts hits, misses and false alarms.
``tradeoff``: per detector, the false-alarm rate on the stable runs against the median lead time
on the divergent runs (a miss counted as lead 0: no warning, no time to act) as its threshold
moves over the grid, on all runs; the default threshold is a square, the calibrated one a star.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ...utils.plotting import pyplot, save_png

__all__ = ["lead_times", "tradeoff"]

COLOURS = ("#1565c0", "#6a1b9a", "#c62828", "#ef6c00", "#2e7d32", "#00838f", "#5d4037")


def _panel(ax, names, measures, title):
    for i, name in enumerate(names):
        m = measures.get(name)
        if not m:
            continue
        xs = m["lead_times"]
        if xs:
            ax.boxplot([xs], positions=[i], widths=0.5, showfliers=False)
            jitter = np.linspace(-0.15, 0.15, len(xs)) if len(xs) > 1 else [0.0]
            ax.scatter(np.asarray(jitter) + i, xs, s=14, color=COLOURS[i % len(COLOURS)], zorder=3)
    labels = []
    for name in names:
        m = measures.get(name)
        labels.append(f"{name}\n(none)" if not m else
                      f"{name}\nhit {m['hits']}/{m['divergent']}, FA {m['false_alarms']}/{m['stable']}")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(labels, fontsize=7, rotation=20, ha="right")
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_ylabel("lead time (steps before divergence)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)


def lead_times(names, default: dict, calibrated: dict, path, *, title: str = "") -> Path:
    """``default`` / ``calibrated``: {detector: measure dict or None}."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(2.2 * len(names) + 3, 4.2), sharey=True)
    _panel(axes[0], names, default, "default thresholds, all runs")
    _panel(axes[1], names, calibrated, "calibrated thresholds, held-out half")
    if title:
        fig.suptitle(title, fontsize=10)
    return save_png(fig, path)


def tradeoff(curves: dict, path, *, title: str = "") -> Path:
    """``curves``: {detector: {"points": [[threshold, median lead, false-alarm rate], ...],
    "default": threshold, "calibrated": threshold or None}}."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.8, 4.4))
    for i, (name, c) in enumerate(curves.items()):
        pts = [p for p in c["points"] if p[1] is not None and p[2] is not None]
        if not pts:
            continue
        colour = COLOURS[i % len(COLOURS)]
        ax.plot([p[1] for p in pts], [p[2] for p in pts], "-o", ms=3, color=colour, label=name, lw=1.2)
        for key, marker, size in (("default", "s", 60), ("calibrated", "*", 160)):
            hit = [p for p in pts if c.get(key) is not None and p[0] == c[key]]
            if hit:
                ax.scatter([hit[0][1]], [hit[0][2]], marker=marker, s=size, color=colour, edgecolors="black",
                           linewidths=0.7, zorder=4)
    ax.set_xlabel("median lead time over divergent runs (a miss = 0 steps)")
    ax.set_ylabel("false-alarm rate over stable runs")
    ax.set_ylim(-0.03, 1.03)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", title="square: default, star: calibrated", title_fontsize=7)
    if title:
        ax.set_title(title, fontsize=9)
    return save_png(fig, path)
