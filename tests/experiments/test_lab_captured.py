"""Captured problems: a run's checkpoint and logged batches, and any model through SDPA,
measured like the lab's problems with the sequence as the unit."""
from __future__ import annotations

import json

import pytest
import torch

from md_helpers import headings
from run_helpers import MICRO, micro_overrides
from flashguard.diagnostics.run_state import load_run_state
from flashguard.experiments.lab.captured import from_run, record_sdpa, run_captured
from flashguard.model import GPT, AttentionSpec, GPTConfig
from flashguard.train import load_config, train


@pytest.fixture(scope="module")
def micro_run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "micro"
    train(load_config(MICRO, micro_overrides(tiny_data)), out)
    return out


def test_from_run_captures_every_layer_of_several_batches(micro_run):
    probs = from_run(micro_run, batches=2)
    rs = load_run_state(micro_run)
    assert len(probs) == rs.model.config.n_layer
    p = probs[0]
    assert p.unit == "sequence" and p.do is not None and p.causal
    assert p.q.shape[0] == 2 * rs.config.data.batch_size and p.q.shape[2] == rs.model.config.block_size
    res = run_captured(probs, ["paper", "fa2"])
    rows = [r for r in res["rows"] if r["arithmetic"] == "paper / none"]
    assert len(rows) == len(probs) and rows[0]["o_vs_floor"]["unit"] == "sequence"
    assert rows[0]["o_vs_floor"]["n"] == p.q.shape[0] * p.q.shape[1]
    assert set(res["answers"]) == {"paper", "fa2"} and "captured problems" in res["answers"]["fa2"]["line"]
    with pytest.raises(ValueError, match="batches must be"):
        from_run(micro_run, batches=0)


def test_record_sdpa_captures_inputs_and_output_gradients():
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50)
    model = GPT(cfg, attention=AttentionSpec(backend="sdpa"))
    x = torch.randint(0, 50, (3, 16))
    original = torch.nn.functional.scaled_dot_product_attention
    with record_sdpa() as rec:
        _, loss = model(x, x)
        loss.backward()
    assert torch.nn.functional.scaled_dot_product_attention is original
    probs = rec.problems()
    assert len(probs) == 2 and all(p.do is not None and p.do.shape == p.q.shape for p in probs)
    assert probs[0].causal and probs[0].q.shape == (3, 2, 16, 16)
    m = run_captured(probs, ["fp32"])["rows"][0]
    assert m["o_mae"] < 1e-6  # fp32 arithmetic on fp32 inputs: the floor itself


def test_lab_cli_with_a_captured_run(micro_run, tmp_path, monkeypatch, capsys):
    import flashguard.experiments.lab as lab_pkg
    from flashguard.cli import main
    real = lab_pkg.run_lab
    monkeypatch.setattr(lab_pkg, "run_lab", lambda **kw: real(**{**kw, "n_rows": 64}))
    assert main(["lab", "--quick", "--out", str(tmp_path / "lab"), "--capture", str(micro_run),
                 "--capture-batches", "1"]) == 0
    assert "paper (captured):" in capsys.readouterr().out
    md = (tmp_path / "lab" / "lab.md").read_text()
    captured = json.loads((tmp_path / "lab" / "lab.json").read_text())["captured"]
    assert any(h.startswith("Captured problems") for h in headings(md))
    assert {p["unit"] for p in captured["problems"]} == {"sequence"} and "per sequence" in md   # the unit, stated
    assert main(["lab", "--quick", "--out", str(tmp_path / "x"), "--capture", str(tmp_path / "nope")]) == 2
    assert "--capture" in capsys.readouterr().err
