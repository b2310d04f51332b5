"""The edge experiment's figure (matplotlib, Agg; written atomically): the share of seeds still
training against the step, one step curve per arm (a Kaplan-Meier curve without censoring
before the end: every run either diverges or reaches the last step)."""
from __future__ import annotations

from pathlib import Path

from ...utils.plotting import pyplot, save_png

__all__ = ["survival_curves"]

STYLES = ("-", "--", "-.", ":")


def survival_curves(arms: list[dict], steps: int, path, *, title: str = "") -> Path:
    """arms: [{"label", "finished", "diverged_steps"}] (analysis.arm_summary plus its label), in
    drawing order."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    cmap = plt.get_cmap("tab20")
    for i, a in enumerate(arms):
        n = a["finished"]
        if not n:
            continue
        xs, ys, alive = [0], [1.0], n
        for s in sorted(a["diverged_steps"]):
            xs += [s, s]
            ys += [alive / n, (alive - 1) / n]
            alive -= 1
        xs.append(steps)
        ys.append(alive / n)
        ax.plot(xs, ys, STYLES[i // 10 % len(STYLES)], color=cmap(i % 20), lw=1.6,
                label=f"{a['label']} ({a['diverged']}/{n})")
    ax.set_xlim(0, steps)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("step")
    ax.set_ylabel("share of seeds not diverged")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or "seeds still training (the one divergence rule)", fontsize=9)
    return save_png(fig, path)
