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
    assert cfg.train.steps == 7 and cfg.optim.lr == 3e-4 and cfg.attention.precision == "fa2"
    assert cfg.train.tensorboard is True and cfg.model.attn_softcap == 30.0
    assert cfg.attention.layers == {"1": {"precision": "fp32"}}
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(cfg))
    assert load_config(path) == cfg
    assert apply_overrides(cfg, ["train.seed=5"]).train.seed == 5


@pytest.mark.parametrize("override,msg", [
    ("train.stepz=5", "unknown config key train.stepz"),
    ("trian.steps=5", "unknown config section"),
    ("train.steps=five", "train.steps must be int"),
    ("train.steps=2.5", "train.steps must be int"),
    ("optim.lr=-1", "optim.lr"),
    ("train.autocast=fp8", "train.autocast"),
    ("attention.backend=cuda", "attention.backend"),
    ("attention.layers.x.precision=fp32", "attention.layers.x"),
    ("attention.layers.1.colour=red", "attention.layers.1.colour"),
    ("attention.precision=papr", r"^attention\.precision: unknown precision policy 'papr'; presets: fp32"),
    ("attention.stabilizer=sfe", r"^attention\.stabilizer: unknown stabilizer 'sfe'; known: none"),
    ("attention.layers.1.precision=fp31", r"^attention\.layers\.1\.precision: unknown precision policy"),
    ("attention.layers.0.stabilizer=3", r"^attention\.layers\.0\.stabilizer: stabilizer must be a name"),
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
