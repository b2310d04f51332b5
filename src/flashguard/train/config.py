"""Typed, validated run configuration: dataclasses <-> TOML, with dotted key=value overrides.

    cfg = load_config("configs/tiny-cpu.toml", ["train.steps=200", "attention.precision=fa2"])
    save_config(cfg, run_dir / "config.toml")      # fully resolved, saved with every run

Every field is checked against its annotation when loaded; an unknown key or a wrongly
typed value raises ConfigError naming the key.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["ConfigError", "DataConfig", "ModelConfig", "AttentionConfig", "OptimConfig", "TrainConfig",
           "InjectionConfig", "RunConfig", "load_config", "parse_overrides", "apply_overrides", "save_config",
           "config_to_toml", "config_from_dict", "config_to_dict", "injection_of", "HOOK_KEYS", "refuse_unclaimed"]


class ConfigError(ValueError):
    """A configuration problem; the message names the key."""


@dataclass
class DataConfig:
    dir: str = "data/embedded"        # folder made by `flashguard prepare`
    batch_size: int = 16              # sequences per optimizer step, over all processes
    doc_starts: bool = False          # every window (train and val) starts right after a document separator


@dataclass
class ModelConfig:
    preset: str = "tiny-cpu"          # flashguard.model.MODEL_PRESETS
    n_layer: int | None = None        # None: the preset's value
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None     # sequence length T
    vocab_size: int | None = None     # None: the preset's, checked against the data
    bias: bool | None = None
    dropout: float | None = None
    attn_dropout: float = 0.0         # attention probabilities while training (GPTConfig.attn_dropout), in [0, 1)
    qk_layernorm: bool = False        # remedies users compare against, each a flag
    attn_softcap: float | None = None
    z_loss: float = 0.0


def _default_spec():
    from ..model.attention import AttentionSpec
    return AttentionSpec(backend="flash", precision="paper")


@dataclass
class AttentionConfig:
    """[attention]: the attention every layer trains with, as the model's own choice
    (flashguard.model.AttentionSpec): the section's keys are the spec's settings - backend
    (sdpa | flash | math), precision,
    stabilizer, block_q, block_k, kernel (auto | pytorch | triton) - validated by the spec itself and
    named here by key; ``layers`` changes them per layer, e.g. layers."1" = { precision = "fp32" }
    (the study's localisation)."""
    spec: "AttentionSpec" = field(default_factory=_default_spec)   # noqa: F821 (flashguard.model.AttentionSpec)
    layers: dict = field(default_factory=dict)

    def specs(self, n_layer: int) -> list:
        """One AttentionSpec per layer (ValueError for a layer the model does not have)."""
        from ..model.attention import layer_specs
        return layer_specs(self.spec, {int(k): v for k, v in self.layers.items()}, n_layer)


@dataclass
class OptimConfig:
    lr: float = 2e-3
    min_lr: float = 2e-5
    warmup_steps: int = 100
    schedule: str = "cosine"          # cosine (to min_lr at decay_steps) | constant
    decay_steps: int | None = None    # None: train.steps
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0            # 0: off


@dataclass
class TrainConfig:
    steps: int = 1000
    seed: int = 1337
    grad_accum: int = 1               # micro-batches per step (per process)
    autocast: str = "bf16"            # bf16 | fp32
    device: str = "auto"              # auto | cpu | cuda
    checkpoint_every: int = 100       # 0: only at the end
    keep_last: int = 2
    eval_every: int = 100             # 0: never
    eval_batches: int = 10
    log_every: int = 1
    divergence_loss: float | None = None  # stop when loss exceeds this (non-finite always stops)
    divergence_factor: float | None = None  # stop by the divergence rule (train/divergence.py), this x its running min
    on_divergence: str = "stop"       # stop | continue
    tensorboard: bool = False
    progress: bool = True
    # --- diagnostics (flashguard.diagnostics.trainer) ---
    diagnostics_every: int = 0        # probes every N steps, on the step's own batch (0: off; 50 recommended)
    diagnostics_layers: list = field(default_factory=list)  # layer indices to probe, e.g. [1]; empty: all
    update_entropy_every: int = 0     # weights/update_entropy/L* every N steps (diagnostics/update_entropy.py; 0: off)
    # --- end diagnostics ---


@dataclass
class InjectionConfig:
    """The error-injection experiment (flashguard.attention.injection): in the backward pass of the
    chosen flash layers delta = delta_ref + alpha * rule(e), e = the arithmetic's delta - delta_ref
    (point = "o": the forward's O = O_ref + alpha * rule(e), rounded stochastically)."""
    rule: str = "none"                # none (off) | real | coherent | zero-mean | shuffled | exact
    alpha: float = 1.0                # scale of the injected error (> 0)
    p: float | None = None            # coherent only: probability of a positive sign, in [0, 1]
    layers: list = field(default_factory=list)  # layer indices (e.g. [1]); empty: every flash layer
    seed: int | None = None           # seed of the injection's own generator; unset: train.seed
    reference: str = "fp64"           # arithmetic of the exact O_ref and delta_ref: fp64 | fp32
    point: str = "delta"              # where: delta (the backward's) | o (the forward's output)


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    injection: InjectionConfig = field(default_factory=InjectionConfig)

    def __post_init__(self):
        _validate(self)


_SECTIONS = {f.name: f.type for f in dataclasses.fields(RunConfig)}

# The keys that do nothing unless a hook of the training loop implements them (a hook claims its keys
# in flashguard.train.hooks.TrainHook.config_keys): key -> the hook to pass. The loop refuses a run that
# sets one to a value other than its default without a hook that claims it (refuse_unclaimed).
# flashguard.diagnostics.training_hooks() builds all of them; tests/diagnostics check this table against it.
_DIAGNOSTICS_HOOK = "flashguard.diagnostics.DiagnosticsHook"
HOOK_KEYS: dict[str, str] = {
    "train.diagnostics_every": _DIAGNOSTICS_HOOK,
    "train.diagnostics_layers": _DIAGNOSTICS_HOOK,
    "train.update_entropy_every": _DIAGNOSTICS_HOOK,   # its UpdateEntropyHook rides in DiagnosticsHook
    **{f"injection.{f.name}": "flashguard.train.injection.InjectionHook" for f in dataclasses.fields(InjectionConfig)},
}


def refuse_unclaimed(cfg: RunConfig, claimed) -> None:
    """ConfigError for the first HOOK_KEYS key that ``cfg`` sets (to a value other than its default)
    and no key of ``claimed`` (the hooks' config_keys) covers, naming the key and the hook to pass."""
    for key, hook in HOOK_KEYS.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if key in claimed or value == getattr(type(getattr(cfg, section))(), name):
            continue
        raise ConfigError(f"{key} = {_toml_value(value)} needs the hook {hook}: train(cfg, run_dir, "
                          f"hooks=[..., {hook.rsplit('.', 1)[1]}()]); flashguard.diagnostics.training_hooks() "
                          "builds every standard hook (flashguard train and repro pass them)")


def _check_value(key: str, value, annotation):
    """Coerce/check one value against a field annotation (a string under `from __future__`)."""
    hint = eval(annotation, vars(typing)) if isinstance(annotation, str) else annotation  # noqa: S307
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key} may not be empty (expected {getattr(base, '__name__', base)})")
    if base is bool:
        if isinstance(value, bool):
            return value
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif base is str:
        if isinstance(value, str):
            return value
    elif base is dict:
        if isinstance(value, dict):
            return value
    elif base is list:  # (diagnostics) element types are checked in _validate
        if isinstance(value, list):
            return list(value)
    raise ConfigError(f"{key} must be {getattr(base, '__name__', base)}, got {value!r} ({type(value).__name__})")


