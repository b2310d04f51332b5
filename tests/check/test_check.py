"""flashguard.check from Python: a planted leaning kernel is "high", fp32 is "none", an eager
model is reported as unmeasured, the model is left as it was, and the report is written."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import flashguard
from check_helpers import TinyLM, batches, planted_lean


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    out = tmp_path_factory.mktemp("planted")
    mp = pytest.MonkeyPatch()
    mp.setattr(F, "scaled_dot_product_attention", planted_lean)
    try:
        return flashguard.check(TinyLM(), batches(), out=out, repeats=1), out
    finally:
        mp.undo()


def test_a_planted_leaning_kernel_is_high_and_a_fix_is_recommended(planted):
    result, out = planted
    assert result.verdict == "high"
    assert [L["verdict"] for L in result.layers] == ["high", "high"]
    assert all("O leans -" in L["reason"] for L in result.layers)
    # the kernel is named after the function that replaced torch's, and torch's own pick is kept per layer
    assert result.info["kernel"].startswith("planted_lean") and [L["backend"] for L in result.layers] == ["flash"] * 2
    assert "flash" in result.info["kernel"]
    rec = result.recommendation
    assert rec["fix"] in ("fa2", "paper-fp32fwd") and "override_sdpa" in rec["plain"] and "register" in rec["hf"]
    assert rec["cost_ratio"] > 0 and f'precision="{rec["fix"]}"' in rec["plain"]
    # flashguard's kernels do not lean on these inputs; torch's SDPA on fp32 inputs is called through
    # the same replaced function, so it carries the planted lean too
    assert result.fixes["fa2"]["leans_on"] == [] and result.fixes["paper-fp32fwd"]["leans_on"] == []
    assert result.fixes["torch sdpa, fp32 inputs"]["leans_on"] == [0, 1]


def test_the_report_files_hold_the_verdicts(planted):
    result, out = planted
    d = json.loads((out / "check.json").read_text())
    assert d["verdict"] == "high" and d["recommendation"]["fix"] == result.recommendation["fix"]
    from flashguard.check.api import UNIT
    assert [L["verdict"] for L in d["layers"]] == ["high", "high"] and d["unit"] == UNIT
    md = (out / "check.md").read_text()
    assert "**Verdict: high.**" in md and "override_sdpa" in md
    assert (out / "check.png").stat().st_size > 1000
    lines = result.summary().splitlines()   # a head, a line per layer, the verdict, what to switch on
    assert [line.split()[:3] for line in lines[1:3]] == [["L0", "flash", "high"], ["L1", "flash", "high"]]
    assert lines[3].startswith("verdict: high")
    assert lines[4] == f"switch on: {result.recommendation['text']}" and result.recommendation["fix"] in lines[4]
    assert lines[5].strip() == result.recommendation["plain"]


def test_fp32_attention_is_none():
    result = flashguard.check(TinyLM(), batches(), dtype="fp32", repeats=1)
    assert result.verdict == "none", result.summary()
    assert [L["backend"] for L in result.layers] == ["flash"] * 2 and result.info["device"] == "cpu"
    assert result.info["kernel"].startswith("torch sdpa") and "flash" in result.info["kernel"] and result.fixes == {}
    assert result.recommendation["fix"] is None and "plain" not in result.recommendation   # nothing to copy


def test_an_eager_model_is_reported_as_such():
    result = flashguard.check(TinyLM(eager=True), batches(steps=1))
    assert result.verdict == "unmeasured" and result.layers == []
    assert result.info["kernel"] == "eager" and 'attn_implementation="sdpa"' in result.recommendation["text"]


def test_the_model_is_left_as_it_was():
    model = TinyLM().train()
    flashguard.check(model, batches(steps=1), fixes=False)
    assert model.training and all(p.grad is None for p in model.parameters())
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


def test_the_kernel_is_the_one_torch_dispatched():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        result = flashguard.check(TinyLM(), batches(steps=1), fixes=False)
    assert [L["backend"] for L in result.layers] == ["math", "math"]
    assert result.info["kernel"].startswith("torch sdpa") and "math" in result.info["kernel"]
    assert "flash" not in result.info["kernel"]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="dtype"):
        flashguard.check(TinyLM(), batches(), dtype="fp8")
    with pytest.raises(ValueError, match="steps"):
        flashguard.check(TinyLM(), batches(), steps=0)
    with pytest.raises(ValueError, match="no batch"):
        flashguard.check(TinyLM(), [])

    class FirstLogit(torch.nn.Module):      # an output with no loss and no (B, T, V) logits
        def __init__(self):
            super().__init__()
            self.lm = TinyLM()

        def forward(self, x):
            return self.lm(x)[..., 0]       # (B, T)
    with pytest.raises(TypeError, match="loss_fn"):
        flashguard.check(FirstLogit(), batches(steps=1))
    result = flashguard.check(FirstLogit(), batches(steps=1), fixes=False, loss_fn=lambda out, batch: out.sum())
    assert result.verdict in ("none", "low", "high")


def test_fp32_asked_of_bf16_weights_runs_them_as_they_are():
    result = flashguard.check(TinyLM().bfloat16(), batches(steps=1), dtype="fp32", fixes=False)
    assert result.info["precision_mode"].startswith("own dtype (bfloat16") and result.info["kernel_dtype"] == "bf16"


def test_the_rng_is_left_as_it_was():
    model, data = TinyLM(), batches(steps=1)      # TinyLM seeds the RNG itself
    torch.manual_seed(123)
    want = torch.rand(3)
    torch.manual_seed(123)
    flashguard.check(model, data, repeats=1)
    assert torch.equal(torch.rand(3), want)
