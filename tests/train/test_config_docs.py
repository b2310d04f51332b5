"""The shipped short-document configs: found by name, valid, doc_starts on, paper arithmetic."""
from __future__ import annotations

import pytest

from flashguard.train import config_to_toml, load_config
from flashguard.train.loop import gpt_config
from flashguard.train.shipped import find_config


@pytest.mark.parametrize("name,T,batch", [("tiny-cpu-512-docs", 512, 16), ("tiny-cpu-1024-docs", 1024, 8)])
def test_docs_configs_are_shipped_and_hold_the_studys_windows(name, T, batch, tmp_path):
    cfg = load_config(find_config(name))
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg
    assert cfg.data.dir == "data/embedded-docs" and cfg.data.doc_starts is True
    assert cfg.data.batch_size == batch and batch * T == 8192     # the same tokens a step
    assert gpt_config(cfg).block_size == T and cfg.model.preset == f"tiny-cpu-{T}"
    spec = cfg.attention.spec
    assert (spec.backend, spec.precision, spec.stabilizer, spec.block_q, spec.block_k) == ("flash", "paper", "none", 512, 512)
    assert cfg.train.autocast == "bf16" and 0 < cfg.train.checkpoint_every < cfg.train.steps
