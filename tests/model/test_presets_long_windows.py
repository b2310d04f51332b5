"""The T = 512 and T = 1024 presets: they build and train a step; T = 1024 runs as two 512-tiles."""
import pytest
import torch

import flashguard.attention.flash as flash
from flashguard.model import GPT, AttentionSpec, model_config


@pytest.mark.parametrize("preset,T", [("tiny-cpu-512", 512), ("tiny-cpu-1024", 1024)])
def test_long_window_presets_train_one_step_in_tiles_of_512(preset, T, monkeypatch):
    cfg = model_config(preset)
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size) == (4, 4, 256, T, 256)
    tiles = []
    real = flash.tile_ranges

    def spy(n, block):
        tiles.append((n, block, len(real(n, block))))
        return real(n, block)

    monkeypatch.setattr(flash, "tile_ranges", spy)
    torch.manual_seed(0)
    model = GPT(cfg, [AttentionSpec(backend="flash", precision="paper", block_q=512, block_k=512)] * cfg.n_layer)
    x = torch.randint(0, 256, (1, T))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, torch.roll(x, -1, dims=1))
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert tiles and set(tiles) == {(T, 512, T // 512)}   # forward and backward: T / 512 query and key tiles
