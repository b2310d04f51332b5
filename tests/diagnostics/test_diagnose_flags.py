"""`flashguard diagnose`: the per-layer ok / watch / warning flag (the monitor's own rules) and the legend."""
from __future__ import annotations

import argparse
import json
import math
import re

import pytest

from md_helpers import numbers
from run_helpers import MICRO, micro_overrides
from flashguard import keys
from flashguard.diagnostics.command import (COMPACT, LEGEND, _COLUMNS, add_diagnose_arguments, format_table,
                                            layer_flags, legend, run_diagnose)
from flashguard.diagnostics.monitor import MonitorThresholds


def _history(rates: dict[int, float], last: int, every: int = 10) -> list[dict]:
    """Probe records every ``every`` steps: layer l's W_Q head norms grow as exp(rates[l] * step);
    the trainer's keys every step (a flat gradient norm)."""
    recs = []
    for step in range(last + 1):
        r = {keys.STEP: step, keys.LOSS_TRAIN: 2.0, keys.GRAD_NORM: 1.0}
        if step % every == 0:
            for layer, rate in rates.items():
                for h in range(2):
                    r[keys.WQ_NORM.key(layer, h)] = (1.0 + 0.1 * h) * math.exp(rate * step)
                r[keys.MAX_LOGIT.key(layer)] = 5.0
        recs.append(r)
    return recs


def _split(recs: list[dict]):
    """(history before the last step, the last step's probe metrics, that step) as diagnose has them."""
    *hist, last = recs
    return hist, {k: v for k, v in last.items() if keys.is_probe_key(k)}, last[keys.STEP]


def test_planted_wq_growth_is_a_warning_and_a_flat_layer_is_ok():
    hist, metrics, step = _split(_history({0: 0.0, 1: 0.024}, 200))   # L1: 2.4 per 100 steps
    flags = layer_flags(hist, metrics, step, [0, 1])
    assert flags[0].name == "ok" and flags[0].reasons == []
    assert flags[1].name == "warning"
    (growth,) = [r for r in flags[1].reasons if r.startswith("W_Q norm growth")]
    assert numbers(growth) == [2.4, 100] and re.search(r"\bL1H\d+$", growth), growth   # the rate, at an L1 head


def test_moderate_growth_is_a_watch_and_the_thresholds_are_the_monitors():
    hist, metrics, step = _split(_history({0: 0.0, 1: 0.012}, 100))   # 1.2 per 100 steps, x3.3 in all
    flags = layer_flags(hist, metrics, step, [0, 1])
    assert (flags[0].name, flags[1].name) == ("ok", "watch")
    # the same records under other thresholds: the monitor decides, nothing is re-implemented here
    assert layer_flags(hist, metrics, step, [1], MonitorThresholds(wq_growth_watch=1.5))[1].name == "ok"
    assert layer_flags(hist, metrics, step, [1], MonitorThresholds(ignore_before=1000))[1].name == "ok"


def test_one_layers_signal_does_not_flag_another():
    hist, metrics, step = _split(_history({0: 0.0, 1: 0.0}, 100))
    metrics[keys.MAX_LOGIT.key(1)] = 500.0                 # a logit warning in L1 at the last probe ...
    hist[-10][keys.MAX_LOGIT.key(1)] = 500.0               # ... and the probe before (the monitor's persist = 2)
    flags = layer_flags(hist, metrics, step, [0, 1])
    assert flags[0].name == "ok" and flags[1].name == "warning"
    (logit,) = [r for r in flags[1].reasons if "logit" in r]
    assert numbers(logit) == [500] and logit.endswith("L1")   # the value, and the layer


def test_table_has_the_flag_column_and_every_column_a_legend_line():
    metrics = {keys.WQ_NORM_MAX.key(0): 1.5, keys.TIE_RATE.key(1): 0.25}
    text = format_table(metrics, [0, 1], attention={0: "flash[paper,none]", 1: "flash[paper,none]"},
                        flags={0: "ok", 1: "warning"})
    header, _, row0, row1 = text.split("\n")
    assert header.split()[:3] == ["layer", "attention", "flag"]
    assert row0.split()[:4] == ["L0", "flash[paper,none]", "ok", "1.5"] and row1.split()[2] == "warning"
    assert "flag" not in format_table(metrics, [0])         # without flags, no column
    lines = legend().split("\n")
    entries = [ln for ln in lines[1:] if ln[:2] == "  " and ln[2] != " "]   # continuation lines are indented further
    assert lines[0] == "columns:" and len(entries) == 3 + len(_COLUMNS)      # one entry each
    assert max(len(ln) for ln in lines) <= 100
    for name in ["layer", "attention", "flag"] + [c for c, _ in _COLUMNS]:
        assert sum(1 for ln in entries if ln.split()[:1] == name.split()[:1]) >= 1, name
        assert LEGEND[name]


