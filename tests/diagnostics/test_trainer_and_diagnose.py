"""The trainer hook on the micro preset, `flashguard diagnose` on a run made by `train`, the config keys."""
from __future__ import annotations

import argparse
import json

import pytest

from run_helpers import MICRO, interrupted, micro_overrides
from flashguard.diagnostics import DiagnosticsHook, ProbeState
from flashguard.diagnostics.command import add_diagnose_arguments, run_diagnose
from flashguard.train import ConfigError, JsonlLog, config_to_toml, load_config, train

TIMING = ("time/", )


def _strip_time(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith(TIMING)}


@pytest.fixture(scope="module")
def probed_run(tiny_data, tmp_path_factory):
    """6 micro steps with probes every 3 steps on layer 1 (and the same run without probes)."""
    base = tmp_path_factory.mktemp("runs")
    probed, plain = base / "probed", base / "plain"
    logs = []
    train(load_config(MICRO, micro_overrides(tiny_data, **{"train.diagnostics_every": 3,
                                                            "train.diagnostics_layers": "[1]"})),
          probed, log_fn=logs.append, hooks=[DiagnosticsHook()])
    train(load_config(MICRO, micro_overrides(tiny_data)), plain)
    return probed, plain, logs


def test_trainer_hook_writes_probe_metrics_every_n_steps(probed_run):
    probed, _, _ = probed_run
    recs = {r["step"]: r for r in JsonlLog.read(probed / "metrics.jsonl")}
    assert sorted(recs) == list(range(6))
    for step in (0, 3):
        r = recs[step]
        for key in ("weights/wq_spectral_norm/L1H0", "weights/wk_spectral_norm/L1H1", "attn/max_logit/L1H0",
                    "attn/sink_mass/L1", "numerics/tie_rate/L1", "numerics/pbar_one/L1",
                    "numerics/o_err_bias/L1", "numerics/delta_err_mean/L1", "numerics/delta_err_pos_frac/L1",
                    "numerics/delta_err_cumsum/L1", "grad/wq_err_sv1/L1", "grad/wq_err_rank1_frac/L1",
                    "grad/wq_err_align_top/L1", "time/diagnostics_s"):
            assert key in r, key
        assert not any("/L0" in k for k in r)          # only the chosen layer
        assert r["time/diagnostics_s"] > 0 and "diagnostics/failed" not in r
    assert "weights/wq_growth/L1H0" in recs[3] and "grad/wq_err_cos_prev/L1" in recs[3]
    assert recs[3]["numerics/delta_err_cumsum/L1"] == pytest.approx(
        recs[0]["numerics/delta_err_mean/L1"] + recs[3]["numerics/delta_err_mean/L1"])
    assert not any(k.startswith("weights/") for k in recs[1])
    assert all(r["monitor/state"] in (0.0, 1.0, 2.0) for r in recs.values())
    assert [s for s, _ in ProbeState.snapshots(probed)] == [0, 3]


def test_probes_do_not_change_training(probed_run):
    probed, plain, _ = probed_run
    a = [(r["step"], r["loss/train"], r["grad/norm"]) for r in JsonlLog.read(probed / "metrics.jsonl")]
    b = [(r["step"], r["loss/train"], r["grad/norm"]) for r in JsonlLog.read(plain / "metrics.jsonl")]
    assert a == b  # bit for bit
    assert not any("monitor/state" in r for r in JsonlLog.read(plain / "metrics.jsonl"))


def _args(run, *extra):
    p = argparse.ArgumentParser()
    add_diagnose_arguments(p)
    return p.parse_args([str(run), *extra])


