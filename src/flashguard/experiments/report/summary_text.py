"""The plain-language summary a demo or report begins with: what ran, what held, what to use.

    blocks = summary_from_repro(repro_result, lab_result, out)    # flashguard demo, at its end
    blocks = summary_from_study(study)                            # flashguard report, at its top
    print(render_text(blocks))

Every statement is read from the results: the claims' and the lab facts' verdicts, the runs'
summaries, and for "what to use" the lab's measured answer per arithmetic
(``result["answers"][policy]``: ``biased_conditions``, ``removed_by``, ``failures`` and the
printed ``line``, computed in ``experiments/lab/experiments.py``). Nothing here decides which
arithmetic is biased or which fix works: a recipe names a fix only because the lab measured
that it removes the lean, and an arithmetic the lab found unbiased gets "no fix needed".

Blocks are the report's (``("h2" | "p", text)``, ``("list", [text])``) plus ``("code", text)``.
"""
from __future__ import annotations

import re
import textwrap
import warnings
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Advice", "advice_from_lab", "fix_arguments", "recipe_pytorch", "recipe_hf", "build_summary",
           "injection_blocks", "natural_blocks",
           "summary_from_repro", "summary_from_study", "render_text", "intro_text", "STUDY_SCALE"]

# what each lab arithmetic is, so that a reader can tell which one their training uses
ABOUT = {
    "paper": "the study's reference code: every intermediate bf16",
    "fa2": "the arithmetic of production kernels such as FlashAttention-2: bf16 inputs and matmul operands, "
           "fp32 scores, statistics and accumulators",
    "fa2-fp16": "the same production arithmetic with fp16 inputs",
    "fa2-e4m3": "the production arithmetic with fp8 (e4m3) inputs, emulated",
    "fa2-e5m2": "the production arithmetic with fp8 (e5m2) inputs, emulated",
}

# the scale of the study's explosion, for "why no explosion here" (Qiu & Yao 2025: GPT-2 small
# on OpenWebText, diverging after thousands of steps)
STUDY_SCALE = "thousands of steps of GPT-2 small, 124 M weights at about 0.5 M tokens a step"
# the claims judged on whether runs diverge (experiments/repro/claims.py); the others read the probes
DIVERGENCE_CLAIMS = ("C1", "C2", "C3", "C4", "C8")


@dataclass(frozen=True)
class Advice:
    """The lab's answer for one arithmetic, turned into what to do."""
    arithmetic: str
    measured: str                     # the lab's own line: "biased under ties: ...; removed by: ..."
    biased: bool
    fix: tuple[str, str] | None       # (precision, stabilizer) for override_sdpa: the first measured remover
    removed_by: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()      # candidates the lab tried that did not remove it

    def text(self) -> str:
        about = ABOUT.get(self.arithmetic)
        head = f"`{self.arithmetic}`" + (f" ({about})" if about else "")
        if not self.biased:
            # the lab's line goes on to list harmless candidates, which are no advice
            return f"{head}: no fix needed; keep stabilizer \"none\" (lab: {self.measured.split(';')[0]})."
        if self.fix is not None:
            prec, stab = self.fix
            tried = f" Measured not to remove it: {', '.join(self.failed)}." if self.failed else ""
            return (f"{head}: use precision=\"{prec}\", stabilizer=\"{stab}\" (lab: {self.measured}).{tried}")
        if self.removed_by:   # a remover override_sdpa cannot name (e.g. another kernel): lab.md has it
            return f"{head}: see lab.md for the measured fix, which has no override_sdpa recipe (lab: {self.measured})."
        return f"{head}: no measured fix; nothing the lab tried removes its lean (lab: {self.measured})."


_STAB = re.compile(r"^(?P<name>[a-z_]+)\((?P<opts>.*)\)$")


