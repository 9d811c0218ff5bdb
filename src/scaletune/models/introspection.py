"""Model introspection: what the strategies, the planner and the loaders ask of a loaded model.

* :func:`unwrap`: the `transformers` model inside a peft or engine wrapper.
* :func:`max_positions`, :func:`decoder_layer_classes`, :func:`parameter_counts`.

Imports nothing else from :mod:`scaletune.models` (the bottom of the package).
"""

from __future__ import annotations

from typing import Any


def unwrap(model: Any) -> Any:
    """The `transformers` model inside a PeftModel (or a DDP/FSDP-style `.module` wrapper)."""
    while True:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
        elif hasattr(model, "module") and not hasattr(model, "config"):
            inner = model.module
        else:
            return model
        if inner is model:
            return model
        model = inner


def _config_of(model_or_config: Any) -> Any:
    cfg = getattr(unwrap(model_or_config), "config", model_or_config)
    return cfg


def max_positions(model_or_config: Any) -> int | None:
    """The longest sequence (tokens) the model's position encoding was built for, from
    `max_position_embeddings` (or `n_positions`, `max_sequence_length`, `seq_length`, `n_ctx`),
    looking into `text_config` for multimodal configs; None when the config names none.
    `model_or_config` is a model, its config, or a config.json read as a dict."""

    def get(c: Any, attr: str) -> Any:
        return c.get(attr) if isinstance(c, dict) else getattr(c, attr, None)

    cfg = model_or_config if isinstance(model_or_config, dict) else _config_of(model_or_config)
    for c in (cfg, get(cfg, "text_config")):
        if c is None:
            continue
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx"):
            v = get(c, attr)
            if isinstance(v, int) and v > 0:
                return v
    return None


def decoder_layer_classes(model: Any) -> set[type]:
    """The transformer block classes of `model` (FSDP2 `fully_shard`s each instance).

    From the model's `_no_split_modules` (the class names `transformers` never splits across
    devices: exactly the blocks), resolved to classes by walking the modules; where that names
    nothing present, the class(es) of the elements of the largest `nn.ModuleList`.

    Raises:
        ValueError: the model has neither.
    """
    from torch import nn

    base = unwrap(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(base).__name__}: no decoder layers found (no _no_split_modules, no ModuleList)")
    biggest = max(lists, key=len)
    return {type(m) for m in biggest}


def parameter_counts(model: Any) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit packed weights count as their unpacked size, ZeRO-3
    partitioned ones as their full size (`ds_numel`)."""
    if hasattr(model, "get_nb_trainable_parameters"):
        return model.get_nb_trainable_parameters()  # peft reads ds_numel itself

    def numel(p: Any) -> int:
        return int(getattr(p, "ds_numel", 0) or p.numel())

    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    total = sum(numel(p) for p in model.parameters())
    return trainable, total