def test_diagnose_reproduces_the_trainers_probe_of_that_step(probed_run, tmp_path, capsys):
    probed, _, _ = probed_run
    out = tmp_path / "d3.json"
    assert run_diagnose(_args(probed, "--step", "3", "--layers", "1", "--out", str(out), "--heads")) == 0
    text = capsys.readouterr().out
    assert "W_Q max" in text and "L1H1" in text and "flash[paper,none]" in text
    res = json.loads(out.read_text())
    assert res["step"] == 3 and res["batch_step"] == 3 and res["state_continued"]
    rec = {r["step"]: r for r in JsonlLog.read(probed / "metrics.jsonl")}[3]
    assert res["metrics"] == {k: v for k, v in _strip_time(rec).items() if k in res["metrics"]}
    assert set(res["metrics"]) == {k for k in _strip_time(rec) if k.split("/")[0] in ("weights", "attn", "numerics")
                                   or k.startswith("grad/wq_err")}
    assert len(res["details"]["1"]["wq_err_spectrum"]) == 64
    assert len(res["details"]["1"]["o_err_bias_per_feature"]) == 2  # heads x head_dim


def test_diagnose_latest_checkpoint_all_layers_default_output(probed_run, capsys):
    probed, _, _ = probed_run
    assert run_diagnose(_args(probed, "--fresh", "--sequences", "2")) == 0
    res = json.loads((probed / "diagnostics" / "diagnose_0000006.json").read_text())
    assert res["step"] == 6 and res["batch_step"] == 5   # no step 6 was trained: the closest earlier batch
    assert res["layers"] == [0, 1] and res["sequences"] == 2 and not res["state_continued"]
    assert "numerics/tie_rate/L0" in res["metrics"] and "weights/wq_growth/L1H0" not in res["metrics"]
    assert "probe state" in capsys.readouterr().out   # the console says so too (state_continued false)


def test_diagnose_errors_and_monitor_mode(probed_run, tmp_path, capsys):
    probed, _, _ = probed_run
    assert run_diagnose(_args(probed, "--step", "4")) == 2
    assert "available: 3, 6" in capsys.readouterr().err
    assert run_diagnose(_args(tmp_path / "nope")) == 2
    assert run_diagnose(_args(probed, "--monitor", "--out", str(tmp_path / "m.json"))) == 0
    assert "no divergence" in capsys.readouterr().out
    assert json.loads((tmp_path / "m.json").read_text())["diverged"] is False


def test_diagnose_plots_mode_draws_the_runs_probe_series(probed_run, tmp_path, capsys):
    probed, _, _ = probed_run
    assert run_diagnose(_args(probed, "--plots")) == 0
    names = ["wq_spectral_norms", "wk_spectral_norms", "tie_rate", "delta_bias", "wq_err_singular_values", "monitor"]
    folder = probed / "diagnostics" / "plots"
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{n}.png" for n in names)
    out = capsys.readouterr().out
    assert all(f"written: {folder / n}.png" in out for n in names) and "no divergence" not in out
    assert run_diagnose(_args(probed, "--plots", "--monitor")) == 0   # both
    assert "no divergence" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_diagnose(_args(empty, "--plots")) == 2 and "metrics.jsonl" in capsys.readouterr().err


def test_resumed_run_continues_the_probes_exactly(tiny_data, tmp_path, monkeypatch, probed_run):
    probed, _, _ = probed_run
    crashed = tmp_path / "crashed"
    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"train.diagnostics_every": 3,
                                                          "train.diagnostics_layers": "[1]"}))
    interrupted(monkeypatch, 5, lambda: train(cfg, crashed, hooks=[DiagnosticsHook()]))
    train(cfg, crashed, resume=True, hooks=[DiagnosticsHook()])   # from the checkpoint at 3: redoes the probe at step 3
    a = [_strip_time(r) for r in JsonlLog.read(crashed / "metrics.jsonl")]
    b = [_strip_time(r) for r in JsonlLog.read(probed / "metrics.jsonl")]
    assert a == b