def fix_arguments(label: str) -> tuple[str, str]:
    """``(precision, stabilizer)`` for ``override_sdpa`` of a lab arithmetic label
    (``Arithmetic.label()``: "POLICY / STABILIZER", e.g. "paper / paper(beta=7,tol=0.001)" ->
    ("paper", "paper:beta=7,tol=0.001")). Checked by rebuilding the arithmetic: the arguments
    must give back the same label, so a recipe cannot name a different arithmetic than the lab
    measured (ValueError otherwise)."""
    from ...attention.options import RetiredStabilizerWarning
    from ...attention.trace import Arithmetic
    prec, sep, stab = label.partition(" / ")
    if not sep:
        raise ValueError(f"lab arithmetic label {label!r}: expected 'POLICY / STABILIZER'")
    m = _STAB.match(stab)
    stab_arg = f"{m['name']}:{m['opts']}" if m else stab
    try:
        with warnings.catch_warnings():  # the lab's record may name the retired 'safe': checked, not run
            warnings.simplefilter("ignore", RetiredStabilizerWarning)
            rebuilt = Arithmetic.of(prec, stab_arg).label()
    except (ValueError, TypeError) as e:
        raise ValueError(f"lab arithmetic label {label!r}: {e}") from None
    if rebuilt != label:
        raise ValueError(f"lab arithmetic label {label!r}: precision={prec!r}, stabilizer={stab_arg!r} "
                         f"give {rebuilt!r}")
    return prec, stab_arg


def advice_from_lab(lab: dict) -> list[Advice]:
    """One Advice per arithmetic the lab answered for, in the lab's order ([] for a lab result
    without answers, e.g. one written before they existed)."""
    out = []
    for pol, ans in (lab.get("answers") or {}).items():
        biased = bool(ans.get("biased_conditions"))
        removed = tuple(ans.get("removed_by") or ())
        fix = None
        if biased and removed:
            # the first remover override_sdpa can name (the lab lists stabilizers before arithmetic changes)
            for label in removed:
                try:
                    fix = fix_arguments(label)
                    break
                except ValueError:
                    continue
        failed = tuple(k.partition(" / ")[2] for k in (ans.get("failures") or {})
                       if k.partition(" / ")[0] == pol)      # same arithmetic, another stabilizer
        out.append(Advice(pol, ans.get("line", ""), biased, fix, removed, failed))
    return out


def recipe_pytorch(precision: str, stabilizer: str) -> str:
    return (f"import flashguard\n"
            f"with flashguard.override_sdpa(precision=\"{precision}\", stabilizer=\"{stabilizer}\"):\n"
            f"    loss = model(x).loss   # every F.scaled_dot_product_attention call in here\n"
            f"loss.backward()            # the backward of those calls is flashguard's too")


def _hf_registry() -> bool:
    """Whether flashguard.integrations.hf is installed (its registry is then worth a mention)."""
    import importlib.util
    try:
        return importlib.util.find_spec("flashguard.integrations.hf") is not None
    except (ImportError, ValueError):   # a broken or odd install: just leave the mention out
        return False


def recipe_hf(precision: str, stabilizer: str) -> str:
    return (f"import flashguard, torch\n"
            f"from transformers import AutoModelForCausalLM\n"
            f"model = AutoModelForCausalLM.from_pretrained(NAME, attn_implementation=\"sdpa\").to(torch.bfloat16)\n"
            f"with flashguard.override_sdpa(precision=\"{precision}\", stabilizer=\"{stabilizer}\"):\n"
            f"    loss = model(**batch).loss\n"
            f"loss.backward()")


@dataclass
class _Run:
    name: str
    title: str
    summary: dict


@dataclass
class _Inputs:
    command: str                          # who ran it, e.g. "`flashguard demo`"
    runs: list[_Run] = field(default_factory=list)
    claims: list[dict] = field(default_factory=list)
    steps: int | None = None
    model: str | None = None              # "the tiny-cpu model (4 layers, width 256, 3.3 M weights)"
    tokens_per_step: int | None = None
    lab: dict | None = None
    injection: dict | None = None         # injection.json: the causal comparison (experiments/injection)
    natural: dict | None = None           # natural.json: the natural runs (experiments/natural), measured apart
    watch: bool = False                   # the runs are watch folders of the user's own model (flashguard.watch)


