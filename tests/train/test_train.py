"""Training runs on a micro model: completion, resume == uninterrupted, replay, divergence,
kill -9, bad input and two processes under torchrun."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flashguard.cli import main
from flashguard.train import EXIT_DIVERGED, JsonlLog, list_checkpoints, load_config, train

from run_helpers import ROOT, interrupted, micro_overrides

MICRO = ROOT / "configs" / "micro.toml"


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss/train"] for r in JsonlLog.read(run / "metrics.jsonl")}


def test_train_runs_and_writes_the_run_folder(tiny_data, tmp_path):
    run = tmp_path / "run"
    assert main(["train", str(MICRO), "--out", str(run)] + micro_overrides(tiny_data)) == 0
    recs = JsonlLog.read(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(6))
    assert all(k in recs[0] for k in ("loss/train", "optim/lr", "grad/norm", "time/tokens_per_s"))
    assert "loss/val" in recs[2] and "loss/val" in recs[5]
    assert recs[-1]["loss/train"] < recs[0]["loss/train"]
    assert [s for s, _ in list_checkpoints(run)] == [3, 6]
    assert (run / "checkpoints" / "best.pt").exists()
    assert load_config(run / "config.toml").train.steps == 6
    assert len(JsonlLog.read(run / "batches.jsonl")) == 6
    # a second run into the same folder is refused (no data is lost)
    assert main(["train", str(MICRO), "--out", str(run)] + micro_overrides(tiny_data)) == 2


def test_resume_equals_uninterrupted_bit_for_bit(tiny_data, tmp_path, monkeypatch):
    full = tmp_path / "full"
    train(load_config(MICRO, micro_overrides(tiny_data)), full)
    crashed = tmp_path / "crashed"
    interrupted(monkeypatch, 4, lambda: train(load_config(MICRO, micro_overrides(tiny_data)), crashed))
    assert max(_losses(crashed)) == 3  # step 3 ran after the checkpoint at 3 and will be redone
    train(load_config(MICRO, micro_overrides(tiny_data)), crashed, resume=True)
    assert _losses(crashed) == _losses(full)  # exact equality of floats
    assert JsonlLog.read(crashed / "batches.jsonl") == JsonlLog.read(full / "batches.jsonl")


def test_attn_dropout_trains_and_resumes_bit_for_bit(tiny_data, tmp_path, monkeypatch):
    """model.attn_dropout = 0.1 (saved in config.toml) changes the losses of the micro run, and a
    crashed run resumes to exactly the uninterrupted one's: the masks' seeds come from torch's
    generator, whose state the checkpoint holds."""
    over = micro_overrides(tiny_data, **{"model.attn_dropout": 0.1})
    full, plain = tmp_path / "full", tmp_path / "plain"
    train(load_config(MICRO, over), full)
    assert load_config(full / "config.toml").model.attn_dropout == 0.1
    train(load_config(MICRO, micro_overrides(tiny_data)), plain)
    assert load_config(plain / "config.toml").model.attn_dropout == 0.0
    assert _losses(full)[0] != _losses(plain)[0]
    crashed = tmp_path / "crashed"
    interrupted(monkeypatch, 4, lambda: train(load_config(MICRO, over), crashed))
    train(load_config(MICRO, over), crashed, resume=True)
    assert _losses(crashed) == _losses(full)  # exact equality of floats
    vals = lambda run: [r["loss/val"] for r in JsonlLog.read(run / "metrics.jsonl") if "loss/val" in r]  # noqa: E731
    assert vals(crashed) == vals(full)


def test_replay_uses_the_logged_batches(tiny_data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(load_config(MICRO, micro_overrides(tiny_data)), a)
    train(load_config(MICRO, micro_overrides(tiny_data, **{"train.seed": 99})), b, replay=a)
    assert JsonlLog.read(a / "batches.jsonl") == JsonlLog.read(b / "batches.jsonl")
    c = tmp_path / "c"
    train(load_config(MICRO, micro_overrides(tiny_data, **{"train.seed": 99})), c)
    assert JsonlLog.read(c / "batches.jsonl") != JsonlLog.read(a / "batches.jsonl")


def test_divergence_stops_with_its_exit_code_and_a_bundle(tiny_data, tmp_path):
    run = tmp_path / "run"
    code = main(["train", str(MICRO), "--out", str(run)]
                + micro_overrides(tiny_data, **{"train.divergence_loss": 6.0, "optim.lr": 0.5, "train.steps": 30,
                                                 "train.checkpoint_every": 1, "optim.warmup_steps": 0}))
    assert code == EXIT_DIVERGED
    bundle = json.loads((run / "divergence.json").read_text())
    step = bundle["step"]
    assert step >= 1 and len(bundle["batch_indices"]) == 8 and bundle["loss"] > 6.0
    # the last checkpoint is the last good step; nothing was saved from the diverged step
    assert max(s for s, _ in list_checkpoints(run)) == step
    assert JsonlLog.read(run / "metrics.jsonl")[-1]["event/diverged"] == 1
    # offline readers apply the same rule (this run's ceiling, and the default factor 2 it did not set)
    from flashguard.diagnostics import evaluate_run
    from flashguard.experiments.runs import summarize_run
    offline = summarize_run(run)["diverged_at"]
    assert offline == evaluate_run(run).divergence_step and offline <= step


def test_divergence_can_continue(tiny_data, tmp_path):
    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"train.divergence_loss": 0.1,
                                                           "train.on_divergence": '"continue"'}))
    result = train(cfg, tmp_path / "run")
    assert result.diverged and result.steps_done == 6


@pytest.mark.parametrize("extra,msg", [
    ({"data.dir": '"/nonexistent/data"'}, "data.dir"),
    ({"model.vocab_size": 100}, "vocab"),
    ({"model.block_size": 10**6}, "block_size"),
    ({"train.bogus": 1}, "train.bogus"),
    ({"train.steps": '"many"'}, "train.steps"),
    ({"model.attn_dropout": 1.0}, ("attn_dropout", "[0, 1)", "1.0")),   # the key, its range, the value
    ({"model.attn_dropout": '"high"'}, ("model.attn_dropout", "float")),
])
def test_bad_input_is_one_clear_line(tiny_data, tmp_path, capsys, extra, msg):
    code = main(["train", str(MICRO), "--out", str(tmp_path / "run")] + micro_overrides(tiny_data, **extra))
    err = capsys.readouterr().err.strip().splitlines()
    parts = msg if isinstance(msg, tuple) else (msg,)
    assert code == 2 and len(err) == 1 and all(p in err[0] for p in parts), err


def test_kill_minus_9_loses_at_most_the_steps_since_the_last_checkpoint(tiny_data, tmp_path):
    over = micro_overrides(tiny_data, **{"train.steps": 200, "train.checkpoint_every": 10, "train.eval_every": 0})
    ref = tmp_path / "ref"
    victim = tmp_path / "victim"
    cmd = [sys.executable, "-m", "flashguard.cli", "train", str(MICRO)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(cmd + ["--out", str(victim)] + over, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and len(list_checkpoints(victim)) < 2:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = max(s for s, _ in list_checkpoints(victim))
    assert 10 <= saved < 200
    logged = max(_losses(victim))
    assert logged >= saved - 1  # nothing before the checkpoint was lost
    assert subprocess.run(cmd + ["--out", str(victim), "--resume"] + over, env=env,
                          capture_output=True).returncode == 0
    subprocess.run(cmd + ["--out", str(ref)] + over, env=env, capture_output=True, check=True)
    assert _losses(victim) == _losses(ref)


def test_two_processes_match_one(tiny_data, tmp_path):
    over = micro_overrides(tiny_data, **{"train.steps": 5, "train.eval_every": 0, "train.autocast": '"fp32"',
                                         "attention.precision": '"fp32"'})
    one, two = tmp_path / "one", tmp_path / "two"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    cli = ["-m", "flashguard.cli", "train", str(MICRO)]
    subprocess.run([sys.executable] + cli + ["--out", str(one)] + over, env=env, check=True, capture_output=True)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
                         + cli + ["--out", str(two)] + over, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    a, b = _losses(one), _losses(two)
    assert sorted(a) == sorted(b) == list(range(5))
    for s in a:
        assert abs(a[s] - b[s]) <= 1e-5, (s, a[s], b[s])


def test_divergence_factor_stops_at_the_first_doubling(tiny_data, tmp_path):
    from flashguard.train.divergence import LossWatch
    run = tmp_path / "run"
    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"train.divergence_factor": 1.2, "optim.lr": 0.5,
                                                           "train.steps": 30, "optim.warmup_steps": 0}))
    result = train(cfg, run)
    recs = JsonlLog.read(run / "metrics.jsonl")
    watch = LossWatch(1.2)
    first = next(r["step"] for r in recs if watch.update(r["step"], r["loss/train"], r["grad/norm"]))
    assert result.diverged and recs[-1]["step"] == first and recs[-1]["event/diverged"] == 1
    assert (run / "divergence.json").exists()
    # the readers of the finished run name the same step: the repro's summary (claim C1, the
    # report) and the early-warning monitor's evaluation (its lead times)
    from flashguard.diagnostics import evaluate_run
    from flashguard.experiments.runs import summarize_run
    assert summarize_run(run)["diverged_at"] == evaluate_run(run).divergence_step == first


def test_a_triton_kernel_where_it_cannot_run_is_refused_before_training(tiny_data, tmp_path, monkeypatch):
    """attention.kernel = triton on a CPU run (no interpreter): a ConfigError naming the key, no step run."""
    import flashguard.attention.triton_flash as tf
    from flashguard.train import ConfigError
    monkeypatch.setattr(tf, "interpreted", lambda: False)
    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"attention.precision": "fa2", "attention.kernel": "triton",
                                                           "train.device": "cpu"}))
    with pytest.raises(ConfigError, match=r"^attention\.kernel\W+triton\W.*\b0\b"):
        train(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("change", ["attention.backend", "attention.layers.1.backend"])
def test_the_removed_backend_name_reference_is_refused_by_key(tiny_data, tmp_path, change):
    """The math backend was called "reference" (removed in 0.2.0, CHANGELOG.md): a config.toml that
    still says backend = "reference", for every layer or for one, is refused naming its key."""
    from flashguard.train.config import config_to_toml
    new_cfg = load_config(MICRO, micro_overrides(tiny_data, **{change: "math", "train.checkpoint_every": 0,
                                                               "train.eval_every": 0}))
    text = config_to_toml(new_cfg)
    assert text.count('backend = "math"') == 1
    old_run = tmp_path / "old"
    old_run.mkdir()
    (old_run / "config.toml").write_text(text.replace('backend = "math"', 'backend = "reference"'))
    from flashguard.train import ConfigError
    with pytest.raises(ConfigError, match="'reference'") as e:
        load_config(old_run / "config.toml")
    assert str(e.value).startswith(f"{change}: ")