def test_config_keys_parse_round_trip_and_are_checked(tiny_data, tmp_path):
    cfg = load_config(MICRO, ["train.diagnostics_every=50", "train.diagnostics_layers=[0, 1]"])
    assert cfg.train.diagnostics_every == 50 and cfg.train.diagnostics_layers == [0, 1]
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg
    assert load_config(MICRO).train.diagnostics_every == 0 and load_config(MICRO).train.diagnostics_layers == []
    for bad, msg in (("train.diagnostics_every=-1", "train.diagnostics_every"),
                     ("train.diagnostics_layers=[-1]", "train.diagnostics_layers"),
                     ('train.diagnostics_layers=["a"]', "train.diagnostics_layers"),
                     ("train.diagnostics_layers=1", "train.diagnostics_layers must be list")):
        with pytest.raises(ConfigError, match=msg):
            load_config(MICRO, [bad])
    with pytest.raises(ConfigError, match="diagnostics_layers"):   # micro has layers 0 and 1
        train(load_config(MICRO, micro_overrides(tiny_data, **{"train.diagnostics_every": 1,
                                                               "train.diagnostics_layers": "[2]"})), tmp_path / "r",
              hooks=[DiagnosticsHook()])
    # the probes are a hook the caller passes: a run that asks for them without it is refused
    with pytest.raises(ConfigError, match=r"train\.diagnostics_every\W+1\b.*DiagnosticsHook"):
        train(load_config(MICRO, micro_overrides(tiny_data, **{"train.diagnostics_every": 1})), tmp_path / "r2")
    assert not (tmp_path / "r2").exists()


def test_training_hooks_claim_every_key_that_needs_a_hook_as_the_table_names_it():
    import importlib

    from flashguard.diagnostics import training_hooks
    from flashguard.train.config import HOOK_KEYS
    from flashguard.train.injection import InjectionHook
    hooks = training_hooks()
    assert [type(h) for h in hooks] == [InjectionHook, DiagnosticsHook]   # the injection's clock first
    claimed = {k: type(h) for h in hooks for k in h.config_keys}
    assert sum(len(h.config_keys) for h in hooks) == len(claimed) and set(claimed) == set(HOOK_KEYS)
    for key, dotted in HOOK_KEYS.items():
        module, name = dotted.rsplit(".", 1)
        assert getattr(importlib.import_module(module), name) is claimed[key], key


def test_trainer_hook_survives_a_failing_probe_and_prunes_snapshots(tmp_path, monkeypatch):
    import torch

    import flashguard.diagnostics.trainer as tr
    from flashguard.model import GPT, AttentionSpec, model_config
    cfg = load_config(MICRO, ["train.diagnostics_every=2", "optim.warmup_steps=0"])
    torch.manual_seed(0)
    model = GPT(model_config("micro"), AttentionSpec(backend="flash", precision="fp32"))
    x = torch.randint(0, 256, (2, 16))
    logs = []
    diag = tr.TrainerDiagnostics(cfg, model, tmp_path, log_fn=logs.append)

    def step(s, rec):
        diag.begin(s)
        model(x, x)[1].backward()
        diag.end(s, rec)
        return rec

    assert "time/diagnostics_s" in step(0, {"step": 0, "grad/norm": 1.0})
    assert "time/diagnostics_s" not in step(1, {"step": 1, "grad/norm": 1.0})
    assert "attend" not in model.transformer.h[0].attn.__dict__          # hooks removed
    monkeypatch.setattr(tr, "run_probes", lambda *a, **k: 1 / 0)
    for s in (2, 4):
        rec = step(s, {"step": s, "grad/norm": 1.0})
        assert rec["diagnostics/failed"] == 1.0 and rec["monitor/state"] == 0.0
    assert len([m for m in logs if "probes failed" in m]) == 1             # reported once
    monkeypatch.undo()
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "ckpt_0000007.pt").write_bytes(b"")   # the oldest kept checkpoint resumes at step 7
    step(8, {"step": 8, "grad/norm": 1.0})
    assert [s for s, _ in ProbeState.snapshots(tmp_path)] == [0, 8]      # 0 is still needed for 7
    (ckpts / "ckpt_0000007.pt").rename(ckpts / "ckpt_0000009.pt")
    step(10, {"step": 10, "grad/norm": 1.0})
    assert [s for s, _ in ProbeState.snapshots(tmp_path)] == [8, 10]     # now 8 is the one needed
    diag.begin(12)                                                       # hooks installed ...
    diag.close()                                                         # ... and removed
    assert "attend" not in model.transformer.h[0].attn.__dict__
