"""FlashguardCallback: flashguard.watch inside a Hugging Face Trainer (a tiny random GPT-2, no download)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from flashguard import keys  # noqa: E402
from flashguard.utils.jsonl import read_metrics  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, t=32, vocab=128, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, t), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32, vocab_size=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel._from_config(cfg, attn_implementation="sdpa")


def test_the_callback_writes_the_probe_metrics_in_a_trainer(tmp_path):
    pytest.importorskip("accelerate")   # transformers' Trainer needs it
    from flashguard.integrations.hf_callback import FlashguardCallback
    original = torch.nn.functional.scaled_dot_product_attention
    cb = FlashguardCallback(every=2, precision="paper")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=5, per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, learning_rate=1e-3, use_cpu=True, report_to=[],
                                          save_strategy="no", logging_steps=100, disable_tqdm=True)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), callbacks=[cb])
    trainer.train()
    assert torch.nn.functional.scaled_dot_product_attention is original
    every_step = read_metrics(tmp_path / "out" / "flashguard")
    assert [r[keys.STEP] for r in every_step] == [0, 1, 2, 3, 4]     # loss and gradient norm every step
    assert all(keys.LOSS_TRAIN in r and keys.GRAD_NORM in r and keys.MONITOR_STATE in r for r in every_step)
    records = [r for r in every_step if keys.DIAGNOSTICS_TIME in r]
    assert [r[keys.STEP] for r in records] == [0, 2, 4]
    for r in records:
        assert keys.DIAGNOSTICS_FAILED not in r
        for layer in (0, 1):      # GPT-2's two blocks, by SDPA call order
            for m in (keys.TIE_RATE, keys.PBAR_ONE, keys.MAX_LOGIT, keys.SINK_MASS):
                assert {m.key(layer), m.key(layer, 0), m.key(layer, 1)} <= set(r)
            for m in (keys.O_ERR_BIAS, keys.O_ERR_Z, keys.DELTA_ERR_MEAN, keys.DELTA_ERR_Z):
                assert m.key(layer) in r
        assert not any("/L2" in k for k in r)
    assert cb.watch.records == records and cb.watch.grad_scale == 2.0
    with pytest.raises(ValueError, match="every"):
        FlashguardCallback(every=0)
    with pytest.raises(ValueError, match="from the Trainer"):
        FlashguardCallback(optimizer=None)


def run_trainer(tmp_path, cb, steps=4, model=None, **args):
    pytest.importorskip("accelerate")
    kw = dict(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
              use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True)
    kw.update(args)
    trainer = transformers.Trainer(model=model or tiny_gpt2(), args=transformers.TrainingArguments(**kw),
                                   train_dataset=Tokens(), callbacks=[cb])
    trainer.train()
    return trainer


def test_loss_and_the_gradient_norm_before_clipping_every_step(tmp_path):
    from flashguard.integrations.hf_callback import FlashguardCallback
    said = []
    cb = FlashguardCallback(every=3, precision="fa2", log_fn=said.append)
    # clipping far below the gradient norm: the logged norm is the one before clipping, as HF's own
    trainer = run_trainer(tmp_path, cb, steps=4, max_grad_norm=1e-3, gradient_accumulation_steps=2)
    ours = read_metrics(tmp_path / "out" / "flashguard")
    hf = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert [r[keys.STEP] for r in ours] == [0, 1, 2, 3] and len(hf) == 4
    for r, h in zip(ours, hf):
        assert r[keys.GRAD_NORM] == pytest.approx(float(h["grad_norm"]), rel=1e-4) and r[keys.GRAD_NORM] > 1e-2
        assert r[keys.LOSS_TRAIN] == pytest.approx(float(h["loss"]), abs=2e-3)
    lines = [m for m in said if m.startswith("step ")]
    assert [m.split(":")[0] for m in lines] == ["step 0", "step 3"]      # the console line at probe steps
    assert "max|logit|" in lines[0] and "monitor ok" in lines[0]
    # GPT-2's packed c_attn: the W_Q / W_K norms, and the probes in fa2 as asked
    assert keys.WQ_NORM.key(1, 1) in cb.watch.records[0] and keys.WK_NORM_MAX.key(0) in cb.watch.records[0]


def _planted(**kw):
    """A monitor whose max-logit warning level every probe reaches: a planted warning."""
    from flashguard.diagnostics.monitor import MonitorThresholds
    return MonitorThresholds(max_logit_watch=1e-12, max_logit_warn=1e-9, persist=1, **kw)


def test_stop_fires_on_a_warning_and_not_on_a_healthy_run(tmp_path):
    from flashguard.integrations.hf_callback import FlashguardCallback
    cb = FlashguardCallback(every=2, precision="fa2", on_warning="stop", thresholds=_planted(), log_fn=lambda m: None)
    trainer = run_trainer(tmp_path / "planted", cb, steps=5)
    assert cb.stopped_at == 0 and trainer.state.global_step == 1      # stopped after the step that warned
    healthy = FlashguardCallback(every=2, precision="fa2", on_warning="stop", log_fn=lambda m: None)
    trainer = run_trainer(tmp_path / "healthy", healthy, steps=5)
    assert healthy.stopped_at is None and trainer.state.global_step == 5
    assert all(r[keys.MONITOR_STATE] == 0 for r in read_metrics(tmp_path / "healthy" / "out" / "flashguard"))
    with pytest.raises(ValueError, match="on_warning"):
        FlashguardCallback(on_warning="kill")


def test_skip_leaves_the_weights_of_the_step_that_warned(tmp_path):
    from flashguard.integrations.hf_callback import FlashguardCallback

    def one_step(cb, name):
        model = tiny_gpt2()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        run_trainer(tmp_path / name, cb, steps=1, model=model)
        return [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]

    cb = FlashguardCallback(every=1, precision="fa2", on_warning="skip", thresholds=_planted(), log_fn=lambda m: None)
    assert one_step(cb, "planted") == [] and cb.skipped == [0]
    healthy = FlashguardCallback(every=1, precision="fa2", on_warning="skip", log_fn=lambda m: None)
    assert one_step(healthy, "healthy") and healthy.skipped == []
    # a persisting warning is logged, not skipped again (the weights would never move)
    persist = FlashguardCallback(every=1, precision="fa2", on_warning="skip", thresholds=_planted(),
                                 log_fn=lambda m: None)
    run_trainer(tmp_path / "persist", persist, steps=3)
    assert persist.skipped == [0]
    assert [r[keys.MONITOR_STATE] for r in read_metrics(tmp_path / "persist" / "out" / "flashguard")] == [2.0] * 3


def test_flashguard_does_not_import_transformers():
    code = ("import sys, flashguard, flashguard.integrations; flashguard.watch; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
