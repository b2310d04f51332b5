"""The early-warning evaluation (flashguard.experiments.early_warning) on synthetic streams with
known answers: spike z-scores, lead times and false alarms, the seed split, the calibration rule,
causality, the monitor replay against the package's own offline evaluation, which signal leads
(and its band), and the command on a fake runs folder laid out as the injection grid writes it."""
from __future__ import annotations

import json
import math
import random
import re

import pytest

from flashguard import keys
from flashguard.cli import main
from flashguard.diagnostics.evaluation import evaluate_run
from flashguard.experiments.early_warning import (FALSE_ALARM_TARGET, MaxLogitDetector, MonitorDetector, Run,
                                                  SpikeDetector, calibrate, choose_threshold, leading_signals,
                                                  load_runs, measure, monitor_thresholds, outcome, replay,
                                                  split_by_seed, sweep)
from flashguard.diagnostics.monitor import MonitorThresholds
from flashguard.train.divergence import find_divergence
from md_helpers import numbers
from run_helpers import cli_exit

PROBE_EVERY = 25


def _noise(n, seed, *, mean=2.0, sd=0.05):
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def _records(steps=400, *, seed=0, diverge_at=None, runaway_from=None, logit_base=20.0):
    """A run's metrics stream: noisy flat loss (step 0, the loss at initialisation, 0.5 above it: a
    run flat from its first step never learnt, which the divergence rule's initial-loss test calls
    diverged) and gradient norm every step; probes every 25 steps
    (2 layers). ``runaway_from``: the W_Q norm of L0 and the max logit grow from that step on;
    ``diverge_at``: the loss jumps to 3x there and the stream stops (as the trainer stops a run)."""
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        grow = 0.0 if runaway_from is None or s < runaway_from else (s - runaway_from) / 25.0
        loss = 2.0 + rng.gauss(0, 0.02) + (0.5 if s == 0 else 0.0)   # step 0: the loss at initialisation
        if diverge_at is not None and s == diverge_at:
            loss = 6.0
        r = {keys.STEP: s, keys.LOSS_TRAIN: loss, keys.GRAD_NORM: 1.0 + abs(rng.gauss(0, 0.05)),
             keys.LR: 3e-3, keys.MONITOR_STATE: 0.0}
        if s % PROBE_EVERY == 0:
            for layer in (0, 1):
                wq = (1.0 + 0.001 * s + rng.uniform(0, 0.01)) * (math.exp(0.3 * grow) if layer == 0 else 1.0)
                for h in (0, 1):
                    r[keys.WQ_NORM.key(layer, h)] = wq * (1.0 - 0.01 * h)
                r[keys.WQ_NORM_MAX.key(layer)] = wq
                r[keys.MAX_LOGIT.key(layer)] = logit_base * (1 + rng.uniform(0, 0.05)) * (
                    math.exp(0.5 * grow) if layer == 0 else 1.0)
                r[keys.TIE_RATE.key(layer)] = 0.01 + rng.uniform(0, 0.002)
                r[keys.DELTA_ERR_POS_FRAC.key(layer)] = 0.5 + rng.uniform(-0.02, 0.02)
                r[keys.DELTA_ERR_MEAN.key(layer)] = rng.gauss(0, 1e-8)
        out.append(r)
        if diverge_at is not None and s == diverge_at:
            break
    return out


def _run(rid, records, *, seed=1, warmup=0, injection=None):
    step, why = find_divergence(records, after=warmup)
    return Run(id=rid, path=None, seed=seed, arm=rid, warmup=warmup, steps=len(records), divergence_step=step,
               divergence_reason=why, records=records, injection=injection or {})


# ---- detectors --------------------------------------------------------------------------------

def test_spike_detector_fires_at_a_planted_10_sigma_spike():
    xs = _noise(600, 1)
    xs[400] = 2.0 + 10 * 0.05
    recs = [{keys.STEP: s, keys.LOSS_TRAIN: x} for s, x in enumerate(xs)]
    det = SpikeDetector(keys.LOSS_TRAIN, threshold=6.0)
    assert det.first_alarm(recs) == 400
    z = dict(det.scores(recs))
    assert 7 < z[400] < 14                       # about 10 sd above the previous 128 values
    assert min(z) == 128                         # scored once the window is full
    nonfinite = [dict(r) for r in recs]
    nonfinite[300][keys.LOSS_TRAIN] = math.nan
    assert det.first_alarm(nonfinite) == 300     # a non-finite value is an alarm


