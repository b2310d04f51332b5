"""Plot helpers: figures of known metrics show exactly those series; PNGs are written atomically."""
from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from flashguard.diagnostics.plots import (delta_bias_figure, monitor_figure, plot_delta_bias, plot_monitor,
                                          plot_singular_values, plot_spectral_norms, plot_tie_rate, series,
                                          singular_values_figure, spectral_norms_figure, tie_rate_figure)

PNG = b"\x89PNG\r\n\x1a\n"


def _records():
    recs = []
    for step in range(0, 60):
        r = {"step": step, "loss/train": 3.0 - step / 100, "grad/norm": 1.0, "monitor/state": float(step > 50)}
        if step % 10 == 0:
            for layer in (0, 1):
                for h in range(2):
                    r[f"weights/wq_spectral_norm/L{layer}H{h}"] = 1.0 + 0.01 * step * (h + 1)
                    r[f"weights/wk_spectral_norm/L{layer}H{h}"] = 1.0
                r[f"numerics/tie_rate/L{layer}"] = 0.1
                r[f"numerics/pbar_one_multi/L{layer}"] = 0.05
                r[f"numerics/delta_err_cumsum/L{layer}"] = 1e-4 * step
                for i in range(1, 5):
                    r[f"grad/wq_err_sv{i}/L{layer}"] = 1.0 / i ** 2
        recs.append(r)
    return recs


@pytest.mark.parametrize("fn", [plot_spectral_norms, plot_tie_rate, plot_delta_bias, plot_singular_values,
                                plot_monitor])
@pytest.mark.parametrize("records", [_records(), []], ids=["run", "empty"])
def test_each_plot_writes_a_png_and_leaves_no_temp_file(fn, records, tmp_path):
    out = fn(records, tmp_path / "sub" / f"{fn.__name__}.png")
    assert out.read_bytes()[:8] == PNG
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_series_and_key_filters():
    s = series(_records(), r"weights/wq_spectral_norm/L1H\d+")
    assert sorted(s) == ["weights/wq_spectral_norm/L1H0", "weights/wq_spectral_norm/L1H1"]
    steps, values = s["weights/wq_spectral_norm/L1H1"]
    assert steps == [0, 10, 20, 30, 40, 50] and values[-1] == pytest.approx(2.0)


def test_wk_norms_and_a_layer_subset(tmp_path):
    assert plot_spectral_norms(_records(), tmp_path / "wk.png", which="wk", layers=[1]).exists()


@pytest.fixture
def figure():
    """Call ``figure(build, *args)``: the built Figure, closed after the test."""
    made = []

    def build(fn, *args, **kw):
        made.append(fn(*args, **kw))
        return made[-1]
    yield build
    for f in made:
        plt.close(f)


def _lines(ax) -> dict[str, tuple[list, list]]:
    return {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}


PROBE_STEPS = [0, 10, 20, 30, 40, 50]


def test_spectral_norms_one_panel_per_layer_one_line_per_head(figure):
    fig = figure(spectral_norms_figure, _records())
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["layer 0", "layer 1"]
    for ax in axes:
        lines = _lines(ax)
        assert sorted(lines) == ["H0", "H1"]
        for h in (0, 1):
            steps, values = lines[f"H{h}"]
            assert steps == PROBE_STEPS
            assert values == pytest.approx([1.0 + 0.01 * s * (h + 1) for s in PROBE_STEPS])
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "spectral norm")
    assert fig._suptitle.get_text().startswith("W_Q")   # the query projection's norms
    wk = figure(spectral_norms_figure, _records(), which="wk", layers=[1])
    (ax,) = [a for a in wk.axes if a.get_visible()]
    assert ax.get_title() == "layer 1" and all(v == [1.0] * 6 for _, v in _lines(ax).values())
    assert wk._suptitle.get_text().startswith("W_K")


def test_tie_rate_solid_ties_and_dashed_multi_ones_in_one_colour(figure):
    (ax,) = figure(tie_rate_figure, _records()).axes
    lines = {ln.get_label(): ln for ln in ax.lines}
    assert sorted(lines) == [">=2 Pbar=1 L0", ">=2 Pbar=1 L1", "ties L0", "ties L1"]
    for layer in (0, 1):
        ties, multi = lines[f"ties L{layer}"], lines[f">=2 Pbar=1 L{layer}"]
        assert list(ties.get_xdata()) == PROBE_STEPS and list(ties.get_ydata()) == [0.1] * 6
        assert list(multi.get_ydata()) == [0.05] * 6 and multi.get_linestyle() == "--"
        assert ties.get_color() == multi.get_color()


def test_delta_bias_running_sum_per_layer_and_the_zero_line(figure):
    (ax,) = figure(delta_bias_figure, _records()).axes
    lines = _lines(ax)
    assert lines["L1"][0] == PROBE_STEPS and lines["L1"][1] == pytest.approx([1e-4 * s for s in PROBE_STEPS])
    zero = [ln for ln in ax.lines if ln.get_label().startswith("_")]          # axhline: unlabelled
    assert len(zero) == 1 and list(zero[0].get_ydata()) == [0.0, 0.0]


def test_singular_values_normalised_by_the_first_at_each_probe_step(figure):
    fig = figure(singular_values_figure, _records(), max_curves=3)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["layer 0", "layer 1"]
    lines = _lines(axes[0])
    assert sorted(lines) == ["step 0", "step 20", "step 50"]   # 3 of the 6 probe steps, evenly spaced
    for xs, ys in lines.values():
        assert xs == [1, 2, 3, 4] and ys == pytest.approx([1.0, 1 / 4, 1 / 9, 1 / 16])


def test_monitor_loss_gradient_and_the_state_marks(figure):
    recs = _records()
    recs[30]["grad/norm"] = float("inf")                       # not drawn on the log axis
    fig = figure(monitor_figure, recs)
    ax, ax2 = fig.axes
    (loss,) = [ln for ln in ax.lines if ln.get_label() == "train loss"]
    assert list(loss.get_xdata()) == list(range(60)) and list(loss.get_ydata()) == pytest.approx(
        [3.0 - s / 100 for s in range(60)])
    (grad,) = ax2.lines
    assert 30 not in list(grad.get_xdata()) and len(grad.get_xdata()) == 59 and ax2.get_yscale() == "log"
    marks = [ln for ln in ax.lines if ln.get_label() != "train loss"]   # axvline at each watch step
    assert [ln.get_xdata()[0] for ln in marks] == list(range(51, 60))


@pytest.mark.parametrize("build", [spectral_norms_figure, tie_rate_figure, delta_bias_figure,
                                   singular_values_figure])
def test_no_probe_metrics_is_said_in_the_title(figure, build):
    fig = figure(build, [{"step": 0, "loss/train": 1.0}])
    titles = [fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes]
    assert any("(no probe metrics)" in t for t in titles)
    assert not [ln for ax in fig.axes for ln in ax.lines if not ln.get_label().startswith("_")]  # zero lines only