def test_default_table_is_compact_within_100_columns_and_wide_has_every_column():
    # the widest cells _fmt writes (-1.23e-04) in every column of 12 layers, and long attention labels
    layers = list(range(12))
    metrics = {m.key(l): -1.23456e-4 for l in layers for _, m in _COLUMNS}
    attention = {l: "flash[paper,paper:beta=7,tol=0.001] (shadow: fa2-e4m3-pscaled, safe)" for l in layers}
    attention[3] = "math[fp32,none]"
    flags = {l: "warning" for l in layers}
    compact = format_table(metrics, layers, attention=attention, flags=flags, wide=False).split("\n")
    assert max(len(ln) for ln in compact) <= 100
    header = next(ln for ln in compact if ln.startswith("layer"))
    assert header.split() == " ".join(["layer", "flag", *COMPACT]).split() and len(COMPACT) == 7
    body = compact[compact.index(header) + 2:]
    assert len(body) == 12 and all(ln.split()[1:] == ["warning"] + ["-1.23e-04"] * 7 for ln in body)
    above = " ".join(ln.strip() for ln in compact[:compact.index(header)])   # the attention, each with its layers
    assert above.startswith("attention: ") and "L3: math[fp32,none]" in above
    assert re.findall(r"((?:L\d+, )*L\d+): ", above) == [", ".join(f"L{l}" for l in layers if l != 3), "L3"]
    wide = format_table(metrics, layers, attention=attention, flags=flags).split("\n")
    assert wide[0].split() == " ".join(["layer", "attention", "flag", *(c for c, _ in _COLUMNS)]).split()
    assert len(wide) == 2 + 12 and len(_COLUMNS) == 19
    assert wide[2].split()[-19:] == ["-1.23e-04"] * 19 and attention[0] in wide[2]
    short = legend(wide=False).split("\n")
    assert max(len(ln) for ln in short) <= 100 and "O bias.sgnV" not in "\n".join(short)
    assert all(f"  {c} " in "\n".join(short) for c in COMPACT)


@pytest.fixture(scope="module")
def probed(tiny_data, tmp_path_factory):
    from flashguard.diagnostics import DiagnosticsHook
    from flashguard.train import load_config, train
    run = tmp_path_factory.mktemp("flags") / "run"
    train(load_config(MICRO, micro_overrides(tiny_data, **{"train.diagnostics_every": 3})), run,
          hooks=[DiagnosticsHook()])
    return run


def test_diagnose_prints_flags_reasons_and_legend(probed, capsys):
    p = argparse.ArgumentParser()
    add_diagnose_arguments(p)
    assert run_diagnose(p.parse_args([str(probed), "--step", "3", "--no-grad-error", "--wide"])) == 0
    table = capsys.readouterr().out.split("\n")[1:5]
    assert table[0].split() == " ".join(["layer", "attention", "flag", *(c for c, _ in _COLUMNS)]).split()
    assert all(line.split()[2] in ("ok", "watch", "warning") for line in table[2:4])
    # the default: the attention on a line, then the compact table; the table and legend within 100 columns
    assert run_diagnose(p.parse_args([str(probed), "--step", "3", "--no-grad-error"])) == 0
    out = capsys.readouterr().out
    lines = out.split("\n")
    assert lines[1].startswith("attention: L0, L1: ") and lines[2].split() == " ".join(["layer", "flag", *COMPACT]).split()
    assert all(line.split()[1] in ("ok", "watch", "warning") for line in lines[4:6])
    shown = lines[1:lines.index("columns:")] if "columns:" in lines else []
    legend_lines = lines[lines.index("columns:"):lines.index("columns:") + 1 + 3 + len(COMPACT)]
    assert shown and max(len(ln) for ln in shown + legend_lines) <= 100
    # a 6-step run: nothing judged before 2 x warm-up, so every layer is ok, over 2 probes (steps 0 and 3)
    (flag_line,) = [line for line in lines if line.startswith("L0 ok: ")]
    assert numbers(flag_line) == [2]   # over 2 probes
    assert "columns:\n" in out and "  flag " in out and "  W_Q max " in out
    res = json.loads((probed / "diagnostics" / "diagnose_0000003.json").read_text())
    assert res["flags"]["0"] == res["flags"]["1"] == {"state": "ok", "reasons": [], "probes": 2}
