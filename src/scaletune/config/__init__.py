"""Config: the typed schema (a docstring per field), YAML loading with overrides, error formatting."""

from scaletune.config.loader import (
    LoadedConfig,
    dump_config,
    error_messages,
    load_config,
    read_config,
    redacted,
)
from scaletune.config.overrides import parse_override, public_overrides
from scaletune.config.schema import (
    Config,
    DataConfig,
    DataSource,
    DistributedConfig,
    Dtype,
    DummyData,
    LoggingConfig,
    LoraConfig,
    MlflowConfig,
    ModelConfig,
    QuantizationConfig,
    StageConfig,
    StageData,
    StageTraining,
    TrainingConfig,
    WandbConfig,
)
from scaletune.config.secrets import is_secret_name, secret_names

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
    "MlflowConfig",
    "ModelConfig",
    "QuantizationConfig",
    "StageConfig",
    "StageData",
    "StageTraining",
    "TrainingConfig",
    "WandbConfig",
    "dump_config",
    "error_messages",
    "is_secret_name",
    "load_config",
    "parse_override",
    "public_overrides",
    "read_config",
    "redacted",
    "secret_names",
]
