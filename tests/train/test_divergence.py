"""The divergence rule shared by the trainer and the run summaries."""
import math

import pytest

from flashguard.train.divergence import LossWatch


@pytest.mark.parametrize("losses, after, expect", [
    ([5.0, 3.0, 2.0, 1.0, 1.9, 2.0], 0, 5),           # 2.0 >= 2 x 1.0 at step 5
    ([5.0, 3.0, 2.0, 1.0, 1.9, 1.99], 0, None),       # just under
    ([5.0, 1.0, 2.5, 2.2], 2, None),                  # the dip at step 1 is in the warm-up: ignored
    ([5.0, 1.0, 2.0, 4.0], 2, 3),                     # min 2.0 from step 2; 4.0 doubles it
    ([3.0, float("nan"), 1.0], 0, 1),                 # non-finite always counts
])
def test_first_divergent_step(losses, after, expect):
    w = LossWatch(2.0, after=after)
    hits = [s for s, x in enumerate(losses) if w.update(s, x) is not None]
    assert (hits[0] if hits else None) == expect


def test_factor_none_counts_only_non_finite_and_names_the_reason():
    w = LossWatch(None)
    assert w.update(0, 1.0) is None and w.update(1, 100.0) is None
    why = w.update(2, 1.0, grad_norm=math.inf)
    assert why is not None and "non-finite" in why
    w = LossWatch(1.5)
    w.update(0, 2.0)
    assert "1.5 x its running minimum 2" in w.update(1, 3.0)


def test_the_ceiling_is_part_of_the_rule():
    w = LossWatch(None, ceiling=3.0)
    assert w.update(0, 3.0) is None
    assert "train.divergence_loss 3" in w.update(1, 3.5)


def _recs(losses, extra=None):
    """Trainer records of these losses; ``extra``: step -> more keys of that record."""
    return [{"step": s, "loss/train": x, "grad/norm": 1.0, **(extra or {}).get(s, {})} for s, x in enumerate(losses)]


def test_find_divergence_replays_the_watch_over_records():
    from flashguard.train.divergence import find_divergence
    losses = [5.0, 3.0, 2.0, 1.0, 1.9, 2.0]
    assert find_divergence(_recs(losses))[0] == 5
    assert find_divergence(_recs(losses), factor=3.0) == (None, None)
    assert find_divergence(_recs([3.0, 2.0, 4.5, 1.0]), factor=None, ceiling=4.0)[0] == 2
    assert find_divergence(_recs(losses, {3: {"event/diverged": 1}}), factor=3.0)[0] == 3  # the trainer's mark
    assert find_divergence([{"step": 0}, {"loss/train": 1.0}, *_recs([1.0, float("inf")])])[0] == 1


def test_readers_take_the_rule_from_the_run_config():
    from flashguard.train.config import RunConfig
    from flashguard.train.divergence import DIVERGENCE_FACTOR, rule_of
    cfg = RunConfig()
    assert rule_of(cfg) == {"factor": DIVERGENCE_FACTOR, "after": cfg.optim.warmup_steps, "ceiling": None}
    cfg.train.divergence_factor, cfg.train.divergence_loss = 3.0, 9.0
    assert rule_of(cfg) == {"factor": 3.0, "after": cfg.optim.warmup_steps, "ceiling": 9.0}
    assert rule_of(cfg, factor=1.5)["factor"] == 1.5
    assert rule_of(None) == {"factor": DIVERGENCE_FACTOR, "after": 0, "ceiling": None}


def test_summary_and_monitor_agree_on_a_run_folder(tmp_path):
    """One event for every reader: the repro's summary (claim C1) and the monitor's lead time."""
    import json
    from flashguard.diagnostics import evaluate_run
    from flashguard.experiments.repro.summary import summarize_run
    # warm-up 10: the dip to 1.0 at step 5 does not set the minimum; from step 10 on it is 2.0;
    # a 1.6 x rise (over the monitor's former 1.5 x median rule) is no divergence, 2 x is
    losses = [5.0 - 0.3 * s for s in range(5)] + [1.0] + [2.0] * 14 + [3.2] * 10 + [4.0] + [2.0] * 5
    for folder, warmup, expect in (("w10", 10, 30), ("w0", 0, 6)):   # without warm-up 2.0 doubles the dip
        run = tmp_path / folder
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _recs(losses)))
        (run / "config.toml").write_text(f"[optim]\nwarmup_steps = {warmup}\n[train]\nsteps = {len(losses)}\n")
        s, ev = summarize_run(run), evaluate_run(run)
        assert s["diverged_at"] == ev.divergence_step == expect, (folder, s["diverged_at"], ev.divergence_step)
        assert s["status"] == "diverged" and ev.diverged
