"""What the planner knows about a model: every parameter tensor (exact, from the model's config on
the meta device, LoRA adapters included) and the dimensions the activation estimate uses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from scaletune.resolve import RunSpec


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor of the meta model."""

    name: str
    shape: tuple[int, ...]
    trainable: bool
    quantized: bool  # a frozen Linear weight of a decoder layer stored 4-bit under QLoRA
    in_layer: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ModelShape:
    """What the planner needs to know about the model: every parameter tensor and the dimensions
    the activation estimate uses."""

    params: list[ParamInfo]
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    lora_modules: list[tuple[int, int]] = field(default_factory=list)  # (in_features, r) per target module per layer
    model_type: str = ""

    @property
    def total(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def trainable(self) -> int:
        return sum(p.numel for p in self.params if p.trainable)

    @property
    def frozen(self) -> int:
        return self.total - self.trainable


def meta_model(spec: RunSpec) -> torch.nn.Module:
    """The run's model on the meta device in its storage dtype (resolved precision), with LoRA if asked."""
    import torch

    from scaletune.models import DevicePlacement, apply_lora, load_model

    m = spec.config.model
    model_cfg = m.model_copy(update={"dtype": spec.precision.storage, "quantization": None})
    model = load_model(model_cfg, DevicePlacement(None, "cpu"), meta=True)
    if m.lora is not None:
        with torch.device("meta"):
            model = apply_lora(model, m.lora)
    return model


def model_shape(spec: RunSpec) -> ModelShape:
    """Count the parameters of the run's model exactly, from its config on the meta device."""
    from torch import nn

    from scaletune.models import decoder_layer_classes, load_config, unwrap

    cfg = spec.config
    hf_cfg = load_config(cfg.model)
    model = meta_model(spec)
    layer_types = tuple(decoder_layer_classes(model))
    layer_prefixes = [n for n, m in model.named_modules() if isinstance(m, layer_types)]
    linear_weights = {f"{n}.weight" for n, m in model.named_modules() if type(m) is nn.Linear}
    quant = cfg.model.quantization is not None
    params, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:  # tied embeddings: one tensor
            continue
        seen.add(id(p))
        in_layer = any(name.startswith(pre + ".") for pre in layer_prefixes)
        is_lora = "lora_" in name
        params.append(
            ParamInfo(
                name=name,
                shape=tuple(p.shape),
                trainable=bool(p.requires_grad),
                quantized=quant and in_layer and not is_lora and not p.requires_grad and name in linear_weights,
                in_layer=in_layer,
            )
        )
    lora_modules: list[tuple[int, int]] = []
    if cfg.model.lora is not None and layer_prefixes:
        first = layer_prefixes[0]
        for n, m in model.named_modules():
            if n.startswith(first + ".") and n.endswith("lora_A.default"):
                lora_modules.append((m.in_features, m.out_features))
    text = getattr(hf_cfg, "text_config", None) or hf_cfg
    hidden = int(getattr(text, "hidden_size", 0) or getattr(text, "n_embd", 0))
    heads = int(getattr(text, "num_attention_heads", 1))
    head_dim = int(getattr(text, "head_dim", None) or hidden // max(heads, 1))
    base = unwrap(model)
    return ModelShape(
        params=params,
        hidden=hidden,
        intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
        layers=len(layer_prefixes) or int(getattr(text, "num_hidden_layers", 1)),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab=int(base.get_output_embeddings().weight.shape[0]),
        lora_modules=lora_modules,
        model_type=str(getattr(text, "model_type", "")),
    )
