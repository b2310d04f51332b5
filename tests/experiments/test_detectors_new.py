"""The two detectors of issue 23 item 4 and the signal one of them reads, with known answers:
llm-foundry's KillLossSpike rule (KillLossSpikeDetector), the spectral entropy of the W_Q W_K^T
update (flashguard.diagnostics.update_entropy: the function, the hook in a micro training run,
bit-identical training with it on and off) and SpectralEntropyDetector."""
from __future__ import annotations

import math
import random

import pytest
import torch

from flashguard import keys
from flashguard.diagnostics import DiagnosticsHook, read_metrics
from flashguard.diagnostics.update_entropy import (UpdateEntropyHook, normalised_entropy, update_entropies,
                                                   update_singular_values)
from flashguard.experiments.early_warning import (KillLossSpikeDetector, SpectralEntropyDetector, default_detectors,
                                                  replay)
from flashguard.train import ConfigError, JsonlLog, list_checkpoints, load_checkpoint, load_config, train
from flashguard.train.hooks import RunInfo, StepInfo

from run_helpers import MICRO, interrupted, micro_overrides


def _losses(values, start=0):
    return [{keys.STEP: start + i, keys.LOSS_TRAIN: v} for i, v in enumerate(values)]


def _flat(n, seed=0, mean=2.0, sd=0.01):
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


# ---- KillLossSpikeDetector ---------------------------------------------------------------------

def test_kill_loss_spike_alarms_at_the_fifth_consecutive_outlier_and_not_at_four():
    base = _flat(150)
    five = _losses(base + [5.0] * 5 + _flat(50, 1))          # 2.5 x the window's mean: an outlier each time
    four = _losses(base + [5.0] * 4 + _flat(50, 1))
    reset = _losses(base + [5.0] * 4 + [2.0] + [5.0] * 4 + _flat(50, 1))   # a normal loss resets the count
    det = KillLossSpikeDetector()
    assert (det.threshold, det.window, det.patience, det.loss_cap) == (2.0, 100, 4, 10.0)
    assert det.first_alarm(five) == 154                     # the 5th outlier (steps 150..154)
    assert det.first_alarm(four) is None and det.first_alarm(reset) is None
    # a larger multiplier: 5.0 is no outlier at 3 x the mean; a smaller one alarms no later
    assert KillLossSpikeDetector(3.0).first_alarm(five) is None
    got = det.first_alarms(five, [1.5, 2.0, 3.0])
    assert got == {1.5: 154, 2.0: 154, 3.0: None}


def test_kill_loss_spike_waits_for_a_full_window_and_lets_outliers_into_it():
    early = _losses([2.0] * 50 + [9.0] * 10 + [2.0] * 10)   # outliers before the window is full: not tested
    assert KillLossSpikeDetector().first_alarm(early) is None
    # outliers enter the window (as in the source): on a flat 2.0, a loss of exactly 4.0 is an outlier
    # (>= 2 x 2.0), the next 4.0 is not (the mean is now 2.02), so doubled losses never alarm
    doubled = _losses([2.0] * 100 + [4.0] * 10)
    det = KillLossSpikeDetector()
    assert [a for _, a in replay(det, doubled)][100:] == [False] * 10
    assert det._outliers == 0
    # a non-finite loss is an outlier and stays out of the window
    nan = _losses([2.0] * 100 + [math.nan] * 5)
    assert KillLossSpikeDetector().first_alarm(nan) == 104


def test_kill_loss_spike_alarms_on_persistently_high_loss():
    # half of the window above loss_cap, from the 200th loss on (never an outlier: the loss is flat)
    high = _losses([11.0] * 300)
    assert KillLossSpikeDetector().first_alarm(high) == 199
    # the window is tested before the loss enters it: at step 250 it holds steps 150..249, 50 of them high
    rising = _losses([2.0] * 200 + [11.0] * 100)
    assert KillLossSpikeDetector(threshold=100.0).first_alarm(rising) == 250
    assert KillLossSpikeDetector(loss_cap=20.0, threshold=100.0).first_alarm(rising) is None


# ---- SpectralEntropyDetector -------------------------------------------------------------------

def _entropy_records(h0, h1, steps=60, every=5):
    """loss every step; weights/update_entropy/L0, L1 at every ``every``-th step from ``every``."""
    out = []
    for s in range(steps):
        r = {keys.STEP: s, keys.LOSS_TRAIN: 2.0}
        if s and s % every == 0:
            r[keys.UPDATE_ENTROPY.key(0)] = h0(s)
            r[keys.UPDATE_ENTROPY.key(1)] = h1(s)
        out.append(r)
    return out


