"""The spectral entropy of the W_Q W_K^T update (``train.update_entropy_every``).

The signal of the 2026 preprint arXiv 2606.28116, which reports that it falls long before a
divergence; implemented here from its definition:

* per layer and head h, A_h = W_Q,h W_K,h^T, the bilinear form of the head's attention logits
  (logit of query x and key y = x A_h y^T / sqrt(D)), (n_embd, n_embd), of rank <= D = head dim.
  Here W_Q,h is the head's query projection as an (n_embd, D) map, i.e. the transpose of
  ``model.wq_heads(layer)[h]`` (the probes' per-head slices, flashguard.model.heads), so
  A_h = wq_heads[h]^T wk_heads[h]. Biases and a qk-LayerNorm (``model.qk_layernorm``) are not in
  A_h: with qk-LayerNorm it is the product of the projections, not the logits' exact form;
* the update U_h = A_h(t) - A_h(t - 1) between consecutive optimizer steps;
* its singular values s_i, p_i = s_i / sum_j s_j, and H = -sum_i p_i log p_i / log r: the
  normalised spectral entropy, in [0, 1]. Low H: an update concentrated in few directions
  (0: rank one); 1: r equal singular values.

r, the normaliser, is the largest rank U_h can have: r = min(2 D, n_embd). A_h has rank <= D, but
the difference of two of them has rank <= 2 D (the column spaces of W_Q,h(t) and W_Q,h(t - 1)
differ), and a real optimizer step (Adam moves every row of W_Q and W_K) reaches it; with log D as
the normaliser H would exceed 1 (up to log 2D / log D) on ordinary updates.

What is logged: ``weights/update_entropy/L<l>`` (flashguard.keys.UPDATE_ENTROPY), the minimum of
H over the layer's heads, for every layer. When: at the steps s with s % every == 0, in
``after_backward`` (after the step's backward, before its optimizer step), from the weights then
(those after step s - 1's optimizer step) against the weights this hook kept at the previous
computed step s - every (before that step's optimizer step). So with every = 1 the record of step
s carries the update of optimizer step s - 1; with every = k > 1 the update spans the k optimizer
steps s - k .. s - 1 (their sum, not one step's). Nothing is logged at the first computed step
(no previous weights), nor at the first one after a resume (the hook keeps its copies in memory
only), nor for a layer whose weights did not change (a step the divergence rule skipped: an empty
update has no entropy) or are not finite.

The kept weights are fp64 copies of W_Q and W_K (2 x n_embd^2 values per layer; A_h is their
product, so keeping them is exact and H times smaller than keeping the A_h). The singular values
of U_h = P^T K, P = [W_Q,h(t); -W_Q,h(t-1)], K = [W_K,h(t); W_K,h(t-1)] (rows stacked, (2D, n_embd)
each), are those of the (2D, 2D) matrix R_P R_K^T of the QR factors P^T = Q_P R_P, K^T = Q_K R_K:
no (n_embd, n_embd) matrix is formed. The hook only reads the weights, under ``torch.no_grad``, and
draws no random numbers: training is bit-identical with it on and off (tests/experiments/
test_detectors_new.py). Only the main process computes it.
"""
from __future__ import annotations

import math

import torch

from .. import keys
from ..train.hooks import RunInfo, StepInfo, TrainHook

__all__ = ["normalised_entropy", "update_singular_values", "update_entropies", "UpdateEntropyHook"]


def normalised_entropy(s, max_rank: int) -> float:
    """H = -sum p_i log p_i / log ``max_rank``, p_i = s_i / sum s (singular values ``s``, >= 0; 0 log 0
    = 0). NaN when sum s = 0 (no update) or ``max_rank`` < 2 (one direction at most: no entropy)."""
    s = torch.as_tensor(s, dtype=torch.float64).flatten()
    if max_rank < 2 or not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        return math.nan
    total = float(s.sum())
    if not total > 0:
        return math.nan
    p = s[s > 0] / total
    h = float(-(p * p.log()).sum()) / math.log(max_rank)
    return min(max(0.0, h), 1.0)   # rounding of the sum only (and no -0.0)


def update_singular_values(wq1: torch.Tensor, wk1: torch.Tensor, wq0: torch.Tensor, wk0: torch.Tensor) -> torch.Tensor:
    """Singular values, (H, min(2D, C)), of U_h = wq1[h]^T wk1[h] - wq0[h]^T wk0[h] for per-head slices
    (H, D, C) as ``model.wq_heads`` gives them (new: 1, previous: 0), in fp64."""
    f = torch.float64
    p = torch.cat([wq1.to(f), -wq0.to(f)], dim=-2)          # (H, 2D, C)
    k = torch.cat([wk1.to(f), wk0.to(f)], dim=-2)           # (H, 2D, C)
    r_p = torch.linalg.qr(p.transpose(-1, -2), mode="r").R  # (H, m, 2D), m = min(C, 2D)
    r_k = torch.linalg.qr(k.transpose(-1, -2), mode="r").R
    return torch.linalg.svdvals(r_p @ r_k.transpose(-1, -2))  # (H, m)


def update_entropies(wq1, wk1, wq0, wk0) -> list[float]:
    """H of each head's W_Q W_K^T update (NaN for a head whose weights did not change)."""
    _, d, c = wq1.shape
    r = min(2 * d, c)
    sv = update_singular_values(wq1, wk1, wq0, wk0)
    out = []
    for h in range(wq1.shape[0]):
        same = torch.equal(wq1[h], wq0[h]) and torch.equal(wk1[h], wk0[h])
        out.append(math.nan if same else normalised_entropy(sv[h], r))
    return out


class UpdateEntropyHook(TrainHook):
    """Writes ``weights/update_entropy/L<l>`` (min over heads of H) every ``train.update_entropy_every``
    steps into the step's record (and keeps that record); does nothing when the key is 0.
    ``DiagnosticsHook`` includes one, so ``flashguard train`` and the repro runs have it."""

    config_keys = ("train.update_entropy_every",)

    def __init__(self):
        self.every = 0
        self.model = None
        self._prev: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def start(self, run: RunInfo) -> None:
        self.every = int(getattr(run.cfg.train, "update_entropy_every", 0) or 0) if run.main else 0
        self.model = run.model
        self._prev = {}   # a resumed run starts without previous weights: its first computed step logs nothing

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def measure(self) -> dict:
        """{key: min H over heads} for the layers with an update since the kept weights; keeps the
        current weights for the next call."""
        out = {}
        for layer in range(self.model.config.n_layer):
            wq, wk = self.model.wq_heads(layer), self.model.wk_heads(layer)
            wq1, wk1 = wq.to(torch.float64, copy=True), wk.to(torch.float64, copy=True)
            prev = self._prev.get(layer)
            self._prev[layer] = (wq1, wk1)
            if prev is None or not (bool(torch.isfinite(wq1).all()) and bool(torch.isfinite(wk1).all())
                                    and bool(torch.isfinite(prev[0]).all()) and bool(torch.isfinite(prev[1]).all())):
                continue
            hs = [h for h in update_entropies(wq1, wk1, *prev) if not math.isnan(h)]
            if hs:
                out[keys.UPDATE_ENTROPY.key(layer)] = min(hs)
        return out

    def after_backward(self, step: StepInfo) -> None:
        if not self.due(step.step):
            return
        found = self.measure()
        if found:
            step.record.update(found)
            step.keep = True

    def end(self, result) -> None:
        self._prev = {}