def _verdict_list(items: list[tuple[str, str]]) -> str:
    return "; ".join(f"{what}: {verdict}" for what, verdict in items)


def build_summary(inp: _Inputs) -> list[tuple]:
    """The summary's blocks (see the module docstring)."""
    blocks: list[tuple] = [("h2", "Summary")]
    # what was run
    parts = []
    lab = inp.lab
    if lab is not None:
        rows = f"{lab['n_rows']:,} independent rows per condition" if lab.get("n_rows") else "independent rows"
        parts.append(f"the rounding-bias lab ({'quick, ' if lab.get('quick') else ''}{rows}; the study's "
                     f"arithmetic facts tested in `{lab.get('policy', '?')}`)")
    if inp.runs:
        steps = f" for {inp.steps:,} steps" if inp.steps else ""
        model = f" of {inp.model}" if inp.model else ""
        same = ", same seed and batches" if len(inp.runs) > 1 and inp.claims else ""
        what = (f"watch folder{'s' if len(inp.runs) != 1 else ''} of your own model's training" if inp.watch
                else f"training run{'s' if len(inp.runs) != 1 else ''}")
        parts.append(f"{len(inp.runs)} {what}{model}{steps}{same} ("
                     + "; ".join(r.title or r.name for r in inp.runs) + ")")
    if inp.watch and parts:
        blocks.append(("p", "What ran: your own model's training, watched by `flashguard.watch`; this report reads "
                            + " and ".join(parts) + "."))
    else:
        blocks.append(("p", f"What ran: {inp.command} ran " + " and ".join(parts) + "." if parts
                       else f"What ran: {inp.command}; no runs and no lab result were found."))
    # what held
    held = []
    if lab is not None and lab.get("verdicts"):
        from ..lab.report import TITLES
        held += [f"lab {TITLES.get(k, k)}: {v}" for k, v in lab["verdicts"].items()]
    held += [f"{c.get('id')} {c.get('title', '')}: {c.get('verdict')}" for c in inp.claims]
    if held:
        blocks.append(("p", "What held (the evidence is in the tables below):"))
        blocks.append(("list", held))
    # why no explosion (or which run exploded)
    if inp.runs:
        diverged = [r for r in inp.runs if r.summary.get("diverged_at") is not None]
        if diverged:
            blocks.append(("p", "Diverged: " + ", ".join(f"{r.name} at step {r.summary['diverged_at']}"
                                                          for r in diverged) + "."))
        elif inp.watch:
            blocks.append(("p", "No divergence in the watched steps by the package's rule (a non-finite or runaway "
                                "loss or gradient norm, as the watch logged them every step); the monitor's "
                                "timeline is in `flashguard diagnose DIR --monitor`."))
        else:
            length = f"{inp.steps:,} steps" if inp.steps else "runs this short"
            tokens = (f", {inp.tokens_per_step * inp.steps:,} tokens in all,"
                      if inp.tokens_per_step and inp.steps else "")
            model = inp.model or "a small model"
            ids = [str(c.get("id")) for c in inp.claims]
            needs = [i for i in ids if i in DIVERGENCE_CLAIMS]
            probes = [i for i in ids if i not in DIVERGENCE_CLAIMS]
            text = (f"No run diverged, and none was expected to: {length} of {model}{tokens} are far too few; "
                    f"the study's explosion took {STUDY_SCALE}.")
            if needs:
                text += (f" So a claim that needs a diverging run ({', '.join(needs)}) reads \"not held\" or "
                         "\"inconclusive\" here; "
                         + (f"the lab and the probes ({', '.join(probes)}) look" if probes else "the lab looks")
                         + " at the mechanism itself.")
            blocks.append(("p", text))
    if inp.injection is not None:
        blocks += injection_blocks(inp.injection)
    if inp.natural is not None:
        blocks += natural_blocks(inp.natural)
    # what to use: from the lab's measured answers only
    if lab is not None:
        advice = advice_from_lab(lab)
        if not advice:
            blocks.append(("p", "What to use in your own bf16 training: this lab result has no per-arithmetic "
                                "answers (an older lab.json); rerun `flashguard lab` for them."))
        else:
            blocks.append(("p", "What to use in your own bf16 training, per attention arithmetic, as this lab "
                                "measured it:"))
            blocks.append(("list", [a.text() for a in advice]))
            unbiased = [f"`{a.arithmetic}`" for a in advice if not a.biased]
            unfixed = [f"`{a.arithmetic}`" for a in advice if a.biased and a.fix is None]
            if unfixed and unbiased:
                blocks.append(("p", f"For {', '.join(unfixed)} the lab found no fix; the arithmetics it found "
                                    f"unbiased under ties are {', '.join(unbiased)}."))
            blocks.append(("p", "To find which of these your own kernel computes like, `flashguard audit` "
                                "measures the attention kernels of this device the same way."))
            fixes = list(dict.fromkeys(a.fix for a in advice if a.fix is not None))
            for prec, stab in fixes:
                who = ", ".join(f"`{a.arithmetic}`" for a in advice if a.fix == (prec, stab))
                blocks.append(("p", f"If your attention computes like {who}: a plain PyTorch model (any code that "
                                    "calls torch.nn.functional.scaled_dot_product_attention):"))
                blocks.append(("code", recipe_pytorch(prec, stab)))
                hf = "A Hugging Face model, through its sdpa attention"
                if _hf_registry():
                    from ...integrations.hf import DEFAULT_NAME   # the name register() uses by default
                    hf += (f" (or `flashguard.integrations.hf.register(precision=\"{prec}\", stabilizer="
                           f"\"{stab}\")`, then attn_implementation=\"{DEFAULT_NAME}\")")
                blocks.append(("p", hf + ":"))
                blocks.append(("code", recipe_hf(prec, stab)))
            if not fixes and not any(a.biased for a in advice):
                blocks.append(("p", "No arithmetic here leans under ties: no fix is needed, so there is no recipe "
                                    "to copy."))
            elif not fixes:
                blocks.append(("p", "The lab measured no fix for the arithmetics that lean, so there is no recipe "
                                    "to copy."))
    return blocks