def test_spectral_entropy_detector_alarms_where_the_entropy_crosses():
    falling = _entropy_records(lambda s: 0.9, lambda s: 0.9 - 0.01 * s)   # L1: 0.9 - s / 100
    det = SpectralEntropyDetector()
    assert det.threshold == 0.5 and all(0 < t < 1 for t in det.grid)
    sc = dict(det.scores(falling))
    assert set(sc) == set(range(5, 60, 5))                  # scored on the records with the key only
    assert math.isclose(sc[20], 1 - 0.7)                    # 1 - the minimum over the layers
    assert det.first_alarm(falling) == 40                   # H = 0.5 at step 40: score 0.5 >= 0.5
    assert det.first_alarms(falling, [0.3, 0.5, 0.9]) == {0.3: 20, 0.5: 40, 0.9: None}
    above = _entropy_records(lambda s: 0.9, lambda s: 0.6 + 0.001 * s)
    assert det.first_alarm(above) is None
    assert det.score({keys.STEP: 3, keys.LOSS_TRAIN: 2.0}) is None
    assert det.score({keys.STEP: 3, keys.UPDATE_ENTROPY.key(0): math.nan}) == math.inf


def _mixed_records(n=400, seed=3):
    rng = random.Random(seed)
    out = []
    for s in range(n):
        loss = 2.0 + rng.gauss(0, 0.02) + (3.0 if 300 <= s < 310 else 0.0)
        r = {keys.STEP: s, keys.LOSS_TRAIN: loss}
        if s % 10 == 0:
            r[keys.UPDATE_ENTROPY.key(0)] = 0.8 - s / 600 + rng.uniform(0, 0.02)
        out.append(r)
    return out


@pytest.mark.parametrize("make", [lambda: KillLossSpikeDetector(), lambda: KillLossSpikeDetector(1.2),
                                  lambda: SpectralEntropyDetector(0.3), lambda: SpectralEntropyDetector(0.5)])
def test_the_new_detectors_are_causal(make):
    recs = _mixed_records()
    full = replay(make(), recs)
    assert any(a for _, a in full)                          # something to be causal about
    for cut in (120, 305, 333):
        assert replay(make(), recs[:cut]) == full[:cut]


def test_both_are_default_detectors():
    names = [d.name for d in default_detectors()]
    assert "kill-loss-spike" in names and "update-entropy" in names and len(set(names)) == len(names)
    for d in default_detectors():
        assert d.about


# ---- the entropy ---------------------------------------------------------------------------------

def test_entropy_of_a_rank_one_update_is_0_and_of_equal_singular_values_1():
    assert normalised_entropy([3.0, 0.0, 0.0, 0.0], 4) == 0.0
    assert normalised_entropy([2.0] * 8, 8) == 1.0
    assert math.isclose(normalised_entropy([1.0, 1.0], 4), 0.5)       # 2 of 4 directions: log 2 / log 4
    assert math.isnan(normalised_entropy([0.0, 0.0], 4))                # no update: no entropy
    # through the weights: W_Q moved by a rank-one step, W_K fixed -> U = b (a^T W_K), rank one (in
    # fp64: an fp32 sum wq0 + step would add its own rounding, a full-rank update ~1e-7 of the weights)
    g = torch.Generator().manual_seed(0)
    H, D, C = 2, 4, 16
    f64 = torch.float64
    wq0, wk0 = torch.randn(H, D, C, generator=g, dtype=f64), torch.randn(H, D, C, generator=g, dtype=f64)
    a, b = torch.randn(H, D, 1, generator=g, dtype=f64), torch.randn(H, 1, C, generator=g, dtype=f64)
    hs = update_entropies(wq0 + 0.01 * a * b, wk0, wq0, wk0)
    assert all(abs(h) < 1e-9 for h in hs), hs
    # equal singular values: C = 2D, A(t) = diag(I, 0), A(t-1) = -diag(0, I): U = I_2D, H = 1
    D = 4
    eye = torch.eye(2 * D)
    top, bottom = eye[:D][None], eye[D:][None]               # (1, D, 2D)
    assert update_entropies(top, top, bottom, -bottom) == [pytest.approx(1.0, abs=1e-12)]
    # the factored singular values are those of the (C, C) update itself
    wq1 = wq0 + 0.01 * torch.randn(H, D, C, generator=g, dtype=f64)
    wk1 = wk0 + 0.01 * torch.randn(H, D, C, generator=g, dtype=f64)
    d = lambda q, k: q.double().transpose(-1, -2) @ k.double()     # noqa: E731
    direct = torch.linalg.svdvals(d(wq1, wk1) - d(wq0, wk0))[:, :2 * D]
    assert torch.allclose(update_singular_values(wq1, wk1, wq0, wk0), direct, rtol=1e-9, atol=1e-12)
    assert update_entropies(wq0, wk0, wq0, wk0) == [pytest.approx(math.nan, nan_ok=True)] * H   # no change


