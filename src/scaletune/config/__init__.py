"""Config: the typed schema (a docstring per field), YAML loading with overrides, error formatting."""

from scaletune.config.loader import LoadedConfig, dump_config, load_config, parse_override, read_config, redacted
from scaletune.config.schema import (
    Config,
    DataConfig,
    DataSource,
    DistributedConfig,
    Dtype,
    DummyData,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    QuantizationConfig,
    StageConfig,
    StageData,
    StageTraining,
    TrainingConfig,
    WandbConfig,
)
from scaletune.config.secrets import is_secret_name, public_overrides, secret_names

__all__ = [
    "Config",
    "DataConfig",
    "DataSource",
    "DistributedConfig",
    "Dtype",
    "DummyData",
    "LoadedConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "QuantizationConfig",
    "StageConfig",
    "StageData",
    "StageTraining",
    "TrainingConfig",
    "WandbConfig",
    "dump_config",
    "is_secret_name",
    "load_config",
    "parse_override",
    "public_overrides",
    "read_config",
    "redacted",
    "secret_names",
]