def test_spike_detector_on_white_noise_alarms_at_its_gaussian_rate():
    """6 sigma: P(z > 6) ~ 1e-9 per step, so no alarm in 20 x 1,000 steps; 3 sigma: the per-step
    alarm rate is close to P(z > 3) = 0.00135 (a little above: the sd is estimated from 128 values;
    about 24 alarms expected over the 17,440 scored steps, so the bounds are ~2.5 sd wide each way)."""
    det = SpikeDetector(keys.GRAD_NORM, threshold=6.0)
    n_scored = above3 = 0
    for seed in range(20):
        recs = [{keys.STEP: s, keys.GRAD_NORM: x} for s, x in enumerate(_noise(1000, 100 + seed, mean=1.0, sd=0.1))]
        assert det.first_alarm(recs) is None
        zs = [z for _, z in det.scores(recs)]
        n_scored += len(zs)
        above3 += sum(z >= 3 for z in zs)
    rate = above3 / n_scored
    assert 0.00135 * 0.5 < rate < 0.00135 * 2.5, (rate, above3)


def test_max_logit_detector_reads_the_per_layer_maximum_at_probe_steps():
    recs = _records(300, runaway_from=100)
    det = MaxLogitDetector(threshold=100.0)
    sc = dict(det.scores(recs))
    assert set(sc) == set(range(0, 300, PROBE_EVERY))
    first = det.first_alarm(recs)
    assert first is not None and first % PROBE_EVERY == 0 and sc[first] >= 100 > sc[first - PROBE_EVERY]


@pytest.mark.parametrize("make", [lambda: SpikeDetector(keys.LOSS_TRAIN, threshold=3.0),
                                  lambda: SpikeDetector(keys.GRAD_NORM, threshold=3.0),
                                  lambda: MaxLogitDetector(threshold=40.0),
                                  lambda: MonitorDetector("watch", threshold=0.5),
                                  lambda: MonitorDetector("warning", threshold=0.5)])
def test_detectors_are_causal(make):
    recs = _records(500, runaway_from=200, diverge_at=450)
    full = replay(make(), recs, warmup=20)
    for cut in (130, 260, 333):
        assert replay(make(), recs[:cut], warmup=20) == full[:cut]


def test_monitor_detector_at_scale_1_is_the_packages_monitor():
    recs = _records(600, runaway_from=150, diverge_at=560)
    ev = evaluate_run(recs, warmup=20)
    assert MonitorDetector("warning").first_alarm(recs, warmup=20, until=ev.divergence_step) == ev.first_warning_step
    assert MonitorDetector("watch").first_alarm(recs, warmup=20, until=ev.divergence_step) == ev.first_watch_step
    th = monitor_thresholds(2.0, 20)
    d = MonitorThresholds()
    assert th.ignore_before == 40 and th.max_logit_warn == 2 * d.max_logit_warn
    assert math.isclose(th.wq_norm_ratio_warn, d.wq_norm_ratio_warn ** 2)
    assert th.delta_consistency == monitor_thresholds(1.0).delta_consistency   # mechanism thresholds stay
    assert MonitorDetector("warning").first_alarms(recs, [1.0, 2.0], warmup=20) == {
        1.0: MonitorDetector("warning", 1.0).first_alarm(recs, warmup=20),
        2.0: MonitorDetector("warning", 2.0).first_alarm(recs, warmup=20)}


# ---- measures ---------------------------------------------------------------------------------

def test_lead_time_on_a_planted_divergent_stream():
    recs = _records(600, runaway_from=200, diverge_at=520)
    run = _run("div", recs)
    assert run.divergence_step == 520
    det = MaxLogitDetector(threshold=100.0)
    # max logit 20 x exp(0.5 (s - 200) / 25) (x up to 1.05) passes 100 between steps 275 and 300
    alarm = det.first_alarm(recs)
    assert alarm in (275, 300)
    m = measure([run], {"div": alarm})
    assert m["divergent"] == 1 and m["hits"] == 1 and m["lead_times"] == [520 - alarm] and m["misses"] == 0
    assert outcome(520, 520).kind == "hit" and outcome(520, 520).lead == 0   # at the step: a hit, no lead
    assert outcome(521, 520).kind == "miss" and outcome(None, 520).kind == "miss"
    assert measure([run], {"div": None})["misses"] == 1


def test_a_stable_stream_has_no_divergence_and_is_a_false_alarm_iff_an_alarm_fires():
    recs = _records(600, logit_base=30.0)
    run = _run("calm", recs)
    assert run.divergence_step is None and not run.diverged
    quiet, loud = MaxLogitDetector(threshold=100.0), MaxLogitDetector(threshold=25.0)
    assert quiet.first_alarm(recs) is None and loud.first_alarm(recs) == 0
    assert measure([run], {"calm": quiet.first_alarm(recs)})["false_alarms"] == 0
    m = measure([run], {"calm": loud.first_alarm(recs)})
    assert m["false_alarms"] == 1 and m["false_alarm_rate"] == 1.0 and m["runs"]["calm"]["kind"] == "false_alarm"


