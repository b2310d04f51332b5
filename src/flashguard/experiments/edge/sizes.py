"""How large each injected arm's error is next to `paper`'s own, measured, not assumed.

An arm that removes a lean "at the same size" must show it: the delta rules keep every row's
|e| (zero-mean, coherent) or the multiset of e (shuffled) exactly, but O's zero-mean arm rounds
the flipped O back to bf16 stochastically, which adds an unbiased error of its own
(flashguard.attention.injection). So on the first batch of a seed, at initialisation, each
injected arm runs one forward and backward with an observer, and this reports per arm and
point: the rms of the arithmetic's own error e, the rms of the error the run actually got
(injected - reference), their ratio, and the mean signed error over the mean |error| (the lean
per element; the unit here is the element, a description of the size, not a test).
"""
from __future__ import annotations

import torch

from ...data import TokenDataset
from ...train import load_config
from ...train.injection import install_injection
from ...train.loop import build_model
from ...train.sampling import Batches, batch_sampler

__all__ = ["injected_error_sizes"]


def _stats(e: torch.Tensor, got: torch.Tensor) -> dict:
    rms_e, rms_got = e.pow(2).mean().sqrt().item(), got.pow(2).mean().sqrt().item()
    return {"rms_own": rms_e, "rms_injected": rms_got, "ratio": rms_got / rms_e if rms_e else None,
            "lean_own": (e.mean() / e.abs().mean()).item() if e.abs().sum() else None,
            "lean_injected": (got.mean() / got.abs().mean()).item() if got.abs().sum() else None}


def injected_error_sizes(base, common, arm, seed: int) -> dict | None:
    """The error sizes of one arm (an Arithmetic whose overrides set [injection]) on seed's first
    batch at initialisation, pooled over the layers; None for an arm without injection."""
    cfg = load_config(base, [*common, *arm.overrides, f"train.seed={seed}", "train.steps=1"])
    if cfg.injection.rule == "none":
        return None
    torch.manual_seed(cfg.train.seed)
    data = TokenDataset(cfg.data.dir)
    model = build_model(cfg, data.vocab_size)
    own, got = [], []

    def observe(**kw):
        e = kw["e"]
        ref = kw["delta_ref"] if "delta_ref" in kw else kw["o_ref"]
        own.append(e.flatten())
        got.append((kw["injected"] - ref).flatten())

    clock = install_injection(model, cfg, observer=observe)
    clock.begin_step(0)
    block = model.config.block_size
    idx = Batches(cfg, data, batch_sampler(cfg), block, log=None).indices(0)  # the run's first batch
    x, y = data.batch("train", idx, block)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.autocast == "bf16"):
        _, loss = model(x, y)
    loss.backward()
    return {"point": cfg.injection.point, **_stats(torch.cat(own), torch.cat(got))}
