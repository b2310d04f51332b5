"""What `flashguard repro` runs: a preset (the training set-up) and its matched runs.

Every run of a preset starts from the same config, seed and batch order (the trainer draws
batches from a generator seeded by train.seed), and differs from the `paper` run in one
option only. ``precision`` is the arithmetic the flash runs use: the study's reference
arithmetic (`paper`), or a coarser variant of it where the CPU-scale reproduction needs one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...numerics.policy import get_policy
from ...train.shipped import shipped_configs

__all__ = ["RunSpec", "ReproPreset", "PRESETS", "get_preset", "run_specs", "config_path", "CLAIM_RUNS"]


@dataclass(frozen=True)
class RunSpec:
    name: str
    group: str                 # main | ablation | remedy
    title: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class ReproPreset:
    name: str
    config: str                # a shipped config (configs/*.toml, package data)
    precision: str             # arithmetic of the flash runs (a policy string)
    steps: int | None = None   # None: the config's train.steps
    focus_layer: int = 1       # the study's "layer 2"
    diagnostics_every: int = 50
    overrides: tuple[str, ...] = field(default_factory=tuple)  # shared by every run
    about: str = ""


PRESETS: dict[str, ReproPreset] = {p.name: p for p in (
    ReproPreset("tiny-cpu", "tiny-cpu.toml", precision="paper", steps=1500, diagnostics_every=50,
                overrides=("optim.schedule=constant",),
                about="4 layers x 256 wide, byte-level embedded corpus, T=256; the CPU-scale set-up "
                      "(docs/cpu-reproduction.md)"),
    ReproPreset("gpt2-124m-owt", "gpt2-124m-owt.toml", precision="paper", diagnostics_every=1000,
                about="the study's configuration: GPT-2 small on OpenWebText (for GPUs)"),
    ReproPreset("demo", "tiny-cpu.toml", precision="paper", steps=200, diagnostics_every=20,
                overrides=("optim.schedule=constant", "data.batch_size=8", "train.eval_every=0",
                           "train.checkpoint_every=50", "train.keep_last=1"),
                about="`flashguard demo`: the tiny-cpu model for 200 steps of 8 sequences, probed every 20 steps "
                      "(minutes on a CPU: too short for an explosion, long enough for the mechanism's signs)"),
    ReproPreset("micro", "micro.toml", precision="paper", steps=40, diagnostics_every=10,
                overrides=("train.eval_every=0",), about="seconds-long smoke test"),
)}


def lookup_preset(presets: dict, name: str, missing: str):
    """``presets[name]``, or a ValueError: ``missing``, the name and the known names. The
    experiments' get_*_preset look their presets up through it."""
    if name not in presets:
        raise ValueError(f"{missing} {name!r}; known: {', '.join(presets)}")
    return presets[name]


def get_preset(name: str) -> ReproPreset:
    return lookup_preset(PRESETS, name, "unknown repro preset")


def config_path(preset: ReproPreset) -> Path:
    """The preset's TOML: a shipped config, found by name in the installed package (never a file of
    the same name in the working folder)."""
    shipped = shipped_configs()
    name = Path(preset.config).stem
    if name not in shipped:
        raise FileNotFoundError(f"repro preset {preset.name!r} needs the shipped config {preset.config!r}, "
                                f"not found (shipped: {', '.join(shipped) or 'none'}); reinstall flashguard")
    return shipped[name]


def _with(precision: str, **fields) -> str:
    """The policy string of ``precision`` with some fields replaced."""
    return get_policy(precision).replace(**fields).short_str()


def _fp32_forward(precision: str) -> str:
    """The lab's measured fix of an arithmetic: its forward (scores, statistics, PV, O, lse) in
    fp32, its backward as it is; by name for the reference arithmetic (``paper-fp32fwd``)."""
    if precision == "paper":
        return "paper-fp32fwd"
    return _with(precision, scores="fp32", stats="fp32", pv="fp32", o_accum="fp32", lse="fp32")


def run_specs(precision: str, focus: int, block_size: int, *, remedies: bool = False) -> list[RunSpec]:
    p, L = precision, focus
    runs = [
        RunSpec("fp32", "main", "fp32 attention (flash algorithm, fp32 arithmetic)", ("attention.precision=fp32",)),
        RunSpec("paper", "main", f"flash, {p}, no fix", (f"attention.precision={p}",)),
        RunSpec("paper-fix", "main", f"flash, {p}, the study's fix (beta = 2)",
                (f"attention.precision={p}", "attention.stabilizer=paper")),
        RunSpec("paper-fp32fwd", "main", f"flash, {p} with its forward in fp32 (the lab's measured fix)",
                (f"attention.precision={_fp32_forward(p)}",)),
        RunSpec("no-tiling", "ablation", f"flash, {p}, one tile per row (block = T = {block_size})",
                (f"attention.precision={p}", f"attention.block_q={block_size}", f"attention.block_k={block_size}")),
        RunSpec(f"fp32-layer{L}", "ablation", f"flash, {p}, but fp32 in layer {L} only",
                (f"attention.precision={p}", f"attention.layers.{L}.precision=fp32")),
        RunSpec(f"flash-layer{L}", "ablation", f"fp32 attention, but flash {p} in layer {L} only",
                ("attention.precision=fp32", f"attention.layers.{L}.precision={p}")),
        RunSpec("delta-o-highp", "ablation", "flash, delta = rowsum(dO * O) from a high-precision O",
                (f"attention.precision={_with(p, delta_source='o_highp')}",)),
        RunSpec("delta-dp-p", "ablation", "flash, delta = rowsum(dP * P)",
                (f"attention.precision={_with(p, delta_source='dp_p')}",)),
        RunSpec("pv-fp32", "ablation", "flash, the Pbar V product in fp32",
                (f"attention.precision={_with(p, pv='fp32')}",)),
    ]
    if remedies:
        runs += [
            RunSpec("qk-layernorm", "remedy", "QK-LayerNorm", (f"attention.precision={p}", "model.qk_layernorm=true")),
            RunSpec("z-loss", "remedy", "z-loss 1e-4 on the output logits",
                    (f"attention.precision={p}", "model.z_loss=1e-4")),
            RunSpec("softcap", "remedy", "attention logit soft-capping at 30",
                    (f"attention.precision={p}", "model.attn_softcap=30.0")),
        ]
    return runs


# the runs each claim reads (the main runs are always run)
CLAIM_RUNS = {
    "C1": ("fp32", "paper"),
    "C2": ("paper", "no-tiling"),
    "C3": ("paper", "fp32-layer{L}", "flash-layer{L}"),
    "C4": ("paper", "delta-o-highp", "delta-dp-p", "pv-fp32"),
    "C5": ("paper",),
    "C6": ("paper",),
    "C8": ("paper", "paper-fix", "paper-fp32fwd"),
}
