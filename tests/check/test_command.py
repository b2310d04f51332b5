"""`flashguard check` on the command line: a saved Hugging Face checkpoint and a flashguard
checkpoint end to end (tiny models, short sequences), and errors that name what is wrong."""
from __future__ import annotations

import json

import pytest
import torch

from flashguard.cli import main


def _run(capsys, *argv):
    rc = main(["check", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_a_missing_model_path_is_named(tmp_path, capsys):
    rc, _, err = _run(capsys, "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "o"))
    assert rc == 2 and f"--model {tmp_path / 'nope'}:" in err and "no such" in err


def test_a_folder_that_is_no_checkpoint_is_named(tmp_path, capsys):
    rc, _, err = _run(capsys, "--model", str(tmp_path), "--out", str(tmp_path / "o"))
    assert rc == 2 and f"--model {tmp_path}:" in err
    assert all(what in err for what in ("config.json", "checkpoints/", ".pt"))   # what a checkpoint would have


@pytest.fixture(scope="module")
def flashguard_ckpt(tmp_path_factory):
    from flashguard.train.config import RunConfig, config_to_dict, ModelConfig, DataConfig
    from flashguard.train.loop import build_model
    cfg = RunConfig(model=ModelConfig(preset="micro"), data=DataConfig(dir=str(tmp_path_factory.mktemp("none"))))
    torch.manual_seed(0)
    model = build_model(cfg)
    path = tmp_path_factory.mktemp("run") / "ckpt_0000000.pt"
    torch.save({"config": config_to_dict(cfg), "model": model.state_dict()}, path)
    return path


def test_a_missing_text_file_is_named_before_the_model_loads(tmp_path, capsys, flashguard_ckpt):
    rc, _, err = _run(capsys, "--model", str(flashguard_ckpt), "--text", str(tmp_path / "t.txt"), "--out",
                      str(tmp_path / "o"))
    assert rc == 2 and f"--text {tmp_path / 't.txt'}:" in err and "no such" in err


def test_a_text_too_short_says_how_many_tokens_are_needed(tmp_path, capsys, flashguard_ckpt):
    (tmp_path / "t.txt").write_text("a short text")
    rc, _, err = _run(capsys, "--model", str(flashguard_ckpt), "--text", str(tmp_path / "t.txt"), "--out",
                      str(tmp_path / "o"))
    assert rc == 2 and f"--text {tmp_path / 't.txt'}: 12 " in err and "--seq-len" in err   # the count it has


def test_a_flashguard_checkpoint_on_sdpa(tmp_path, capsys, flashguard_ckpt):
    rc, out, _ = _run(capsys, "--model", str(flashguard_ckpt), "--attn", "sdpa", "--out", str(tmp_path / "o"),
                      "--steps", "1", "--batch", "2", "--seq-len", "32", "--repeats", "1")
    assert rc == 0, out
    d = json.loads((tmp_path / "o" / "check.json").read_text())
    assert [L["backend"] for L in d["layers"]] == ["flash", "flash"] and d["kernel"].startswith("torch sdpa")
    assert d["verdict"] in ("none", "low", "high") and all("verdict" in L for L in d["layers"])
    assert "tokenizer byte" in out and f"verdict: {d['verdict']}" in out


def test_a_flashguard_checkpoint_trained_without_sdpa_is_reported(tmp_path, capsys, flashguard_ckpt):
    from flashguard.train.config import RunConfig
    if RunConfig().attention.spec.backend == "sdpa":
        pytest.skip("the default attention is sdpa")
    rc, out, _ = _run(capsys, "--model", str(flashguard_ckpt), "--out", str(tmp_path / "o"), "--steps", "1",
                      "--batch", "2", "--seq-len", "32")
    assert rc == 0 and "verdict: unmeasured" in out and "--attn sdpa" in out
    assert json.loads((tmp_path / "o" / "check.json").read_text())["kernel"] == "eager"


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300, n_positions=128)
    path = tmp_path_factory.mktemp("hf")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def test_a_hugging_face_checkpoint_with_text(tmp_path, capsys, hf_tiny):
    (tmp_path / "t.txt").write_text("attention rounds every row of its scores once. " * 60)
    rc, out, _ = _run(capsys, "--model", str(hf_tiny), "--text", str(tmp_path / "t.txt"), "--out",
                      str(tmp_path / "o"), "--seq-len", "64", "--repeats", "1")
    assert rc == 0, out
    d = json.loads((tmp_path / "o" / "check.json").read_text())
    assert d["attn_implementation"] == "sdpa" and d["kernel"].startswith("torch sdpa")
    assert [L["backend"] for L in d["layers"]] == ["flash", "flash"]
    assert d["dtype"] == "bf16" and d["precision_mode"] == "autocast"
    assert set(d["fixes"]) == {"fa2", "paper-fp32fwd", "torch sdpa, fp32 inputs"}
    assert d["verdict"] in ("none", "low", "high") and "recommendation" in d
    assert (tmp_path / "o" / "check.md").is_file() and (tmp_path / "o" / "check.png").is_file()


def test_a_hugging_face_checkpoint_in_eager_attention_is_reported(tmp_path, capsys, hf_tiny):
    rc, out, _ = _run(capsys, "--model", str(hf_tiny), "--attn", "eager", "--out", str(tmp_path / "o"),
                      "--seq-len", "64")
    assert rc == 0 and "verdict: unmeasured" in out and 'attn_implementation="sdpa"' in out
    d = json.loads((tmp_path / "o" / "check.json").read_text())
    assert d["attn_implementation"] == "eager" and d["kernel"] == "eager" and d["layers"] == []
