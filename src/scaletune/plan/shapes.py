"""What the planner knows about a model: every parameter tensor (exact, from the model's config on
the meta device, LoRA adapters included) and the dimensions the activation estimate uses."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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


@dataclass(frozen=True)
class VisionShape:
    """A vision-language model's vision tower, for its activations (`plan.activations`).

    Attributes:
        hidden, intermediate, layers, heads: the tower's (its config's `vision_config`).
        positions: the tower's sequence per image (the embeddings' `num_positions`: patches, and
            CLIP's class position).
        pixels: the values of one image the tower takes (`num_channels x image_size^2`), which its
            patch embedding (a convolution) saves for backward.
        trains: some parameter of the tower trains (in the stage counted): a frozen tower's forward
            saves nothing for backward.
    """

    hidden: int
    intermediate: int
    layers: int
    heads: int
    positions: int
    pixels: int
    trains: bool


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
    activations: int | None = None  # a factory's model: bytes autograd saved in a meta forward of one micro-batch
    stage: str | None = None  # with stage patterns: the stage whose trainable set is counted (the largest)
    vision: VisionShape | None = None  # a vision-language model's tower (`layers` etc. are its language model's)

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
    """The run's Hugging Face model on the meta device (`modelsetup.meta_model`)."""
    from scaletune.trainer.model_setup import meta_model as build

    return build(spec)


def _peak_trainable(spec: RunSpec, model: torch.nn.Module) -> tuple[set[str] | None, str | None]:
    """With stage patterns: the names that train in the stage training the most, and its name."""
    from scaletune.trainer.freezing import peak_stage, trainable_sets

    sets = trainable_sets(model, spec.stages, numbered=bool(spec.config.stages))
    peak = peak_stage(sets, model)
    return (None, None) if peak is None else (set(sets[peak]), spec.stages[peak].name)


def factory_shape(spec: RunSpec) -> ModelShape:
    """A factory's module on the meta device: every parameter exactly, the blocks (`shard_modules`)
    as layers, and the activations measured by running one micro-batch of the first stage's data
    through it on the meta device (`factorycheck.meta_forward`: the bytes autograd saves; 0 with a
    note when the data or the forward cannot run there)."""
    from scaletune.plan.factory_check import meta_forward, meta_run

    run = meta_run(spec)
    model = run.loss.model
    try:
        activations = meta_forward(run.loss, run.batch)
    except Exception as exc:  # an op that needs values: the estimate is left out
        activations = 0
        print(
            f"[scaletune] plan: activations of {spec.config.model.factory} not measured ({type(exc).__name__}: {exc})"
        )
    blocks = tuple(type(m) for m in run.loss.modules() if type(m).__name__ in run.loss._no_split_modules)
    prefixes = [n for n, m in model.named_modules() if isinstance(m, blocks)] if blocks else []
    peak, stage = _peak_trainable(spec, model)
    params, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            trainable = p.requires_grad if peak is None else name in peak
            in_layer = any(name.startswith(pre + ".") for pre in prefixes)
            params.append(ParamInfo(name, tuple(p.shape), trainable, False, in_layer))
    hidden = max((p.shape[-1] for p in params if len(p.shape) == 2), default=0)
    return ModelShape(
        params=params,
        hidden=hidden,
        intermediate=0,
        layers=len(prefixes),
        heads=0,
        kv_heads=0,
        head_dim=0,
        vocab=0,
        model_type=f"factory {spec.config.model.factory}",
        activations=activations,
        stage=stage,
    )


def model_shape(spec: RunSpec) -> ModelShape:
    """Count the parameters of the run's model exactly, from its config on the meta device (a
    factory's module: :func:`factory_shape`). With stage patterns, the trainable parameters are
    those of the stage that trains the most."""
    from torch import nn

    from scaletune.models import decoder_layer_classes, load_config, unwrap

    if spec.custom_model:
        return factory_shape(spec)
    cfg = spec.config
    hf_cfg = load_config(cfg.model)
    model = meta_model(spec)
    peak, stage = _peak_trainable(spec, model)
    layer_types = tuple(decoder_layer_classes(model))
    layer_prefixes = [n for n, m in model.named_modules() if isinstance(m, layer_types)]
    vision = _vision_shape(model, hf_cfg, peak)
    if vision is not None:  # the blocks of the tower are among the model's blocks: the language model's layers
        language = {id(m) for m in unwrap(model).get_decoder().modules()}
        text_layers = [n for n, m in model.named_modules() if isinstance(m, layer_types) and id(m) in language]
    else:
        text_layers = layer_prefixes
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
                trainable=bool(p.requires_grad) if peak is None else name in peak,
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
        layers=len(text_layers) or int(getattr(text, "num_hidden_layers", 1)),
        heads=heads,
        kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        vocab=int(base.get_output_embeddings().weight.shape[0]),
        lora_modules=lora_modules,
        model_type=str(getattr(hf_cfg if vision is not None else text, "model_type", "")),
        stage=stage,
        vision=vision,
    )


def _vision_shape(model: torch.nn.Module, hf_cfg: Any, peak: set[str] | None) -> VisionShape | None:
    """The vision tower's :class:`VisionShape` (None for a text model): its dimensions from the
    config's `vision_config`, its positions per image from its embeddings' `num_positions` (found
    in the `vision` group of `models.vision.parameter_groups`)."""
    from scaletune.models.vision import parameter_groups

    groups = parameter_groups(model)
    if not groups:
        return None
    prefixes = [g.removesuffix(".*") for g in groups["vision"]]
    modules = [m for n, m in model.named_modules() if any(n == p or n.startswith(p + ".") for p in prefixes)]
    positions = next((m.num_positions for m in modules if isinstance(getattr(m, "num_positions", None), int)), 0)
    in_tower = [(n, p) for n, p in model.named_parameters() if any(n.startswith(pre + ".") for pre in prefixes)]
    trains = any(p.requires_grad if peak is None else n in peak for n, p in in_tower)
    v = hf_cfg.vision_config
    return VisionShape(
        hidden=int(v.hidden_size),
        intermediate=int(getattr(v, "intermediate_size", None) or 4 * v.hidden_size),
        layers=int(v.num_hidden_layers),
        heads=int(v.num_attention_heads),
        positions=int(positions),
        pixels=int(getattr(v, "num_channels", 3)) * int(getattr(v, "image_size", 0)) ** 2,
        trains=trains,
    )
