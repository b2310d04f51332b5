"""``flashguard diagnose RUN_DIR [--step S] [--layers 1 2] [--census] [--out FILE]``: the probes on a checkpoint.

Loads the checkpoint after S completed steps (default: the latest), rebuilds the model from
the configuration stored in it, takes the batch the run logged for step S in batches.jsonl
(the batch it trained on next; the closest earlier logged step if S has none, e.g. for the
final checkpoint), runs a forward and backward (under the run's autocast; the model in eval
mode, so without dropout) and the probes. The probe state saved by the trainer before step S
is continued when present (growth rates, delta running sum, cosine with the last probe), so
a checkpoint at a probe step reproduces the trainer's own probe record of that step.

Prints a table per layer (compact, within 100 columns: the monitor's signals and the
mechanism's trigger and lean; ``--wide``: every probe column), with an ok / watch / warning
flag per layer from the early-warning monitor's own rules (``layer_flags``: ``monitor.Monitor``
fed that layer's probe records from RUN_DIR/metrics.jsonl up to step S, then this probe) and a
legend of the columns, and writes
everything (metrics, flags, per-feature O bias, singular-value spectrum, what ran) as JSON to
--out (default RUN_DIR/diagnostics/diagnose_<S>.json).
The preconditions census (``census_table``: ties, ties at the sink, rows with >= 2 Pbar == 1, sink
mass, V one-signed at the tied keys, the row-level O and delta bias, against the study's GPT-2)
goes into the JSON; ``--census`` prints its table, else one summary line.
``--monitor`` instead replays RUN_DIR/metrics.jsonl through the early-warning monitor;
``--plots`` instead draws that log's probe series (``flashguard.diagnostics.plots``) as PNGs
into RUN_DIR/diagnostics/plots/ (both flags: both).

A watch folder (``flashguard.watch``'s ``log_dir``: watch.json, metrics.jsonl; the user's own
model, which the folder does not hold) is read as what it is: ``diagnose DIR`` shows the probe
record the watch wrote at step S (``--step``: a probe step; default the latest) in the same
table, with the monitor's flags over the watch's records up to it and the census (``--census``:
its table); ``--monitor`` replays the watch's every-step records (loss, gradient norm, probes)
through the monitor with the watch's warm-up. Every output labels it a watch folder of the
user's model, not a flashguard training run.

Wiring (flashguard.cli)::

    add_diagnose_arguments(sub.add_parser("diagnose", help="..."))
    ...
    if args.command == "diagnose":
        return run_diagnose(args)
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .. import keys

__all__ = ["add_diagnose_arguments", "run_diagnose", "diagnose", "diagnose_watch", "write_plots", "format_table",
           "layer_flags",
           "legend", "LEGEND", "main"]


def add_diagnose_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run folder made by `flashguard train`, or a watch folder of your model "
                                        "(flashguard.watch's log_dir)")
    parser.add_argument("--step", type=int, default=None,
                        help="checkpoint step (the state after that many steps; default: the latest); for a watch "
                             "folder: a probe step")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="layer indices to probe (default: all)")
    parser.add_argument("--out", default=None, help="JSON output (default RUN_DIR/diagnostics/diagnose_<step>.json)")
    parser.add_argument("--data", default=None, help="data folder (default: the run's data.dir)")
    parser.add_argument("--sequences", type=int, default=None, help="probe only the first N sequences of the batch")
    parser.add_argument("--precision", default=None,
                        help="shadow policy for every probed layer (default: each layer's own; "
                             "needed for layers that do not run flash attention)")
    parser.add_argument("--stabilizer", default=None, help="stabilizer for the shadow (default: the layer's)")
    parser.add_argument("--fresh", action="store_true",
                        help="do not continue the trainer's probe state (no growth rates or running sums)")
    parser.add_argument("--no-grad-error", action="store_true", help="skip the W_Q gradient-error probe")
    parser.add_argument("--heads", action="store_true", help="also print the per-head table")
    parser.add_argument("--wide", action="store_true",
                        help="every probe column in the per-layer table (about 240 characters wide; the default "
                             "table shows the columns the flag and the mechanism are read from, within 100)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--monitor", action="store_true",
                        help="only replay RUN_DIR/metrics.jsonl through the early-warning monitor")
    parser.add_argument("--plots", action="store_true",
                        help="only plot RUN_DIR/metrics.jsonl's probe series into RUN_DIR/diagnostics/plots/")
    parser.add_argument("--census", action="store_true",
                        help="also print the preconditions census: the study's mechanism's preconditions in this "
                             "run (the run's probes up to the checkpoint, then this one) against the study's GPT-2, "
                             "with a verdict per row (always in the --out JSON)")


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if not math.isfinite(x):
            return str(x)
        if x == 0:
            return "0"
        return f"{x:.3g}" if 1e-3 <= abs(x) < 1e5 else f"{x:.2e}"
    return str(x)


_COLUMNS = [  # (header, metric), one row per layer (--wide: all of them)
    ("W_Q max", keys.WQ_NORM_MAX),
    ("growth", keys.WQ_GROWTH_MAX),
    ("max|S|", keys.MAX_LOGIT),
    ("sink", keys.SINK_MASS),
    ("ties", keys.TIE_RATE),
    ("Pbar=1", keys.PBAR_ONE),
    ("2xPbar=1", keys.PBAR_ONE_MULTI),
    ("O bias", keys.O_ERR_BIAS),
    ("O z", keys.O_ERR_Z),
    ("O bias.sgnV", keys.O_ERR_BIAS_VSIGN),
    ("d.err rel", keys.DELTA_ERR_REL),
    ("d.err>0", keys.DELTA_ERR_POS_FRAC),
    ("d.err z", keys.DELTA_ERR_Z),
    ("d.cumsum", keys.DELTA_ERR_CUMSUM),
    ("E sv1", keys.wq_err_sv(1)),
    ("E rank1", keys.WQ_ERR_RANK1_FRAC),
    ("E rel", keys.WQ_ERR_REL),
    ("cos prev", keys.WQ_ERR_COS_PREV),
    ("align", keys.WQ_ERR_ALIGN_TOP),
]

# the default (compact) table's columns: the early-warning monitor's signals that set the flag (W_Q's
# size and growth, the logits, E's cosine with the previous probe) and the mechanism's trigger (ties)
# and lean (O z, d.err z); with layer and flag, within 100 columns for any values _fmt writes
COMPACT = ("W_Q max", "growth", "max|S|", "ties", "O z", "d.err z", "cos prev")
WIDTH = 100   # the compact table's and the legend's line width

# one line per column of the per-layer table: what a new user needs to read it
LEGEND = {
    "layer": "layer index, counting from 0 (the study's \"layer 2\" is L1)",
    "attention": "the attention the layer trained with: backend[precision,stabilizer]",
    "flag": "the early-warning monitor's state for this layer: ok, watch or warning (reasons below the table)",
    "W_Q max": "largest spectral norm of a head's query projection W_Q (the study's runaway grows it)",
    "growth": "fastest W_Q norm growth of a head since the previous probe, log-growth per 100 steps",
    "max|S|": "largest |attention logit| S = q k^T * scale (bf16 resolves 64 only to 0.25-0.5)",
    "sink": "mean attention probability on the first key",
    "ties": "share of (row, key tile) pairs whose maximum score repeats: the trigger of the bias",
    "Pbar=1": "share of softmax numerators Pbar exactly 1",
    "2xPbar=1": "share of (row, key tile) pairs with two or more Pbar exactly 1",
    "O bias": "mean error of the output O against fp64, signed (O z says whether it is beyond chance)",
    "O z": "z of O's mean error over (sequence, head) units; |z| >= 3.29 is a lean at p < 0.001",
    "O bias.sgnV": "mean over features of O's bias x sign(mean V): > 0 when O is pushed the way V points",
    "d.err rel": "mean error of delta = rowsum(dO * O) against fp64, over mean |delta|",
    "d.err>0": "share of rows whose delta error is positive (0.5: no sign preferred)",
    "d.err z": "z of delta's mean error over (sequence, head) units",
    "d.cumsum": "running sum of the mean delta error over the probes (grows when the bias is coherent)",
    "E sv1": "top singular value of E, the W_Q gradient error the attention backward causes",
    "E rank1": "share of E in its top singular value (1: rank one, as the study finds)",
    "E rel": "|E| over |dW_Q| with fp64 attention",
    "cos prev": "cosine of E with the previous probe's E (near 1: the errors add up)",
    "align": "|u1^T E v1| / |E|, (u1, v1) W_Q's top singular pair: E aimed at W_Q's top direction",
}

_HEAD_COLUMNS = [  # (header, metric), one row per head
    ("|W_Q|", keys.WQ_NORM),
    ("W_Q growth", keys.WQ_GROWTH),
    ("|W_K|", keys.WK_NORM),
    ("max|S|", keys.MAX_LOGIT),
    ("sink", keys.SINK_MASS),
    ("ties", keys.TIE_RATE),
    ("Pbar=1", keys.PBAR_ONE),
    ("E norm", keys.WQ_ERR_NORM),
    ("align", keys.WQ_ERR_ALIGN_TOP),
]


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _attention_line(attention: dict, layers: list[int]) -> str:
    """The compact table's attention column as lines above it: each attention with its layers."""
    import textwrap
    groups: dict[str, list[int]] = {}
    for layer in layers:
        groups.setdefault(attention.get(layer, ""), []).append(layer)
    text = "; ".join(f"{', '.join(f'L{l}' for l in ls)}: {a}" for a, ls in groups.items())
    return textwrap.fill("attention: " + text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def format_table(metrics: dict, layers: list[int], *, n_head: int | None = None, attention: dict | None = None,
                 flags: dict | None = None, wide: bool = True) -> str:
    """A readable per-layer (and, with ``n_head``, per-head) table of probe metrics; ``flags``
    ({layer: "ok" | "watch" | "warning"}, from ``layer_flags``) adds the flag column. ``wide``:
    every column, the attention as a column; otherwise the ``COMPACT`` columns, within ``WIDTH``
    characters, and the attention on a line above the table."""
    columns = _COLUMNS if wide else [(c, m) for c, m in _COLUMNS if c in COMPACT]
    header = ["layer"] + (["attention"] if wide else []) + (["flag"] if flags is not None else []) \
        + [c for c, _ in columns]
    rows = []
    for layer in layers:
        flag = [flags.get(layer, "-")] if flags is not None else []
        rows.append([f"L{layer}"] + ([(attention or {}).get(layer, "")] if wide else []) + flag
                    + [_fmt(metrics.get(m.key(layer))) for _, m in columns])
    out = _table(header, rows)
    if not wide and attention:
        out = _attention_line(attention, layers) + "\n" + out
    if n_head:
        header = ["head"] + [c for c, _ in _HEAD_COLUMNS]
        rows = [[f"L{layer}H{h}"] + [_fmt(metrics.get(m.key(layer, h))) for _, m in _HEAD_COLUMNS]
                for layer in layers for h in range(n_head)]
        out += "\n\n" + _table(header, rows)
    return out


def legend(flags: bool = True, *, wide: bool = True) -> str:
    """The table's columns (``wide``: every column; otherwise the compact table's), one entry each,
    wrapped to ``WIDTH`` characters (a long entry continues indented under its text)."""
    import textwrap
    names = ["layer", "attention"] + (["flag"] if flags else []) + [c for c, _ in _COLUMNS if wide or c in COMPACT]
    width = max(len(n) for n in names)
    hang = " " * (width + 4)
    return "\n".join(["columns:"] + [textwrap.fill(f"  {n:<{width}}  {LEGEND[n]}", WIDTH, subsequent_indent=hang,
                                                    break_on_hyphens=False) for n in names])


def _layer_record(record: dict, layer: int) -> dict:
    """The record with only ``layer``'s probe keys (and the step)."""
    out = {keys.STEP: record.get(keys.STEP)}
    for k, v in record.items():
        parsed = keys.parse(k)
        if parsed is not None and parsed[1] == layer:
            out[k] = v
    return out


def layer_flags(history: list[dict], metrics: dict, step: int, layers: list[int], thresholds=None) -> dict:
    """``{layer: MonitorStatus}``: per layer, a fresh ``monitor.Monitor`` (``thresholds``, default
    the monitor's own) fed that layer's probe keys of the ``history`` records before ``step``,
    in order, then ``metrics`` as the record of ``step``. The monitor's rules and thresholds
    decide; nothing is judged here. Only probe keys are fed: the gradient-norm spike belongs to
    the whole model, not to a layer."""
    from .monitor import Monitor
    out = {}
    for layer in layers:
        mon = Monitor(thresholds)
        for rec in history:
            if isinstance(rec.get(keys.STEP), int) and rec[keys.STEP] < step:
                mon.update(_layer_record(rec, layer))
        out[layer] = mon.update(_layer_record({**metrics, keys.STEP: step}, layer))
    return out


def _clean(x):
    """JSON-safe: non-finite floats become None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def diagnose(run_dir, *, step: int | None = None, layers=None, data_dir=None, sequences: int | None = None,
             precision=None, stabilizer=None, fresh: bool = False, grad: bool = True, device: str = "cpu") -> dict:
    """Run the probes on a checkpoint of ``run_dir``; returns the result dict written by the command.
    A watch folder: its recorded probe at ``step`` (``diagnose_watch``)."""
    import torch

    from .run_state import is_watch_folder
    if is_watch_folder(run_dir):
        return diagnose_watch(run_dir, step=step, layers=layers)

    from .capture import capture_batch, resolve_layers
    from .probes import run_probes
    from .run_state import load_run_state, logged_batches
    from .state import ProbeState

    run_dir = Path(run_dir)
    rs = load_run_state(run_dir, step, data_dir=data_dir, device=device)
    model, cfg, ckpt_step, ckpt_path = rs.model, rs.config, rs.step, rs.checkpoint
    layers = resolve_layers(model.config.n_layer, layers)
    ((batch_step, indices),) = logged_batches(run_dir, ckpt_step)
    if sequences is not None:
        if sequences < 1:
            raise ValueError(f"--sequences must be >= 1, got {sequences}")
        indices = indices[:sequences]
    x, y = rs.data.batch("train", torch.tensor(indices, dtype=torch.long), model.config.block_size)
    caps, loss = capture_batch(model, x, y, layers, autocast=cfg.train.autocast)
    pstate = None if fresh else ProbeState.load_before(run_dir, ckpt_step)
    continued = pstate is not None
    pstate = pstate or ProbeState()
    details: dict = {}
    metrics = run_probes(model, caps, state=pstate, step=ckpt_step, grad=grad, precision=precision,
                         stabilizer=stabilizer, details=details)
    attention = {i: model.transformer.h[i].attn.spec.short_str() for i in layers}
    if precision is not None or stabilizer is not None:
        attention = {i: f"{a} (shadow: {precision or 'own'}, {stabilizer or 'own'})" for i, a in attention.items()}
    # the monitor judges a layer by its history: the run's own probe records up to this step
    from ..utils.jsonl import read_metrics
    from .monitor import MonitorThresholds
    history = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    flags = layer_flags(history, metrics, ckpt_step, layers, MonitorThresholds.for_warmup(cfg.optim.warmup_steps))
    from .census_table import census_from_records
    before = [r for r in history if isinstance(r.get(keys.STEP), int) and r[keys.STEP] < ckpt_step]
    found = census_from_records(before + [{**metrics, keys.STEP: ckpt_step}], layers)
    probes = {i: sum(1 for r in history if isinstance(r.get(keys.STEP), int) and r[keys.STEP] < ckpt_step
                     and len(_layer_record(r, i)) > 1) + 1 for i in layers}
    return {
        "run_dir": str(run_dir), "checkpoint": str(ckpt_path), "step": ckpt_step, "batch_step": batch_step,
        "sequences": len(indices), "layers": layers, "attention": attention, "loss": loss,
        "autocast": cfg.train.autocast, "state_continued": continued, "n_head": model.config.n_head,
        "versions": {"torch": torch.__version__}, "metrics": metrics, "details": details,
        "flags": {i: {"state": f.name, "reasons": f.reasons, "probes": probes[i]} for i, f in flags.items()},
        "census": None if found is None else found.to_dict(),
    }


def _probe_records(history: list[dict]) -> list[dict]:
    return [r for r in history if isinstance(r.get(keys.STEP), int) and any(keys.is_probe_key(k) for k in r)]


def diagnose_watch(run_dir, *, step: int | None = None, layers=None) -> dict:
    """A watch folder's probe record at ``step`` (default the latest) as ``diagnose``'s result: the
    probes the watch ran while the user's model trained (the folder holds no model to rerun),
    the monitor's flags over the watch's records up to that step, the census."""
    import torch

    from ..utils.jsonl import read_metrics
    from .census_table import census_from_records
    from .monitor import MonitorThresholds
    from .run_state import WATCH_LABEL, watch_meta

    run_dir = Path(run_dir)
    meta = watch_meta(run_dir) or {}
    history = read_metrics(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    probes = _probe_records(history)
    if not probes:
        raise ValueError(f"{run_dir}: {WATCH_LABEL}, with no probe record yet (it probes every "
                         f"{meta.get('every', '?')} steps from step {meta.get('start', 0)})")
    if step is None:
        rec = probes[-1]
    else:
        rec = next((r for r in reversed(probes) if r[keys.STEP] == step), None)
        if rec is None:
            steps = [r[keys.STEP] for r in probes]
            shown = ", ".join(str(s) for s in (steps if len(steps) <= 12 else steps[:5] + ["..."] + steps[-5:]))
            raise ValueError(f"{run_dir}: {WATCH_LABEL}: no probe at step {step}; probe steps: {shown}")
    step = rec[keys.STEP]
    metrics = {k: v for k, v in rec.items() if keys.is_probe_key(k)}
    found = sorted({p[1] for p in map(keys.parse, metrics) if p is not None})
    if layers:
        missing = [i for i in layers if i not in found]
        if missing:
            raise ValueError(f"{run_dir}: the watch did not probe layer(s) {missing} at step {step} "
                             f"(probed: {', '.join(f'L{i}' for i in found)})")
        layers = sorted(set(layers))
    else:
        layers = found
    heads = [p[2] for p in map(keys.parse, metrics) if p is not None and p[2] is not None]
    measured = meta.get("measured") or {}

    def attention(i):
        m = measured.get(f"L{i}") or {}
        where = f"{m['kernel']}, " if m.get("kernel") else ""
        return f"{where}measured in {m.get('precision') or meta.get('precision', '?')}"
    flags = layer_flags(history, metrics, step, layers,
                        MonitorThresholds.for_warmup(int(meta.get("warmup_steps") or 0)))
    before = [r for r in probes if r[keys.STEP] < step]
    census = census_from_records(before + [{**metrics, keys.STEP: step}], layers)
    n_probes = {i: sum(1 for r in before if len(_layer_record(r, i)) > 1) + 1 for i in layers}
    return {
        "kind": "watch", "label": WATCH_LABEL, "run_dir": str(run_dir), "checkpoint": None, "step": step,
        "batch_step": step, "sequences": meta.get("subsample_sequences"), "layers": layers,
        "attention": {i: attention(i) for i in layers}, "loss": rec.get(keys.LOSS_TRAIN), "autocast": None,
        "state_continued": True, "n_head": max(heads) + 1 if heads else None,
        "versions": {"torch": torch.__version__}, "metrics": metrics, "details": {},
        "flags": {i: {"state": f.name, "reasons": f.reasons, "probes": n_probes[i]} for i, f in flags.items()},
        "census": None if census is None else census.to_dict(), "watch": meta,
    }


def write_plots(run_dir, out_dir=None) -> list[Path]:
    """The run's probe series from its metrics.jsonl as PNGs (``flashguard.diagnostics.plots``)
    in ``out_dir`` (default RUN_DIR/diagnostics/plots); returns their paths."""
    from ..utils.jsonl import read_metrics
    from . import plots

    recs = read_metrics(run_dir)
    out = Path(out_dir) if out_dir is not None else Path(run_dir) / "diagnostics" / "plots"
    return [plots.plot_spectral_norms(recs, out / "wq_spectral_norms.png"),
            plots.plot_spectral_norms(recs, out / "wk_spectral_norms.png", which="wk"),
            plots.plot_tie_rate(recs, out / "tie_rate.png"),
            plots.plot_delta_bias(recs, out / "delta_bias.png"),
            plots.plot_singular_values(recs, out / "wq_err_singular_values.png"),
            plots.plot_monitor(recs, out / "monitor.png")]


def run_diagnose(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"flashguard diagnose: error: {run_dir} is not a folder", file=sys.stderr)
        return 2
    if args.plots:
        try:
            paths = write_plots(run_dir)
        except FileNotFoundError as e:
            print(f"flashguard diagnose: error: {e}", file=sys.stderr)
            return 2
        for path in paths:
            print(f"written: {path}")
        if not args.monitor:
            return 0
    from .run_state import WATCH_LABEL, watch_meta
    meta = watch_meta(run_dir)
    if args.monitor:
        from .evaluation import evaluate_run
        if meta is not None:
            print(f"{run_dir}: {WATCH_LABEL}; the monitor replays its every-step records (loss, gradient norm) and "
                  f"its probes (every {meta.get('every', '?')} steps)")
            ev = evaluate_run(run_dir, warmup=int(meta.get("warmup_steps") or 0))
        else:
            ev = evaluate_run(run_dir)
        print(ev.summary())
        print("  timeline (each change of the monitor's state, with the training loss at that step):")
        for s, state, loss, reasons in ev.timeline:
            loss_text = "-" if loss is None else f"{loss:.3f}"
            print(f"  step {s:>7}  {state:<8}  loss {loss_text:>7}  {'; '.join(reasons)}")
        if args.out:
            from ..utils.atomic import atomic_write_text
            atomic_write_text(args.out, json.dumps(_clean(ev.to_dict()), indent=1) + "\n")
        return 0
    try:
        res = diagnose(run_dir, step=args.step, layers=args.layers, data_dir=args.data, sequences=args.sequences,
                       precision=args.precision, stabilizer=args.stabilizer, fresh=args.fresh,
                       grad=not args.no_grad_error, device=args.device)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"flashguard diagnose: error: {e}", file=sys.stderr)
        return 2
    if res.get("kind") == "watch":
        loss = "" if res["loss"] is None else f", loss {res['loss']:.4f}"
        print(f"{run_dir}: {res['label']}. The probe the watch recorded at step {res['step']} while your model "
              f"trained{loss} (the folder holds no model: nothing is rerun; --step picks another probe step)")
    else:
        print(f"{run_dir}: checkpoint at step {res['step']}, batch of step {res['batch_step']} "
              f"({res['sequences']} sequences, {res['autocast']} autocast), loss {res['loss']:.4f}"
              + ("" if res["state_continued"] else "; no earlier probe state (no growth rates or running sums)"))
    flags = res["flags"]
    print(format_table(res["metrics"], res["layers"], n_head=res["n_head"] if args.heads and res["n_head"] else None,
                       attention=res["attention"], flags={i: f["state"] for i, f in flags.items()},
                       wide=getattr(args, "wide", False)))
    for layer, f in flags.items():
        n = f["probes"]
        why = "; ".join(f["reasons"]) if f["reasons"] else "every signal below its watch level"
        print(f"L{layer} {f['state']}: {why} (monitor rules over {n} probe{'s' if n != 1 else ''} of this layer)")
    print(legend(wide=getattr(args, "wide", False)))
    if not getattr(args, "wide", False):
        print(f"(--wide: all {len(_COLUMNS)} probe columns)")
    if res["census"] is not None:
        from .census_table import Census, format_census
        found = Census.from_dict(res["census"])
        print(format_census(found, heads=args.heads) if args.census
              else f"{found.summary()} (--census prints the table)")
    out = Path(args.out) if args.out else run_dir / "diagnostics" / f"diagnose_{res['step']:07d}.json"
    from ..utils.atomic import atomic_write_text
    atomic_write_text(out, json.dumps(_clean(res), indent=1) + "\n")
    print(f"written: {out}")
    return 0


def main(argv=None) -> int:
    """Standalone entry point (until the CLI wires ``flashguard diagnose``)."""
    ap = argparse.ArgumentParser(prog="flashguard diagnose", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_diagnose_arguments(ap)
    return run_diagnose(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
