"""The training loop's hook interface and its one logger: what a hook sees, when, and that riding
along changes nothing a run writes."""
from __future__ import annotations

import json

import pytest
import torch

from flashguard import keys
from flashguard.train import ConfigError, JsonlLog, load_config, train
from flashguard.train.hooks import RunInfo, StepInfo, TrainHook
from flashguard.train.loggers import Console, JsonlMetrics, Loggers, RunLogger, run_logger

from run_helpers import MICRO, interrupted, micro_overrides

TIMES = (keys.STEP_TIME, keys.TOKENS_PER_S, keys.EVAL_TIME)


class Recorder(TrainHook):
    def __init__(self):
        self.calls = []

    def attach(self, model, cfg, rank):
        # the GPT itself (no DDP wrapper), seeded and on its device, before the optimizer sees it
        assert rank == 0 and cfg.train.steps > 0 and type(model).__name__ == "GPT"
        assert all(p.grad is None for p in model.parameters())
        self.calls.append(("attach", type(model).__name__))

    def start(self, run):
        assert isinstance(run, RunInfo) and run.main and run.world == 1
        self.calls.append(("start", run.start))

    def step_begin(self, step, model):
        self.calls.append(("begin", step))

    def after_backward(self, step):
        assert isinstance(step, StepInfo) and step.indices.dim() == 1 and step.indices.dtype == torch.long
        # the step's gradients are there, before the optimizer step
        assert all(p.grad is not None for p in step.model.parameters())
        assert set(step.record) == {keys.STEP, keys.LOSS_TRAIN, keys.LR, keys.GRAD_NORM}
        step.extra["w"] = step.model.lm_head.weight.detach().clone()
        self.calls.append(("backward", step.step))

    def after_optimizer_step(self, step):
        assert not torch.equal(step.extra["w"], step.model.lm_head.weight)  # the optimizer stepped
        assert all(p.grad is None for p in step.model.parameters())
        self.calls.append(("optimizer", step.step))

    def checkpoint(self, step, path):
        assert path.exists() and path.name == f"ckpt_{step:07d}.pt"
        self.calls.append(("checkpoint", step))

    def end(self, result):
        self.calls.append(("end", None if result is None else result.steps_done))


def _lines(run):
    return (run / "metrics.jsonl").read_text().splitlines()


def _strip(line):
    r = json.loads(line)
    return [(k, None if k in TIMES else v) for k, v in r.items()]


def test_hooks_are_called_at_their_points_and_change_nothing(tiny_data, tmp_path):
    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"data.batch_size": 4, "train.steps": 4,
                                                           "train.checkpoint_every": 2, "train.eval_every": 0}))
    rec = Recorder()
    train(cfg, tmp_path / "hooked", hooks=[rec])
    train(cfg, tmp_path / "plain")
    per_step = lambda s: [("begin", s), ("backward", s), ("optimizer", s)]  # noqa: E731
    assert rec.calls == [("attach", "GPT"), ("start", 0), *per_step(0), *per_step(1), ("checkpoint", 2), *per_step(2),
                         *per_step(3), ("checkpoint", 4), ("end", 4)]
    # the same records, keys in the same order, values equal but the timings
    assert [_strip(x) for x in _lines(tmp_path / "hooked")] == [_strip(x) for x in _lines(tmp_path / "plain")]
    assert (tmp_path / "hooked" / "batches.jsonl").read_bytes() == (tmp_path / "plain" / "batches.jsonl").read_bytes()


def test_a_hook_adds_metrics_and_keeps_records_off_the_log_grid(tiny_data, tmp_path):
    class Mark(TrainHook):
        def after_backward(self, step):
            if step.step == 3:
                step.record["my/metric"] = 1.5
                step.keep = True

    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"train.log_every": 5, "train.eval_every": 0}))
    train(cfg, tmp_path / "r", hooks=[Mark()])
    records = JsonlLog.read(tmp_path / "r" / "metrics.jsonl")
    assert [r[keys.STEP] for r in records] == [0, 3, 5]
    assert records[1]["my/metric"] == 1.5 and list(records[1])[:5] == [keys.STEP, keys.LOSS_TRAIN, keys.LR,
                                                                          keys.GRAD_NORM, "my/metric"]