# ---- split and calibration --------------------------------------------------------------------

def test_the_split_is_by_seed_and_deterministic():
    runs = [_run(f"s{s}-{a}", _records(50, seed=s), seed=s) for s in (1, 2, 3, 4, 5, 6, 7, 8) for a in ("x", "y")]
    cal, held = split_by_seed(runs)
    assert {r.seed for r in cal} == {1, 3, 5, 7} and {r.seed for r in held} == {2, 4, 6, 8}
    shuffled = list(runs)
    random.Random(0).shuffle(shuffled)
    cal2, held2 = split_by_seed(shuffled)
    assert {r.id for r in cal2} == {r.id for r in cal} and {r.id for r in held2} == {r.id for r in held}
    assert not {r.seed for r in cal} & {r.seed for r in held}   # no seed on both sides


def test_calibration_picks_the_smallest_threshold_under_the_false_alarm_target():
    grid = [1.0, 2.0, 3.0, 4.0]
    # 10 stable runs: alarmed at threshold <= their "height" (all 10 at 1, 3 at 2, 1 at 3, none at 4)
    heights = [1] * 7 + [2, 2] + [3]
    stable = [{t: (5 if t <= h else None) for t in grid} for h in heights]
    assert FALSE_ALARM_TARGET == 0.10
    assert choose_threshold(stable, grid) == 3.0             # 1/10 = 10 % <= 10 %
    assert choose_threshold(stable, grid, target=0.0) == 4.0
    assert choose_threshold(stable, grid, target=0.3) == 2.0
    assert choose_threshold(stable, [1.0, 2.0], target=0.05) is None   # nothing meets the target ...
    # ... the fallback: the lowest rate (1/10 at 3), the smallest threshold among equals (3/10 at 2 and 2.2)
    assert choose_threshold(stable, [1.0, 2.0, 3.0], target=0.05, fallback=True) == 3.0
    fine = [1.0, 2.0, 2.2]
    three = [{t: (5 if t <= h else None) for t in fine} for h in [1] * 7 + [3] * 3]
    assert choose_threshold(three, fine, target=0.05, fallback=True) == 2.0
    assert choose_threshold([], grid) is None                          # nothing to calibrate on


def test_calibrate_uses_only_the_odd_seeds_stable_runs():
    runs = []
    for seed in (1, 2, 3, 4):
        runs.append(_run(f"s{seed}-calm", _records(400, seed=seed, logit_base=30.0 + 10 * seed), seed=seed))
        runs.append(_run(f"s{seed}-boom", _records(400, seed=seed, runaway_from=150, diverge_at=350), seed=seed))
    det = MaxLogitDetector()
    table = sweep(runs, [det])
    cal = calibrate(runs, [det], table)["max-logit"]
    # odd seeds' stable runs peak at < 42 and < 63 (x 1.05): the smallest grid value above both is 75
    assert cal["threshold"] == 75.0 and cal["met_target"] and cal["calibration_false_alarm_rate"] == 0.0
    assert cal["calibration"]["seeds"] == [1, 3] and cal["held_out"]["seeds"] == [2, 4]
    assert cal["held_out"]["divergent"] == 2 and cal["held_out"]["stable"] == 2
    # seed 4's stable run peaks near 70-74: it stays under 75, a held-out number, not a choice
    assert cal["held_out"]["false_alarms"] == 0
    # divergent runs take no part in the choice: changing their alarms changes nothing
    for r in runs:
        if r.diverged:
            table["max-logit"][r.id] = {t: None for t in table["max-logit"][r.id]}
    assert calibrate(runs, [det], table)["max-logit"]["threshold"] == 75.0
    rev = calibrate(runs, [det], table, reverse=True)["max-logit"]
    assert rev["calibration"]["seeds"] == [2, 4] and rev["threshold"] == 75.0


# ---- which signal leads -----------------------------------------------------------------------

def test_the_runaway_signal_leads_the_loss():
    runs = [_run("calm-a", _records(600, seed=1)), _run("calm-b", _records(600, seed=2)),
            _run("boom", _records(600, seed=3, runaway_from=200, diverge_at=520))]
    res = leading_signals(runs)
    assert res["divergent"] == 1 and res["stable"] == 2
    row = res["runs"][0]
    assert row["divergence_step"] == 520 and row["band_from"] == "same seed"
    assert set(row["leader"]) <= {"W_Q norm L0", "max logit"} and row["leader"]
    assert row["leads"]["W_Q norm L0"] >= 250 and row["leads"]["max logit"] >= 250
    assert row["leads"]["W_Q norm L1"] is None       # the other layer stays in its range
    assert row["leads"]["loss"] is None              # the loss leaves it only at the divergence step itself


