"""Training: typed configuration, the loop (with its hook interface and logger), schedule and checkpoints."""
from .checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from .config import (AttentionConfig, ConfigError, DataConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig,
                     apply_overrides, config_to_toml, load_config, save_config)
from .hooks import RunInfo, StepInfo, TrainHook
from .loop import EXIT_CONFIG, EXIT_DIVERGED, EXIT_OK, JsonlLog, TrainResult, build_model, train
from .schedule import learning_rate

__all__ = ["train", "TrainResult", "build_model", "load_config", "save_config", "apply_overrides", "config_to_toml",
           "RunConfig", "DataConfig", "ModelConfig", "AttentionConfig", "OptimConfig", "TrainConfig", "ConfigError",
           "learning_rate", "latest_checkpoint", "list_checkpoints", "load_checkpoint", "JsonlLog",
           "EXIT_OK", "EXIT_CONFIG", "EXIT_DIVERGED", "TrainHook", "RunInfo", "StepInfo"]