def _arm_text(run: dict) -> str:
    s = run.get("summary") or {}
    peak = max((run.get("wq_norm_peak") or {}).values(), default=None)
    base = (run.get("wq_norm") or {})
    first = min((pts[0][1] for pts in base.values() if pts), default=None)
    wq = (f", W_Q spectral norm {first:.2g} -> peak {peak:.3g}" if peak is not None and first is not None else "")
    warned = run.get("first_warning")
    if s.get("status") == "diverged":
        when = ("" if warned is None else f"; the monitor warned at step {warned}"
                + (f", {s.get('diverged_at') - warned} steps ahead" if warned < s.get("diverged_at") else ""))
        return f"`{run['name']}` diverged at step {s.get('diverged_at')}{wq}{when}"
    if warned is not None:
        wq += f"; the monitor warned at step {warned}"
    if s.get("status") == "done":
        loss = f" (final loss {s['final_loss']:.3g}{wq})" if s.get("final_loss") is not None else ""
        return f"`{run['name']}` trained on{loss}"
    return f"`{run['name']}`: {s.get('status', 'missing')}"


def injection_blocks(result: dict) -> list[tuple]:
    """The causal comparison of an injection result (experiments/injection/runner.py's dict): which
    arm diverged, the verdicts, the real run's margin, and what a reader should conclude; every
    statement read from the result."""
    seed = (result.get("seeds") or [None])[0]
    runs = [r for r in result.get("runs") or [] if r.get("seed") == seed]
    claims = {c.get("id"): c for c in result.get("claims") or []}
    blocks: list[tuple] = [("p", f"The causal half of the chain, forced at small scale (error injection, "
                                 f"{result.get('repro_preset', '?')} model, {result.get('steps', '?')} steps, seed "
                                 f"{seed}, the same batches in every run): the backward pass uses delta = delta_ref "
                                 "+ alpha x rule(e), e the arithmetic's own delta error:")]
    blocks.append(("list", [f"{_arm_text(r)}: {r.get('title') or r.get('name')}" if r.get("title") else _arm_text(r)
                            for r in runs]))
    held = []
    for cid in ("I1", "I1-wq", "C3"):
        c = claims.get(cid)
        if c is not None:
            held.append(f"{cid} {c.get('title', '')}: {c.get('verdict')} ({c.get('evidence')})")
    if held:
        blocks.append(("list", held))
    m = result.get("margin") or {}
    i1 = (claims.get("I1") or {}).get("verdict")
    if i1 == "held":
        text = ("What to conclude: at this scale a delta error that keeps one sign runs W_Q away and diverges, "
                "while a zero-mean error as large or larger trains on. The size of the rounding error is not "
                "the danger, its lean is: the lab above measures whether your arithmetic's delta error leans "
                "under ties, and the recipe removes it.")
    elif i1 == "not held":
        text = ("What to conclude: at this scale the sign structure of the delta error did not decide the "
                "outcome (see the verdict's evidence), so this comparison gives no reason to fear a lean more "
                "than noise of the same size.")
    else:
        text = "What to conclude: this comparison decided nothing yet (see the verdict's evidence)."
    if m.get("text"):
        text += f" The real run's margin: {m['text']}."
    blocks.append(("p", text))
    return blocks