# ---- the command on a fake runs folder ---------------------------------------------------------

CONFIG = """# flashguard run configuration (fully resolved)

[data]
dir = "{data}"
batch_size = 8

[model]
preset = "micro"
qk_layernorm = false
z_loss = 0.0

[attention]
backend = "flash"
precision = "paper"
stabilizer = "none"
kernel = "auto"

[optim]
lr = 0.003
min_lr = 2e-05
warmup_steps = 20
schedule = "constant"
beta1 = 0.9
beta2 = 0.95
eps = 1e-08
weight_decay = 0.0
grad_clip = 1.0

[train]
steps = {steps}
seed = {seed}
grad_accum = 1
autocast = "bf16"
device = "auto"
checkpoint_every = 250
keep_last = 1
eval_every = 0
eval_batches = 2
log_every = 1
divergence_factor = 2.0
on_divergence = "stop"
tensorboard = false
progress = false
diagnostics_every = 25
diagnostics_layers = []

[injection]
rule = "{rule}"
alpha = {alpha}
{p}layers = []
reference = "fp32"
"""

STEPS = 300


def _write_run(d, *, seed, rule, alpha, p=None, records):
    d.mkdir(parents=True)
    (d / "config.toml").write_text(CONFIG.format(data=d.parent, steps=STEPS, seed=seed, rule=rule, alpha=float(alpha),
                                                 p="" if p is None else f"p = {float(p)}\n"))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _grid(root, seeds):
    """runs/s<SEED>/<ARM>/ as the injection experiment lays them out: two stable arms, one that
    diverges, per seed."""
    for seed in seeds:
        base = root / "runs" / f"s{seed}"
        _write_run(base / "real-a1", seed=seed, rule="real", alpha=1, records=_records(STEPS, seed=10 * seed))
        _write_run(base / "zero-mean-a100", seed=seed, rule="zero-mean", alpha=100,
                   records=_records(STEPS, seed=10 * seed + 1))
        _write_run(base / "coherent-p1-a100", seed=seed, rule="coherent", alpha=100, p=1.0,
                   records=_records(STEPS, seed=10 * seed + 2, runaway_from=100, diverge_at=260 + seed))


