"""One metric-key schema (flashguard.keys): what the writers make is what the readers ask for.

A real probed micro run (every layer, probes at every step) is the writer side. It must write
every key of the schema and nothing outside it; every reader (the monitor, `flashguard
diagnose`'s table, the plots, the repro's claims, the report's figures) must find its data in
that run; and no module of the package may spell a key as a literal instead of using the
schema. Renaming a key in one place only makes one of these fail.
"""
from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from run_helpers import MICRO, micro_overrides
from flashguard import keys
from flashguard.diagnostics import DiagnosticsHook, Monitor, MonitorThresholds, read_metrics
from flashguard.diagnostics import plots
from flashguard.diagnostics.command import format_table
from flashguard.experiments.repro import claims
from flashguard.train import load_config, train

SRC = Path(keys.__file__).resolve().parent
STEPS, N_LAYER, N_HEAD = 8, 2, 2   # configs/micro.toml: the micro preset, 2 layers of 2 heads


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory) -> Path:
    """8 micro steps, probes on every layer at every step (growth and cos_prev need a previous
    probe, C5/C6 need 8), a divergence ceiling every step exceeds and on_divergence = continue
    (so the trainer writes event/diverged and trains on)."""
    out = tmp_path_factory.mktemp("keys") / "run"
    cfg = load_config(MICRO, micro_overrides(tiny_data, **{
        "train.steps": STEPS, "train.diagnostics_every": 1, "train.eval_every": 4,
        "train.divergence_loss": 0.001, "train.on_divergence": '"continue"'}))
    assert (cfg.model.preset, cfg.attention.spec.backend) == ("micro", "flash")
    train(cfg, out, log_fn=lambda m: None, hooks=[DiagnosticsHook()])
    return out


def _written(run: Path) -> set[str]:
    return {k for r in read_metrics(run) for k in r}


def test_the_writers_write_only_keys_of_the_schema(run):
    outside = set()
    for k in _written(run) - {keys.STEP}:
        if keys.is_probe_key(k):
            if keys.parse(k) is None:
                outside.add(k)
        elif k not in (*keys.TRAINER_KEYS, keys.MONITOR_STATE, keys.DIAGNOSTICS_TIME, keys.DIAGNOSTICS_FAILED):
            outside.add(k)
    assert not outside, f"written but not in flashguard.keys: {sorted(outside)}"


def test_every_key_of_the_schema_is_written(run):
    written = _written(run)
    missing = []
    for m in keys.PROBE_METRICS:
        for layer in range(N_LAYER):
            wanted = ([m.key(layer)] if m.per_layer else []) + \
                     ([m.key(layer, h) for h in range(N_HEAD)] if m.per_head else [])
            missing += [k for k in wanted if k not in written]
    missing += [k for k in (*keys.TRAINER_KEYS, keys.MONITOR_STATE, keys.DIAGNOSTICS_TIME) if k not in written]
    assert not missing, f"in flashguard.keys but no writer makes them: {missing}"


def test_a_failing_probe_writes_the_failure_key(tiny_data, tmp_path, monkeypatch):
    import flashguard.diagnostics.trainer as hook

    def broken(*a, **k):
        raise RuntimeError("a probe that fails")

    monkeypatch.setattr(hook, "run_probes", broken)
    train(load_config(MICRO, micro_overrides(tiny_data, **{"train.steps": 1, "train.diagnostics_every": 1})),
          tmp_path / "r", log_fn=lambda m: None, hooks=[DiagnosticsHook()])
    assert read_metrics(tmp_path / "r")[0][keys.DIAGNOSTICS_FAILED] == 1.0


