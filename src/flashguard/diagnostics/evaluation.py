"""Offline evaluation of the early-warning monitor (``flashguard.diagnostics.monitor``) on runs.

``evaluate_run`` -> ``RunEvaluation`` (first watch and warning, lead time = divergence
step - first warning step, false alarm = a warning in a run that did not diverge). The
divergence step is the package's one rule, ``flashguard.train.divergence.find_divergence``
(a non-finite loss or gradient norm; loss >= 2 x its running minimum after warm-up, or the run's
own ``train.divergence_factor`` if set; loss >= the run's initial loss after the warm-up; a
gradient norm 10^3 x the warm-up's median; or a step the trainer marked ``event/diverged``): the
event that stops a run and decides the repro's claim C1. ``evaluate_runs`` summarises several
runs: lead times, how many warned >= 200 steps ahead (the goal), false-alarm rate. Command
line: ``python -m flashguard.diagnostics.evaluate`` (``.evaluate``).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import keys
from ..train.divergence import find_divergence, rule_of
from ..utils.jsonl import read_metrics
from .monitor import STATE_NAMES, WARNING, WATCH, Monitor, MonitorThresholds

__all__ = ["RunEvaluation", "evaluate_run", "evaluate_runs"]



@dataclass
class RunEvaluation:
    run: str | None
    records: int
    last_step: int | None
    diverged: bool
    divergence_step: int | None
    divergence_reason: str | None
    first_watch_step: int | None
    first_warning_step: int | None
    lead_time: int | None          # divergence_step - first_warning_step (warning before divergence)
    false_alarm: bool              # a warning although the run did not diverge
    has_probes: bool               # the run logged probe metrics (any probe key: flashguard's trainer's,
                                   # or flashguard.watch's on the user's model; else only grad/loss signals)
    warnings: list = field(default_factory=list)  # [step, reasons] at each entry into warning
    # the warning timeline next to the loss: [step, state name, loss at that step, reasons] at the
    # first record and at every change of state, up to the divergence step
    timeline: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        name = self.run or "run"
        probes = "" if self.has_probes else " (no probe metrics: grad/loss signals only)"
        if self.diverged:
            if self.lead_time is not None:
                return (f"{name}: diverged at step {self.divergence_step} ({self.divergence_reason}); first warning "
                        f"at step {self.first_warning_step}: lead time {self.lead_time} steps{probes}")
            return (f"{name}: diverged at step {self.divergence_step} ({self.divergence_reason}); no warning "
                    f"before it{probes}")
        if self.false_alarm:
            return (f"{name}: no divergence in {self.last_step} steps; FALSE ALARM: warning at step "
                    f"{self.first_warning_step}{probes}")
        return f"{name}: no divergence in {self.last_step} steps; no warning{probes}"


def _config_of(run_dir: Path):
    """The run's RunConfig from its config.toml, or None (absent or unreadable)."""
    cfg = run_dir / "config.toml"
    if not cfg.is_file():
        return None
    try:
        from ..train.config import load_config
        return load_config(cfg)
    except (ValueError, OSError):
        return None


def evaluate_run(metrics, thresholds: MonitorThresholds | None = None, *, warmup: int | None = None,
                 factor: float | None = None, name: str | None = None) -> RunEvaluation:
    """Replay a run's records (a list of dicts, a metrics.jsonl path or a run folder) through a
    Monitor and measure its lead time against the run's divergence step by the package's rule
    (``flashguard.train.divergence``: the run's warm-up, its ``train.divergence_factor`` or 2, its
    ``train.divergence_loss``, all from its config.toml; for a list of records, warm-up 0 and
    factor 2). ``warmup`` / ``factor`` override those. Without explicit thresholds:
    ``MonitorThresholds.for_warmup`` of the warm-up."""
    cfg = None
    if isinstance(metrics, (str, Path)):
        p = Path(metrics)
        run_dir = p if p.is_dir() else p.parent
        records = read_metrics(p)
        name = name or run_dir.name
        cfg = _config_of(run_dir)
    else:
        records = list(metrics)
    rule = rule_of(cfg, factor=factor)
    if warmup is not None:
        rule["after"] = int(warmup)
    th = thresholds or MonitorThresholds.for_warmup(rule["after"])
    records = sorted((r for r in records if keys.STEP in r), key=lambda r: r[keys.STEP])
    div_step, div_reason = find_divergence(records, **rule)
    mon = Monitor(th)
    first_watch = first_warning = None
    warnings, timeline = [], []
    prev = None
    for r in records:
        st = mon.update(r)
        if div_step is not None and st.step > div_step:
            break
        if st.state != prev:
            timeline.append([st.step, STATE_NAMES[st.state], r.get(keys.LOSS_TRAIN), list(st.reasons)])
        if st.state >= WATCH and first_watch is None:
            first_watch = st.step
        if st.state == WARNING and first_warning is None:
            first_warning = st.step
        if st.state == WARNING and prev != WARNING:
            warnings.append([st.step, st.reasons])
        prev = st.state
    if div_step is not None and timeline:
        loss = next((r.get(keys.LOSS_TRAIN) for r in records if r[keys.STEP] == div_step), None)
        timeline.append([div_step, "diverged", loss, [div_reason]])
    lead = None
    if div_step is not None and first_warning is not None and first_warning <= div_step:
        lead = div_step - first_warning
    return RunEvaluation(
        run=name, records=len(records), last_step=records[-1][keys.STEP] if records else None,
        diverged=div_step is not None, divergence_step=div_step, divergence_reason=div_reason,
        first_watch_step=first_watch, first_warning_step=first_warning, lead_time=lead,
        false_alarm=div_step is None and first_warning is not None,
        has_probes=any(any(keys.is_probe_key(k) for k in r) for r in records), warnings=warnings,
        timeline=timeline)


def evaluate_runs(runs, thresholds: MonitorThresholds | None = None, *, goal: int = 200) -> dict:
    """Evaluate several runs; returns {"runs": [RunEvaluation dicts], "diverged": n, "stable": n,
    "lead_times": [...], "warned_in_time": n (lead >= goal), "missed": n, "false_alarms": n,
    "false_alarm_rate": false alarms / stable runs (None without stable runs)}."""
    evals = [evaluate_run(r, thresholds) for r in runs]
    div = [e for e in evals if e.diverged]
    stable = [e for e in evals if not e.diverged]
    leads = [e.lead_time for e in div if e.lead_time is not None]
    fa = sum(e.false_alarm for e in stable)
    return {
        "runs": [e.to_dict() for e in evals],
        "diverged": len(div), "stable": len(stable), "lead_times": leads,
        "warned_in_time": sum(1 for x in leads if x >= goal), "goal_steps": goal,
        "missed": len(div) - len(leads), "false_alarms": fa,
        "false_alarm_rate": fa / len(stable) if stable else None,
    }
