"""Plot helpers write PNG files atomically from metrics records."""
from __future__ import annotations

import pytest

from flashguard.diagnostics.plots import (plot_delta_bias, plot_monitor, plot_singular_values, plot_spectral_norms,
                                          plot_tie_rate, series)

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