def natural_blocks(result: dict) -> list[tuple]:
    """The natural runs' verdicts (experiments/natural's natural.json) and what they say, read from
    the result; where they were measured, since the demo shows a result it did not train."""
    claims = {c.get("id"): c for c in result.get("claims") or []}
    arms = ", ".join(f"`{a.get('name', '?') if isinstance(a, dict) else a}`" for a in (result.get("arms") or []))
    blocks: list[tuple] = [("p", f"The natural half, measured apart (`flashguard natural`, preset "
                                 f"{result.get('preset', '?')}: {result.get('steps', '?')} steps an arm, arms {arms}, "
                                 "the same seed and batches; docs/natural/): does the lean arise in real training, "
                                 "and does a fix remove it?")]
    blocks.append(("list", [f"{cid} {c.get('title', '')}: {c.get('verdict')} ({c.get('evidence')})"
                            for cid, c in claims.items()]))
    v = {cid: c.get("verdict") for cid, c in claims.items()}
    if v.get("N1") == "held":
        text = "What to conclude: in real training the reference arithmetic's delta error leans the study's way"
        fixed = [name for cid, name in (("N3", "the lab's fix"), ("N4", "the study's fix")) if v.get(cid) == "held"]
        failed = [name for cid, name in (("N3", "the lab's fix"), ("N4", "the study's fix")) if v.get(cid) == "not held"]
        if fixed:
            text += f"; {' and '.join(fixed)} remove{'s' if len(fixed) == 1 else ''} it"
        if failed:
            text += f"; {' and '.join(failed)} do{'es' if len(failed) == 1 else ''} not"
        text += ({"held": "; and it made the run diverge.",
                  "not held": ", but it did not make the run diverge at this length: a lean to watch "
                              "(`flashguard diagnose --census`) and to remove, not yet an explosion."}
                 .get(v.get("N5"), "; whether it makes a run diverge is not decided here."))
    elif v.get("N1") == "not held":
        text = ("What to conclude: no delta lean arose in these runs, so at this scale the natural half of the "
                "chain did not start.")
    else:
        text = "What to conclude: the natural runs decided nothing yet (see the evidence)."
    blocks.append(("p", text))
    return blocks