def test_the_command_on_fake_run_folders(tmp_path, capsys):
    grid, more = tmp_path / "micro-grid", tmp_path / "more-seeds"
    _grid(grid, (1, 2))
    _grid(more, (4,))
    _grid(tmp_path / "elsewhere", (6,))     # a seed trained elsewhere, linked into the grid's runs/
    (grid / "runs" / "s6").symlink_to(tmp_path / "elsewhere" / "runs" / "s6")
    # being written: an unfinished run, and a folder the trainer moved aside
    _write_run(grid / "runs" / "s2" / "coherent-p0.75-a100", seed=2, rule="coherent", alpha=100, p=0.75,
               records=_records(STEPS, seed=99)[:150])
    _write_run(grid / "runs" / "s2" / "shuffled-a10.incomplete-1", seed=2, rule="shuffled", alpha=10,
               records=_records(STEPS, seed=98)[:20])
    with open(grid / "runs" / "s2" / "coherent-p0.75-a100" / "metrics.jsonl", "a") as f:
        f.write('{"step": 150, "loss/tr')          # a line cut by a kill
    out = tmp_path / "ew"
    rc = main(["early-warning", "--runs", str(grid), str(more), "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "early_warning.json").read_text())
    assert res["counts"]["runs"] == 12 and res["counts"]["divergent"] == 4 and res["counts"]["stable"] == 8
    assert res["counts"]["by_seed"] == {s: {"divergent": 1, "stable": 2, "other": 0} for s in ("1", "2", "4", "6")}
    why = {s["path"].rsplit("/", 1)[-1]: s["why"] for s in res["skipped"]}   # each folder left out, and why
    assert set(why) == {"coherent-p0.75-a100", "shuffled-a10.incomplete-1"}
    assert "not finished" in why["coherent-p0.75-a100"] and "moved aside" in why["shuffled-a10.incomplete-1"]
    div = {r["id"]: r["divergence_step"] for r in res["runs"] if r["diverged"]}
    assert div == {"micro-grid/runs/s1/coherent-p1-a100": 261, "micro-grid/runs/s2/coherent-p1-a100": 262,
                   "more-seeds/runs/s4/coherent-p1-a100": 264, "micro-grid/runs/s6/coherent-p1-a100": 266}
    assert res["split"]["calibration_seeds"] == [1] and res["split"]["held_out_seeds"] == [2, 4, 6]
    ml = res["default"]["max-logit"]
    assert ml["hits"] == 4 and ml["false_alarms"] == 0 and all(x > 0 for x in ml["lead_times"])
    assert set(res["calibrated"]) == {"monitor-warning", "monitor-watch", "loss-spike", "grad-spike", "max-logit",
                                      "kill-loss-spike", "update-entropy"}
    scored = {d["name"]: d["scored_runs"] for d in res["detectors"]}
    assert scored["update-entropy"] == 0 and scored["max-logit"] == 12 and scored["kill-loss-spike"] is None
    assert res["calibrated"]["max-logit"]["held_out"]["divergent"] == 3
    assert "monitor-warning" in res["monitor_calibration"]
    assert res["signals"]["divergent"] == 4
    for f in ("early_warning.md", "lead_times.png", "tradeoff.png"):
        assert (out / f).stat().st_size > 0
    md = (out / "early_warning.md").read_text()
    counted = re.search(r"\*\*([^*]*finished runs[^*]*)\*\*", md)[1]   # the intro's bold count
    assert numbers(counted) == [12, 4, 8, 0] and "Which signal leads" in md   # runs, divergent, stable, other
    bullets = {line.split("**")[1]: line for line in md.splitlines() if line.startswith("* **")}   # the detectors
    detectors = {d["name"]: d for d in res["detectors"]}
    assert set(detectors) <= set(bullets) and detectors["update-entropy"]["default"] == 0.5
    assert numbers(bullets["update-entropy"])[0] == 0.5                   # its default, in the list
    assert detectors["update-entropy"]["scored_runs"] == 0 and "none" in bullets["update-entropy"]   # never logged
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]   # atomic writes leave no temporaries
    printed = capsys.readouterr().out
    (line,) = [ln for ln in printed.splitlines() if ln.startswith("12 runs:")]
    assert numbers(line) == [12, 4, 8, 2]   # runs, divergent, stable, skipped
    # the same run given twice counts once; a folder that does not exist is an error
    runs, skipped = load_runs([grid, grid / "runs" / "s1"])
    assert len(runs) == 9 and sum("same config.toml" in s["why"] for s in skipped) == 3
    assert main(["early-warning", "--runs", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert cli_exit(["early-warning", "--out", str(out)]) == 2   # --runs is required


def test_one_far_out_stable_run_hides_a_signal_under_the_max_band_but_not_the_p90_band():
    calm = [_run(f"calm-{i}", _records(500, seed=10 + i)) for i in range(10)]
    far = _run("far", _records(500, seed=30, runaway_from=100))      # logits run away, the loss holds: stable
    boom = _run("boom", _records(500, seed=31, runaway_from=200, diverge_at=450))
    assert far.divergence_step is None and boom.divergence_step == 450
    runs = [*calm, far, boom]
    assert leading_signals(runs)["runs"][0]["leads"]["max logit"] is None
    p90 = leading_signals(runs, band=90)
    assert p90["band"] == 90 and p90["runs"][0]["leads"]["max logit"] >= 200


def test_only_twins_count_for_false_alarms():
    """A run that leans by design and did not diverge by the rule is 'other': its alarm is neither a
    false alarm nor a hit; a zero-mean or uninjected run that alarms is a false alarm."""
    from flashguard.experiments.early_warning.evaluate import measure
    calm = [{keys.STEP: s, keys.LOSS_TRAIN: 2.5 if s == 0 else 2.0, keys.GRAD_NORM: 1.0} for s in range(50)]
    runs = [_run("plain", calm), _run("zm", calm, injection={"rule": "zero-mean", "alpha": 100.0, "p": None}),
            _run("real1", calm, injection={"rule": "real", "alpha": 1.0, "p": None}),
            _run("coh", calm, injection={"rule": "coherent", "alpha": 10.0, "p": 1.0}),
            _run("real10", calm, injection={"rule": "real", "alpha": 10.0, "p": None})]
    assert [r.stable for r in runs] == [True, True, True, False, False]
    assert [r.other for r in runs] == [False, False, False, True, True]
    m = measure(runs, {"plain": None, "zm": 10, "real1": None, "coh": 5, "real10": None})
    assert m["stable"] == 3 and m["false_alarms"] == 1 and m["other"] == 2 and m["other_alarms"] == 1
