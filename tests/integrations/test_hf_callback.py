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
    records = read_metrics(tmp_path / "out" / "flashguard")
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


def test_flashguard_does_not_import_transformers():
    code = ("import sys, flashguard, flashguard.integrations; flashguard.watch; "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