def _model_from_run_dir(run_dir: Path) -> tuple[str | None, int | None]:
    """("the tiny-cpu model (4 layers, width 256, 3.3 M weights)", tokens a step) from a run's
    config.toml, or (None, None) when it is absent or unreadable (the summary does without)."""
    try:
        from ...train.config import load_config
        from ...train.loop import gpt_config
        cfg = load_config(run_dir / "config.toml")
        g = gpt_config(cfg)
    except Exception:   # any unreadable config: the summary is still worth writing
        return None, None
    # GPT-2 weights: 12 d^2 per layer (attention 4 d^2, MLP 8 d^2), tied token and position embeddings
    weights = 12 * g.n_layer * g.n_embd ** 2 + (g.vocab_size + g.block_size) * g.n_embd
    return (f"the {cfg.model.preset} model ({g.n_layer} layers, width {g.n_embd}, {weights / 1e6:.1f} M weights)",
            cfg.data.batch_size * g.block_size)


def _command(preset) -> str:
    return "`flashguard demo`" if preset == "demo" else f"`flashguard repro` (preset {preset})" if preset \
        else "flashguard"


def summary_from_repro(repro: dict, lab: dict | None, out: Path | str, injection: dict | None = None,
                       natural: dict | None = None) -> list[tuple]:
    """The summary of a repro result (``run_repro``'s dict, repro.json), its lab result and (the
    demo) its injection result and the natural runs' result."""
    runs = [_Run(r.get("name", "?"), r.get("title", ""), r.get("summary") or {}) for r in repro.get("runs") or []]
    model, tps = (None, None)
    for r in repro.get("runs") or []:
        model, tps = _model_from_run_dir(Path(out) / r.get("dir", f"runs/{r.get('name')}"))
        if model:
            break
    return build_summary(_Inputs(_command(repro.get("preset")), runs, list(repro.get("claims") or []),
                                 repro.get("steps"), model, tps, lab, injection, natural))


def summary_from_study(study) -> list[tuple]:
    """The summary of a report's ``Study`` (flashguard.experiments.report.load)."""
    runs = [_Run(r.name, r.title, r.summary) for r in study.runs]
    model, tps = (None, None)
    for r in study.runs:
        model, tps = _model_from_run_dir(r.dir)
        if model:
            break
    steps = study.meta.get("steps")
    if isinstance(steps, str):   # plain run folders: their distinct step counts
        steps = int(steps) if steps.isdigit() else None
    command = _command(study.meta.get("preset")) if study.kind == "repro" else \
        "`flashguard train`" if study.kind == "runs" else \
        "`flashguard.watch` (on your own model, during its training)" if study.kind == "watch" else "`flashguard lab`"
    return build_summary(_Inputs(command, runs, list(study.claims), steps, model, tps,
                                 study.lab.result if study.lab is not None else None, study.injection,
                                 study.natural, watch=study.kind == "watch"))


def intro_text(steps: int, model: str = "the tiny-cpu model") -> str:
    """The demo's first console lines: what it will run and why no explosion is expected."""
    return render_text([("p", f"flashguard demo: the rounding-bias lab, then matched training runs of {model} "
                              f"({steps:,} steps each), then a report. No explosion is expected at this length: "
                              f"the study's took {STUDY_SCALE}. The lab and the probes measure the mechanism "
                              "instead, and the summary at the end says what to use in your own bf16 training.")])


def render_text(blocks: list[tuple], width: int = 79) -> str:
    """The blocks as console text: wrapped paragraphs, bulleted lists, indented code."""
    out: list[str] = []
    for kind, body in blocks:
        text = body if isinstance(body, str) else ""
        if kind in ("h1", "h2"):
            out += [text, "=" * len(text) if kind == "h1" else "-" * len(text)]
        elif kind == "p":
            out.append(textwrap.fill(text, width, break_on_hyphens=False))   # keep names like paper-fp32fwd whole
        elif kind == "list":
            out += [textwrap.fill(item, width, initial_indent="  - ", subsequent_indent="    ",
                                  break_on_hyphens=False) for item in body]
        elif kind == "code":
            out += ["    " + line for line in text.split("\n")]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