def config_from_dict(raw: dict) -> RunConfig:
    sections = {}
    for name, value in raw.items():
        if name not in _SECTIONS:
            raise ConfigError(f"unknown config section [{name}]; known: {', '.join(_SECTIONS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"[{name}] must be a table")
    for name, typ in _SECTIONS.items():
        if name == "attention":
            sections[name] = _attention_from_dict(raw.get(name, {}))
            continue
        cls = {"data": DataConfig, "model": ModelConfig,
               "optim": OptimConfig, "train": TrainConfig, "injection": InjectionConfig}[name]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in raw.get(name, {}).items():
            if key not in fields:
                raise ConfigError(f"unknown config key {name}.{key}; known in [{name}]: {', '.join(fields)}")
            kwargs[key] = _check_value(f"{name}.{key}", value, fields[key].type)
        sections[name] = cls(**kwargs)
    return RunConfig(**sections)


def _attention_from_dict(raw: dict) -> AttentionConfig:
    """[attention] as TOML writes it (the spec's settings flat, plus ``layers``) -> AttentionConfig."""
    from ..model.attention import SETTINGS, SpecError
    for key in raw:
        if key != "layers" and key not in SETTINGS:
            raise ConfigError(f"unknown config key attention.{key}; known in [attention]: {', '.join((*SETTINGS, 'layers'))}")

    settings = {k: v for k, v in raw.items() if k != "layers"}
    try:  # replace, not with_changes: a saved sdpa run's section names every setting
        spec = dataclasses.replace(_default_spec(), **settings)
    except SpecError as e:
        raise ConfigError(f"attention.{e.field}: {e.problem}") from None
    layers = raw.get("layers", {})
    if not isinstance(layers, dict):
        raise ConfigError(f"attention.layers must be a table of layer changes, got {layers!r}")
    return AttentionConfig(spec=spec, layers=layers)


def config_to_dict(cfg: RunConfig) -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if isinstance(section, AttentionConfig):
            out[f.name] = {**section.spec.settings(), "layers": {k: dict(v) for k, v in section.layers.items()}}
        else:
            out[f.name] = dataclasses.asdict(section)
    return out


def _validate(cfg: RunConfig) -> None:
    def need(cond, key, msg):
        if not cond:
            raise ConfigError(f"{key} {msg}")

    need(cfg.data.batch_size >= 1, "data.batch_size", "must be >= 1")
    t, o = cfg.train, cfg.optim
    need(t.steps >= 1, "train.steps", "must be >= 1")
    need(t.grad_accum >= 1, "train.grad_accum", "must be >= 1")
    need(cfg.data.batch_size % t.grad_accum == 0, "data.batch_size",
         f"({cfg.data.batch_size}) must be divisible by train.grad_accum ({t.grad_accum})")
    need(t.autocast in ("bf16", "fp32"), "train.autocast", f"must be bf16 or fp32, got {t.autocast!r}")
    need(t.device in ("auto", "cpu", "cuda"), "train.device", f"must be auto, cpu or cuda, got {t.device!r}")
    need(t.on_divergence in ("stop", "continue"), "train.on_divergence", f"must be stop or continue, got {t.on_divergence!r}")
    for key in ("checkpoint_every", "eval_every"):
        need(getattr(t, key) >= 0, f"train.{key}", "must be >= 0")
    need(t.keep_last >= 1, "train.keep_last", "must be >= 1")
    need(t.eval_batches >= 1, "train.eval_batches", "must be >= 1")
    need(t.log_every >= 1, "train.log_every", "must be >= 1")
    need(t.divergence_factor is None or t.divergence_factor > 1, "train.divergence_factor",
         f"must be > 1 (or unset), got {t.divergence_factor!r}")
    # --- diagnostics ---
    need(t.diagnostics_every >= 0, "train.diagnostics_every", "must be >= 0 (0: off)")
    need(t.update_entropy_every >= 0, "train.update_entropy_every", "must be >= 0 (0: off)")
    need(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in t.diagnostics_layers),
         "train.diagnostics_layers", f"must be a list of layer indices (e.g. [1]), got {t.diagnostics_layers!r}")
    # --- end diagnostics ---
    need(o.lr > 0 and math.isfinite(o.lr), "optim.lr", "must be a positive number")
    need(0 <= o.min_lr <= o.lr, "optim.min_lr", "must lie in [0, optim.lr]")
    need(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    need(o.schedule in ("cosine", "constant"), "optim.schedule", f"must be cosine or constant, got {o.schedule!r}")
    need(o.decay_steps is None or o.decay_steps >= 1, "optim.decay_steps", "must be >= 1")
    need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1/beta2", "must lie in [0, 1)")
    need(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    need(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0: off)")
    _validate_attention(cfg.attention)
    _validate_injection(cfg.injection)


def _validate_attention(a: AttentionConfig) -> None:
    """The attention section: a spec a config can hold (named presets, no hook) and per-layer
    changes that the spec accepts, each refused under its key (attention.layers.1.precision: ...)."""
    from ..model.attention import SETTINGS, AttentionSpec, SpecError
    if not isinstance(a.spec, AttentionSpec):
        raise ConfigError(f"attention.spec must be a flashguard.model.AttentionSpec, got {type(a.spec).__name__}")
    for name in ("precision", "stabilizer"):
        if not isinstance(getattr(a.spec, name), str):
            raise ConfigError(f"attention.{name} must be a name (a config is saved as TOML), got {getattr(a.spec, name)!r}")
    if a.spec.hooked:
        raise ConfigError("attention.delta_hook / output_hook are not config keys (the [injection] section "
                          "installs hooks)")
    for key, value in a.layers.items():
        where = f"attention.layers.{key}"
        if not str(key).isdigit():
            raise ConfigError(f"{where} must be a layer index (0, 1, ...)")
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a table of attention fields")
        for sub in value:
            if sub not in SETTINGS:
                raise ConfigError(f"{where}.{sub} is not an attention field; known: {', '.join(SETTINGS)}")
        try:
            a.spec.with_changes(value)
        except SpecError as e:
            raise ConfigError(f"{where}.{e.field}: {e.problem}") from None


def _validate_injection(inj: "InjectionConfig") -> None:
    layers = inj.layers
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers) \
            or len(set(layers)) != len(layers):
        raise ConfigError(f"injection.layers must be a list of distinct layer indices (e.g. [1]; empty: every "
                          f"flash layer), got {layers!r}")
    from ..attention.injection import RULES
    if inj.rule not in ("none", *RULES):
        raise ConfigError(f"injection.rule must be none (off) or one of {', '.join(RULES)}, got {inj.rule!r}")
    if inj.rule == "none":
        default = InjectionConfig()
        set_ = [k for k in ("alpha", "p", "layers", "seed", "reference", "point")
                if getattr(inj, k) != getattr(default, k)]
        if set_:
            raise ConfigError(f"injection.{set_[0]} is set but injection.rule = none (no injection); "
                              f"choose a rule: {', '.join(RULES)}")
        return
    injection_of(inj, seed=0)  # the one validation of the options (ErrorInjection's), named by key


def injection_of(inj: "InjectionConfig", seed: int):
    """The ErrorInjection of an [injection] section (None for rule = none); ``seed`` is used when
    injection.seed is unset (the trainer passes train.seed). ConfigError names a bad key."""
    if inj.rule == "none":
        return None
    from ..attention.injection import ErrorInjection
    try:
        return ErrorInjection(alpha=inj.alpha, rule=inj.rule, p=inj.p, seed=seed if inj.seed is None else inj.seed,
                              reference=inj.reference, point=inj.point)
    except ValueError as e:
        raise ConfigError(f"injection.{e}") from None


def parse_overrides(items: list[str]) -> dict:
    """["train.steps=100", "attention.layers.1.precision=fp32"] -> nested dict. Values are read
    as TOML literals (100, 1e-3, true, "x"); anything that is not one is taken as a string."""
    out: dict = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.steps=100)")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override")
        node[parts[-1]] = value
    return out