def test_end_is_called_when_the_run_stops_by_an_error_and_resume_calls_start_again(tiny_data, tmp_path,
                                                                                   monkeypatch):
    cfg = load_config(MICRO, micro_overrides(tiny_data))
    rec = Recorder()
    interrupted(monkeypatch, 4, lambda: train(cfg, tmp_path / "r", hooks=[rec]))
    assert rec.calls[-2:] == [("begin", 4), ("end", None)]
    again = Recorder()
    result = train(cfg, tmp_path / "r", resume=True, hooks=[again])
    assert again.calls[:2] == [("attach", "GPT"), ("start", 3)] and again.calls[-1] == ("end", 6)
    assert result.steps_done == 6


def test_hooks_must_be_train_hooks(tiny_data, tmp_path):
    with pytest.raises(TypeError, match="TrainHook"):
        train(load_config(MICRO, micro_overrides(tiny_data)), tmp_path / "r", hooks=[object()])


def test_hooks_attach_in_order_and_a_key_that_needs_a_hook_is_refused_unless_one_claims_it(tiny_data, tmp_path):
    order = []

    class Claims(TrainHook):
        config_keys = ("train.diagnostics_layers",)

        def attach(self, model, cfg, rank):
            order.append(self)

    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"train.diagnostics_layers": "[1]", "train.steps": 1,
                                                           "train.eval_every": 0}))
    with pytest.raises(ConfigError, match=r"^train\.diagnostics_layers = \[1\] needs the hook "
                                          r"flashguard\.diagnostics\.DiagnosticsHook\b"):
        train(cfg, tmp_path / "r", hooks=[TrainHook()])
    first, second = Claims(), Claims()
    assert train(cfg, tmp_path / "r", hooks=[first, second]).steps_done == 1   # claimed: accepted
    assert order == [first, second]


def test_the_loop_names_none_of_its_plug_ins():
    import flashguard.train.loop as loop
    from flashguard.train.config import HOOK_KEYS
    text = open(loop.__file__).read()
    assert "inject" not in text.lower() and "update_entropy" not in text and "UpdateEntropy" not in text
    assert text.count("diagnostics") == 1   # the docstring's one example of a hook
    assert not [k for k in HOOK_KEYS if k in text]


def test_one_logger_interface(tmp_path):
    cfg = load_config(MICRO, ["train.progress=false", "train.tensorboard=false"])
    log = run_logger(cfg, tmp_path, main=True, log_fn=(lines := []).append)
    assert [type(x) for x in log.loggers] == [JsonlMetrics, Console]
    record = {keys.STEP: 0, keys.LOSS_TRAIN: 1.0, keys.TOKENS_PER_S: 5.0}
    log.metrics(record)
    log.progress(record)
    log.message("hello")
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps(record) + "\n" and lines == ["hello"]
    elsewhere = run_logger(cfg, tmp_path / "other", main=False)
    assert isinstance(elsewhere, Loggers) and elsewhere.loggers == []
    elsewhere.metrics(record)
    elsewhere.message("dropped")
    assert not (tmp_path / "other").exists()
    assert isinstance(log, RunLogger)
    with pytest.raises(ConfigError, match="tensorboard"):
        import builtins
        real = builtins.__import__

        def no_tb(name, *a, **kw):
            if name.startswith("torch.utils.tensorboard"):
                raise ImportError(name)
            return real(name, *a, **kw)
        builtins.__import__ = no_tb
        try:
            run_logger(load_config(MICRO, ["train.tensorboard=true"]), tmp_path, main=True)
        finally:
            builtins.__import__ = real
