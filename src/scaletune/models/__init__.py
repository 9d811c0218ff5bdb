"""Models: presets, loading, device placement, adapters (LoRA, quantization, Liger, compile) and introspection."""

# Everything that turns `model:` of the YAML into a `torch.nn.Module` lives in this package.
# Submodules, bottom up (each imports only those before it): introspection; placement, pretrained,
# presets; loading; adapters. The names below are the package's interface: import them from
# `scaletune.models`. Callers that look a function up on this package at call time (doctor reads
# `models.enable_gradient_checkpointing`) see what is bound here, so patching the package reaches them.

from __future__ import annotations

from scaletune.models.adapters import (
    LORA_TARGETS,
    apply_liger_kernels,
    apply_lora,
    compile_decoder_layers,
    enable_gradient_checkpointing,
    is_quantized,
    lora_target_modules,
    prepare_model,
    require_liger,
)
from scaletune.models.initialize import (
    init_model,
    tokenizer_from_file,  # noqa: F401  (benchmarks/bench.py imports it)
)
from scaletune.models.introspection import decoder_layer_classes, max_positions, parameter_counts, unwrap
from scaletune.models.loading import bnb_config, load_config, load_model, load_tokenizer
from scaletune.models.placement import DevicePlacement, resolve_device_map
from scaletune.models.presets import ASSETS, OLMO2_TOKENIZER, PRESETS, Preset, get_preset, preset_config
from scaletune.models.pretrained import PRETRAINED, copy_pretrained, models_cache, pretrained_path

__all__ = [
    "ASSETS",
    "LORA_TARGETS",
    "OLMO2_TOKENIZER",
    "PRESETS",
    "PRETRAINED",
    "DevicePlacement",
    "Preset",
    "apply_liger_kernels",
    "apply_lora",
    "bnb_config",
    "compile_decoder_layers",
    "copy_pretrained",
    "decoder_layer_classes",
    "enable_gradient_checkpointing",
    "get_preset",
    "init_model",
    "is_quantized",
    "load_config",
    "load_model",
    "load_tokenizer",
    "lora_target_modules",
    "max_positions",
    "models_cache",
    "parameter_counts",
    "prepare_model",
    "preset_config",
    "pretrained_path",
    "require_liger",
    "resolve_device_map",
    "unwrap",
]