def test_the_schema_refuses_keys_no_writer_makes():
    with pytest.raises(ValueError, match="per head only"):
        keys.WQ_NORM.key(1)                 # the norms are per head; their maximum is WQ_NORM_MAX
    with pytest.raises(ValueError, match="per layer only"):
        keys.SINK_TOP_FRAC.key(1, 0)
    with pytest.raises(ValueError, match="per layer only"):
        keys.DELTA_ERR_MEAN.pattern(heads=True)
    with pytest.raises(ValueError, match="not in the schema"):
        keys.wq_err("rank_one")
    assert keys.wq_err("sv3") == keys.wq_err_sv(3) and keys.wq_err("norm") is keys.WQ_ERR_NORM
    assert keys.parse("weights/wq_spectral_norm/L1H3") == (keys.WQ_NORM, 1, 3)
    assert keys.parse("weights/wq_spectral_norm/L1") is None and keys.parse(keys.GRAD_NORM) is None
    assert re.fullmatch(keys.MAX_LOGIT.pattern(1), "attn/max_logit/L1")
    assert not re.fullmatch(keys.MAX_LOGIT.pattern(1), "attn/max_logit/L10")
    assert keys.parse_sv("grad/wq_err_sv2/L1") == (2, 1)


# ---------------------------------------------------------------------------- the readers

def test_diagnose_table_finds_every_column(run):
    rec = read_metrics(run)[-1]                     # a probe with a previous one: growth, cos_prev
    table = format_table(rec, list(range(N_LAYER)), n_head=N_HEAD)
    cells = [c for line in table.splitlines()[2:] if not line.startswith("-") for c in line.split()]
    assert "-" not in cells, table


def test_the_monitor_sees_every_signal(run):
    # thresholds every value passes: each signal then names itself, if it found its keys
    th = MonitorThresholds(ignore_before=0, wq_growth_watch=-math.inf, growth_window=2, wq_norm_ratio_watch=0.0,
                           max_logit_watch=0.0, grad_spike_watch=0.0, grad_window=2, delta_consistency=0.0,
                           delta_window=2, grad_err_cos=-2.0, persist=1)
    mon = Monitor(th)
    reasons = " ".join(r for rec in read_metrics(run) for r in mon.update(rec).reasons)
    for signal in ("W_Q norm growth", "W_Q norm x", "max |logit|", "gradient norm", "delta error",
                   "W_Q gradient error repeats"):
        assert signal in reasons, signal


def test_the_claims_find_their_probe_series(run):
    verdicts = claims.judge_claims({}, {"paper": run}, 1, ["C5", "C6"])
    for v in verdicts:
        assert "only" not in v["evidence"] and v["numbers"]["p_sign"] <= 1.0, v
    growth = claims._norm_growth(run, 1)
    assert growth["focus_head"] in ("L1H0", "L1H1") and growth["largest_layer"] in ("L0", "L1")


def test_the_report_makes_every_figure(run, tmp_path):
    from flashguard.experiments.report.figures import make_figures
    from flashguard.experiments.report.load import load_study
    figures, skipped = make_figures(load_study([run]), tmp_path)
    assert not skipped and len(figures) == 5


@pytest.mark.parametrize("build", [plots.spectral_norms_figure, plots.tie_rate_figure, plots.delta_bias_figure,
                                   plots.singular_values_figure, plots.monitor_figure])
def test_each_plot_finds_its_data(run, build):
    fig = build(read_metrics(run))
    try:
        titles = [fig._suptitle.get_text() if fig._suptitle else ""] + [ax.get_title() for ax in fig.axes]
        assert not any("no probe metrics" in t for t in titles)
        assert any(ax.lines for ax in fig.axes)
    finally:
        plt.close(fig)


# ---------------------------------------------------------------------------- no literals

KEY_LITERAL = re.compile(r"^\^?(weights|attn|numerics|grad|loss|optim|time|event|monitor|diagnostics)/")


def _literal_keys(path: Path) -> list[str]:
    """String constants (docstrings aside) and f-string heads of ``path`` that spell a metric key."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            docstrings.add(id(node.values[0]))      # judged as the head of its f-string below
            if isinstance(node.values[0].value, str) and KEY_LITERAL.match(node.values[0].value):
                found.append(f"{path.name}:{node.lineno}: f-string {node.values[0].value!r}...")
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
              and KEY_LITERAL.match(node.value)):
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")
    return found


def test_no_module_spells_a_metric_key_itself():
    offenders = [hit for p in sorted(SRC.rglob("*.py")) if p.name != "keys.py" for hit in _literal_keys(p)]
    assert not offenders, "use flashguard.keys instead:\n" + "\n".join(offenders)
