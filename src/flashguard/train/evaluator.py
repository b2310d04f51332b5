"""The validation loss of a training run (``train.eval_every``, ``train.eval_batches``)."""
from __future__ import annotations

import torch

__all__ = ["Evaluator", "last_ce"]


def last_ce(model, loss: torch.Tensor) -> torch.Tensor:
    """The cross-entropy part of the last training loss (the model may add a z-loss)."""
    ce = getattr(model, "last_ce", None)
    return ce if ce is not None else loss


class Evaluator:
    """Mean cross-entropy over ``train.eval_batches`` batches of the val split: the same batches
    at every evaluation (a generator seeded ``train.seed + 2``), under the run's autocast, in
    eval mode and without gradients."""

    def __init__(self, cfg, data, model, device: torch.device, autocast, block: int):
        self.cfg, self.data, self.model, self.device = cfg, data, model, device
        self.autocast, self.block = autocast, block

    def due(self, done: int) -> bool:
        """Whether the run evaluates after ``done`` completed steps (every eval_every, and at the end)."""
        t = self.cfg.train
        return bool(t.eval_every) and (done % t.eval_every == 0 or done == t.steps)

    def __call__(self) -> float:
        t, d = self.cfg.train, self.cfg.data
        gen = torch.Generator().manual_seed(t.seed + 2)
        self.model.eval()
        losses = []
        with torch.no_grad(), self.autocast:
            for _ in range(t.eval_batches):
                idx = self.data.sample_indices("val", d.batch_size, self.block, gen, doc_starts=d.doc_starts)
                x, y = self.data.batch("val", idx, self.block)
                _, loss = self.model(x.to(self.device), y.to(self.device))
                losses.append(float(last_ce(self.model, loss)))
        self.model.train()
        return float(sum(losses) / len(losses))
