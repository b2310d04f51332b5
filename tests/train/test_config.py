from __future__ import annotations

import pytest

from flashguard.train import ConfigError, apply_overrides, config_to_toml, learning_rate, load_config
from flashguard.train.config import OptimConfig, config_from_dict

from run_helpers import ROOT


@pytest.mark.parametrize("name", ["tiny-cpu", "gpt2-124m-owt", "micro"])
def test_shipped_configs_load_and_round_trip(name, tmp_path):
    cfg = load_config(ROOT / "configs" / f"{name}.toml")
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg


def test_overrides_are_typed_and_dotted(tmp_path):
    cfg = load_config(ROOT / "configs" / "micro.toml",
                      ["train.steps=7", "optim.lr=3e-4", "attention.precision=fa2", "train.tensorboard=true",
                       "attention.layers.1.precision=fp32", "model.attn_softcap=30"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 3e-4 and cfg.attention.spec.precision == "fa2"
    assert cfg.train.tensorboard is True and cfg.model.attn_softcap == 30.0
    assert cfg.attention.layers == {"1": {"precision": "fp32"}}
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg
    assert apply_overrides(cfg, ["train.seed=5"]).train.seed == 5


@pytest.mark.parametrize("override,msg", [
    ("train.stepz=5", r"train\.stepz"),
    ("trian.steps=5", r"\btrian\b"),
    ("train.steps=five", r"^train\.steps.*\bint\b"),   # the key, the type it takes
    ("train.steps=2.5", r"^train\.steps.*\bint\b"),
    ("optim.lr=-1", "optim.lr"),
    ("train.autocast=fp8", "train.autocast"),
    ("attention.backend=cuda", "attention.backend"),
    ("attention.layers.x.precision=fp32", "attention.layers.x"),
    ("attention.layers.1.colour=red", "attention.layers.1.colour"),
    # the config key first, then the value refused and what is known
    ("attention.precision=papr", r"^attention\.precision:.*'papr'.*\bfp32\b"),
    ("attention.stabilizer=sfe", r"^attention\.stabilizer:.*'sfe'.*\bnone\b"),
    ("attention.layers.1.precision=fp31", r"^attention\.layers\.1\.precision:.*'fp31'"),
    ("attention.layers.0.stabilizer=3", r"^attention\.layers\.0\.stabilizer:.*\bint$"),
    ("attention.kernel=cuda", r"^attention\.kernel:.*'cuda'.*auto, pytorch, triton"),
    ("attention.kernel=triton", r"^attention\.kernel:.*triton.*'paper'"),
    ("attention.layers.1.kernel=triton", r"^attention\.layers\.1\.kernel:.*triton"),
    ("attention.block_q=0", r"^attention\.block_q:.*\b0$"),
    ("attention.layers.1.block_k=true", r"^attention\.layers\.1\.block_k:.*True$"),
    ("attention.spec=x", r"attention\.spec\b"),
    ("attention.delta_hook=x", r"attention\.delta_hook\b"),
    ("data.batch_size=10", "data.batch_size"),  # with grad_accum = 4 below
    ("train.steps", "not key=value"),
])
def test_bad_config_names_the_key(override, msg):
    extra = ["train.grad_accum=4"] if override.startswith("data.batch_size") else []
    with pytest.raises(ConfigError, match=msg):
        load_config(ROOT / "configs" / "micro.toml", [override] + extra)


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="must be a table"):
        config_from_dict({"train": 5})


def test_schedule_warmup_cosine_and_floor():
    o = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert learning_rate(0, o, 110) == pytest.approx(0.1)
    assert learning_rate(9, o, 110) == pytest.approx(1.0)
    assert learning_rate(10, o, 110) == pytest.approx(1.0)
    assert learning_rate(60, o, 110) == pytest.approx(0.55)
    assert learning_rate(110, o, 110) == pytest.approx(0.1)
    assert learning_rate(500, o, 110) == pytest.approx(0.1)
    c = OptimConfig(lr=1.0, warmup_steps=0, schedule="constant")
    assert learning_rate(0, c, 10) == learning_rate(9, c, 10) == 1.0


def test_attention_section_holds_the_models_spec(tmp_path):
    """[attention] is flashguard.model.AttentionSpec: its settings are the keys, kernel and tiles
    included, saved with the run and rebuilt per layer as the model's specs."""
    from flashguard.model import AttentionSpec
    cfg = load_config(ROOT / "configs" / "micro.toml",
                      ["attention.precision=fa2", "attention.kernel=pytorch", "attention.block_q=64",
                       "attention.layers.1.kernel=triton", "attention.layers.1.block_k=32"])
    assert cfg.attention.spec == AttentionSpec("flash", precision="fa2", stabilizer="none", block_q=64,
                                               kernel="pytorch")
    text = config_to_toml(cfg)
    try:
        import tomllib
    except ModuleNotFoundError:   # Python < 3.11
        import tomli as tomllib
    saved = tomllib.loads(text)["attention"]
    assert (saved["kernel"], saved["block_q"]) == ("pytorch", 64)
    assert saved["layers"] == {"1": {"kernel": "triton", "block_k": 32}}   # a layer keeps only what it changes
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load_config(path) == cfg
    specs = cfg.attention.specs(2)
    assert specs[0].kernel == "pytorch" and (specs[1].kernel, specs[1].block_q, specs[1].block_k) == ("triton", 64, 32)
    # an older run's config.toml (no kernel key) loads with the default kernel
    old = tmp_path / "old.toml"
    old.write_text('[attention]\nbackend = "flash"\nprecision = "fa2"\n')
    assert load_config(old).attention.spec.kernel == "auto"
    # a saved sdpa run names every setting and still loads
    sdpa = load_config(ROOT / "configs" / "micro.toml", ["attention.backend=sdpa"])
    path.write_text(config_to_toml(sdpa))
    assert load_config(path).attention.spec.backend == "sdpa"