def _merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for k, v in extra.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged


def apply_overrides(cfg: RunConfig, items: list[str]) -> RunConfig:
    return config_from_dict(_merge(config_to_dict(cfg), parse_overrides(items)))


def load_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    raw: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            raw = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    return config_from_dict(_merge(raw, parse_overrides(list(overrides))))


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):  # (diagnostics)
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} to TOML")


def config_to_toml(cfg: RunConfig) -> str:
    lines = ["# flashguard run configuration (fully resolved)"]
    for section, values in config_to_dict(cfg).items():
        lines.append(f"\n[{section}]")
        tables = {}
        for k, v in values.items():
            if v is None:
                lines.append(f"# {k} = (unset)")
            elif isinstance(v, dict):
                tables[k] = v
            else:
                lines.append(f"{k} = {_toml_value(v)}")
        for k, table in tables.items():
            for sub, subtable in sorted(table.items(), key=lambda kv: int(kv[0])):
                items = ", ".join(f"{a} = {_toml_value(b)}" for a, b in subtable.items())
                lines.append(f'{k}."{sub}" = {{ {items} }}')
    return "\n".join(lines) + "\n"


def save_config(cfg: RunConfig, path: str | Path) -> None:
    from ..utils.atomic import atomic_write_text
    atomic_write_text(Path(path), config_to_toml(cfg))