def test_the_hook_reads_only_and_draws_nothing(tiny_data, tmp_path):
    from flashguard.train import build_model
    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"train.update_entropy_every": 1}))
    model = build_model(cfg)
    hook = UpdateEntropyHook()
    hook.start(RunInfo(cfg=cfg, run_dir=tmp_path, model=model, start=0))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    first = StepInfo(step=0, model=model, indices=None, record={})
    hook.after_backward(first)
    assert first.record == {} and not first.keep            # no previous weights
    with torch.no_grad():
        model.transformer.h[1].attn.c_attn.weight.add_(0.01)
    second = StepInfo(step=1, model=model, indices=None, record={})
    hook.after_backward(second)
    assert set(second.record) == {keys.UPDATE_ENTROPY.key(1)} and second.keep   # layer 0 did not move
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if "h.1.attn.c_attn" not in k)


# ---- a micro training run ------------------------------------------------------------------------

def _trained(run):
    return {r[keys.STEP]: (r[keys.LOSS_TRAIN], r[keys.GRAD_NORM]) for r in JsonlLog.read(run / "metrics.jsonl")}


def test_a_micro_run_logs_the_entropy_and_trains_bit_identically(tiny_data, tmp_path, monkeypatch):
    off, on, every2, crashed = (tmp_path / n for n in ("off", "on", "every2", "crashed"))
    train(load_config(MICRO, micro_overrides(tiny_data)), off, log_fn=lambda m: None)
    cfg = load_config(MICRO, micro_overrides(tiny_data, **{"train.update_entropy_every": 1}))
    train(cfg, on, log_fn=lambda m: None, hooks=[DiagnosticsHook()])
    assert _trained(on) == _trained(off)                    # exact: losses and gradient norms
    a, b = (load_checkpoint(list_checkpoints(r)[-1][1])["model"] for r in (off, on))
    assert all(torch.equal(a[k], b[k]) for k in a)
    logged = {r[keys.STEP]: [r.get(keys.UPDATE_ENTROPY.key(layer)) for layer in (0, 1)] for r in read_metrics(on)}
    assert logged[0] == [None, None]                        # the first step has no previous weights
    assert all(all(isinstance(h, float) and 0 < h <= 1 for h in logged[s]) for s in range(1, 6))
    train(load_config(MICRO, micro_overrides(tiny_data, **{"train.update_entropy_every": 2})), every2,
          log_fn=lambda m: None, hooks=[DiagnosticsHook()])
    assert sorted(r[keys.STEP] for r in read_metrics(every2) if keys.UPDATE_ENTROPY.key(0) in r) == [2, 4]
    # a resumed run: its first computed step (3, the checkpoint's) logs nothing, the next ones do
    interrupted(monkeypatch, 4, lambda: train(cfg, crashed, log_fn=lambda m: None, hooks=[DiagnosticsHook()]))
    train(cfg, crashed, resume=True, log_fn=lambda m: None, hooks=[DiagnosticsHook()])
    assert _trained(crashed) == _trained(off)
    got = {r[keys.STEP]: keys.UPDATE_ENTROPY.key(0) in r for r in read_metrics(crashed)}
    assert got == {0: False, 1: True, 2: True, 3: False, 4: True, 5: True}
    # without the hook the key is refused by name
    with pytest.raises(ConfigError, match="train.update_entropy_every"):
        train(cfg, tmp_path / "nohook", log_fn=lambda m: None)
    with pytest.raises(ConfigError, match="train.update_entropy_every"):
        load_config(MICRO, micro_overrides(tiny_data, **{"train.update_entropy_every": -1}))
