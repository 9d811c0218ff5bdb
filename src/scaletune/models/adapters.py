"""What goes on a loaded model before training: LoRA, k-bit preparation, gradient
checkpointing, `torch.compile` of the decoder layers and Liger's kernels, and
:func:`prepare_model`, which loads the model and applies them in order.

* :func:`lora_target_modules`, :func:`apply_lora`, :func:`is_quantized`.
* :func:`enable_gradient_checkpointing` (non-reentrant), :func:`compile_decoder_layers`.
* :func:`require_liger`, :func:`apply_liger_kernels`: `model.liger` (Liger's Triton kernels, CUDA).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scaletune.config import LoraConfig, ModelConfig, error_messages
from scaletune.errors import UserError
from scaletune.models.introspection import decoder_layer_classes, parameter_counts, unwrap
from scaletune.models.loading import load_model

if TYPE_CHECKING:  # torch and peft are imported lazily: `scaletune --help` stays fast
    import peft
    import torch

    from scaletune.models.placement import DevicePlacement

# A child of the "scaletune" logger, whose handler and rank-aware level (env.set_rank) it follows.
log = logging.getLogger(__name__)

# The attention and MLP projections of each known architecture (`config.model_type`), as the
# QLoRA paper recommends (all linear layers of the blocks, not only q/v).
_LLAMA_LIKE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: dict[str, list[str]] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "olmo": _LLAMA_LIKE,
    "olmo2": _LLAMA_LIKE,
    "gemma": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


def lora_target_modules(model: Any) -> list[str]:
    """Module names for peft's `target_modules` when `model.lora.target_modules` is `auto`.

    Known architectures (:data:`LORA_TARGETS`, by `config.model_type`): their attention and MLP
    projections, keeping those present in the model. Otherwise every `nn.Linear` inside the
    decoder layers (:func:`decoder_layer_classes`), by leaf name, never the `lm_head`; a leaf
    name that also names a Linear outside the blocks is given by its full path instead, so peft's
    suffix matching cannot reach beyond the blocks.
    """
    from torch import nn

    from scaletune.models.vision import is_vision_language

    base = unwrap(model)
    if is_vision_language(getattr(base, "config", None)):
        return _language_targets(base)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    linear_leaves = {n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, nn.Linear)}
    known = LORA_TARGETS.get(model_type or "")
    if known:
        present = [t for t in known if t in linear_leaves]
        if present:
            return present
    layer_types = tuple(decoder_layer_classes(base))
    inside: dict[str, list[str]] = {}
    outside: set[str] = set()
    block_prefixes = [n for n, m in base.named_modules() if isinstance(m, layer_types)]
    for n, m in base.named_modules():
        if not isinstance(m, nn.Linear):
            continue
        leaf = n.rsplit(".", 1)[-1]
        if any(n.startswith(p + ".") for p in block_prefixes):
            inside.setdefault(leaf, []).append(n)
        else:
            outside.add(leaf)
    targets: list[str] = []
    for leaf, full in inside.items():
        targets.extend(full if leaf in outside else [leaf])
    log.info(
        f"LoRA target_modules auto: architecture {model_type!r} is not in the known list; "
        f"targeting every Linear of the decoder layers: {', '.join(targets)}"
    )
    return targets


def _language_targets(base: Any) -> list[str]:
    """A vision-language model's LoRA targets: the Linear layers of its language model only
    (transformers' `get_decoder()`: the vision tower's attention shares the leaf names `q_proj`, ...),
    by full path so peft's suffix matching reaches no other; those of :data:`LORA_TARGETS` for the
    language model's architecture where it is known, else every one inside its decoder layers."""
    from torch import nn

    language = base.get_decoder()
    prefix = next(n for n, m in base.named_modules() if m is language)
    known = LORA_TARGETS.get(base.config.get_text_config().model_type)
    layer_types = tuple(decoder_layer_classes(language))
    targets = []
    for block_name, block in language.named_modules():
        if not isinstance(block, layer_types):
            continue
        for n, m in block.named_modules():
            if isinstance(m, nn.Linear) and (known is None or n.rsplit(".", 1)[-1] in known):
                targets.append(f"{prefix}.{block_name}.{n}")
    return targets


def _to_peft_config(model: Any, lora: LoraConfig | Mapping | Any) -> Any:
    import peft
    from pydantic import ValidationError

    if isinstance(lora, peft.LoraConfig):
        cfg = lora
        changes: dict[str, Any] = {}
        if cfg.task_type is None:
            changes["task_type"] = peft.TaskType.CAUSAL_LM
        if cfg.target_modules is None:
            # peft's own default is q/v only for Llama and nothing for unknown architectures.
            changes["target_modules"] = lora_target_modules(model)
        if changes:
            import dataclasses

            cfg = dataclasses.replace(cfg, **changes)
        return cfg
    if isinstance(lora, Mapping):
        try:
            lora = LoraConfig.model_validate(dict(lora))
        except ValidationError as exc:
            raise UserError(error_messages(exc, "lora"), title="invalid LoRA config") from None
    if not isinstance(lora, LoraConfig):
        raise TypeError(
            f"lora must be a scaletune LoraConfig, a peft LoraConfig or a mapping, not {type(lora).__name__}"
        )
    targets = lora_target_modules(model) if lora.target_modules == "auto" else list(lora.target_modules)
    return peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=targets,
        bias=lora.bias,
        task_type=peft.TaskType.CAUSAL_LM,
    )


def is_quantized(model: Any) -> bool:
    """True for a bitsandbytes 4/8-bit model (or another `transformers` quantizer)."""
    base = unwrap(model)
    return bool(
        getattr(base, "is_loaded_in_4bit", False)
        or getattr(base, "is_loaded_in_8bit", False)
        or getattr(base, "is_quantized", False)
        or getattr(base, "hf_quantizer", None) is not None
    )


def apply_lora(model: Any, lora: LoraConfig | Mapping | peft.LoraConfig) -> peft.PeftModel:
    """Wrap `model` in LoRA adapters with `peft.get_peft_model` (task CAUSAL_LM).

    `lora` is the YAML's `model.lora` (a :class:`~scaletune.config.LoraConfig` or the same
    mapping) or a `peft.LoraConfig`; `target_modules: auto` (or a peft config without targets)
    means :func:`lora_target_modules`. A quantized model first goes through
    `peft.prepare_model_for_kbit_training` (base frozen, norms upcast to float32), with its
    checkpointing left to :func:`enable_gradient_checkpointing`, which uses the non-reentrant
    variant that DDP accepts.

    Raises:
        UserError: an invalid LoRA mapping.
    """
    import peft

    peft_cfg = _to_peft_config(model, lora)
    if is_quantized(model):
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    with quiet_peft():
        return peft.get_peft_model(model, peft_cfg)


def save_adapter(
    model: peft.PeftModel,
    out_dir: Path,
    weights: Mapping[str, torch.Tensor] | None = None,
    trained_base: Iterable[str] = (),
) -> list[str]:
    """`model.save_pretrained(out_dir)`: the adapter (from `weights` where given, keyed as the
    model's parameters), and the base weights named in `trained_base` beside it, as peft saves
    `modules_to_save` (peft 0.21 utils/save_and_load.py): each under its parameter name in
    adapter_model.safetensors, its module in adapter_config.json's `modules_to_save`. So
    `PeftModel.from_pretrained` wraps those modules and loads the trained weights over the base's
    (a module's weights that did not train stay the base's: peft copies the base module when it
    wraps it). Without them a LoRA run whose stage trained base weights beside the adapters (a
    vision-language model's projector) would lose them from its adapter folder.

    Args:
        trained_base: names of the model's parameters (`base_model.model.<name>`) that trained and
            are no adapter weights.

    Returns:
        The modules added to `modules_to_save` (their names in the base model).
    """
    import json

    from safetensors.torch import load_file, save_file

    model.save_pretrained(str(out_dir), **({"state_dict": dict(weights)} if weights is not None else {}))
    names = sorted(trained_base)
    if not names:
        return []
    values = weights if weights is not None else model.state_dict()
    path = out_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    tensors.update({n: values[n].detach().to("cpu").contiguous() for n in names})
    save_file(tensors, str(path), metadata={"format": "pt"})
    modules = sorted({n.removeprefix("base_model.model.").rsplit(".", 1)[0] for n in names})
    config_path = out_dir / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["modules_to_save"] = sorted({*(config.get("modules_to_save") or []), *modules})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return modules


def trained_base_weights(model: peft.PeftModel, names: Iterable[str]) -> list[str]:
    """Of `names` (the model's parameter names), those that are no adapter weights (peft's tuner
    prefix, `lora_`, in no part of the name)."""
    prefix = model.base_model.prefix
    return [n for n in names if not any(part.startswith(prefix) for part in n.split("."))]


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Around peft's model wrapping: peft (0.17 to 0.21) reads the deprecated
    `model.is_gradient_checkpointing` when it wraps a model, and transformers 5 then warns on every
    LoRA run and adapter load about a call that is neither ours nor the user's to change."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def enable_gradient_checkpointing(model: Any, *, use_reentrant: bool = False) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of storing them.

    Uses PyTorch's non-reentrant checkpoint (`use_reentrant=False`) by default. The reentrant
    variant runs each layer's backward in a nested autograd call, so DDP's reducer sees the
    layer's parameters become ready from inside another backward, which fails with "Expected to
    mark a variable ready only once" whenever DDP searches for unused parameters (as HF Trainer
    does for a PeftModel); it also ignores keyword arguments and breaks with FSDP2. Sets
    `config.use_cache = False` (a KV cache is useless in training and conflicts with
    recomputation).

    Raises:
        ValueError: the architecture does not support checkpointing.
    """
    base = unwrap(model)
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(base, "activation_checkpointing_enable"):
        # transformers 5 renamed gradient_checkpointing_enable (kept as a deprecated alias).
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if use_reentrant and hasattr(base, "enable_input_require_grads"):
        # Reentrant checkpointing is an autograd.Function that joins the backward graph only if one
        # of its tensor inputs requires grad. With LoRA the embeddings are frozen, so the hidden
        # states entering layer 0 do not, and the LoRA weights inside get no gradient at all; making
        # the embedding output require grad fixes that. Non-reentrant checkpointing records the
        # layer's own operations through saved-tensor hooks, so parameters inside receive gradients
        # whatever the inputs, and needs no such hook. (transformers >= 5 registers it anyway.)
        base.enable_input_require_grads()
    base.config.use_cache = False
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = sum(isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing for m in base.modules())
    kind = "reentrant" if use_reentrant else "non-reentrant"
    log.info(f"gradient checkpointing: {layers} layers recompute their activations in backward ({kind})")


def compile_decoder_layers(model: Any) -> int:
    """`torch.compile` every decoder layer in place (`nn.Module.compile`); returns how many.

    Per block, as torchtitan does (`apply_compile`): each layer compiles once and the other layers
    reuse the graph; the model's own code around the blocks (embedding, mask building, head) stays
    eager, and FSDP2 can still `fully_shard` each compiled block. Compilation happens at the first
    forward; shapes that vary between batches (unpacked data) recompile once, then run dynamic.
    """
    classes = decoder_layer_classes(model)
    layers = [m for m in model.modules() if type(m) in classes]
    for layer in layers:
        layer.compile()
    log.info(f"torch.compile: {len(layers)} decoder layers (compiled at the first forward)")
    return len(layers)


def require_liger() -> None:
    """Check that this environment can run Liger's kernels (`model.liger`): a CUDA GPU first, then
    the liger-kernel package. liger_kernel is not imported here (it needs Triton).

    Raises:
        RuntimeError: no CUDA GPU is visible, or liger-kernel is not installed.
    """
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(
            "model.liger asks for Liger's Triton kernels, which need a CUDA GPU, and none is visible "
            "here. Set model.liger: false (scaletune's chunked loss runs on any device) or run on a "
            "GPU machine."
        )
    if importlib.util.find_spec("liger_kernel") is None:
        raise RuntimeError(
            "model.liger asks for Liger's kernels, but liger-kernel is not installed: pip install 'scaletune[liger]'"
        )


def apply_liger_kernels(model: torch.nn.Module) -> bool:
    """Swap a loaded model's RMSNorm, rotary embedding and SwiGLU MLP for Liger's Triton kernels.

    Liger-Kernel (https://github.com/linkedin/Liger-Kernel) `_apply_liger_kernel_to_instance`
    from `liger_kernel.transformers.monkey_patch`, its entry point for an already instantiated
    model: it looks up the architecture's `apply_liger_kernel_to_*` by `config.model_type` and
    rebinds the `forward` of the existing norm and MLP modules, so parameters and state-dict keys
    are unchanged. Its cross-entropy patches are turned off: the
    loss is `loss.CausalLMLoss`'s (Liger's fused linear cross-entropy when `model.liger`), and the
    model's own forward keeps returning logits (evaluation, export, the Gemma-2 soft-cap path).

    Liger also rebinds names in the architecture's `transformers` modeling module (the rotary
    function, the norm and MLP classes), so models of that architecture built later in the same
    process get the kernels too.

    Args:
        model: the `transformers` causal LM (a peft or engine wrapper around it is unwrapped),
            before LoRA is applied.

    Returns:
        True when kernels were applied; False, with a warning, for an architecture Liger has no
        kernels for (the loss still uses Liger's).

    Raises:
        RuntimeError: no CUDA GPU, or liger-kernel is not installed (:func:`require_liger`).
    """
    require_liger()
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    base = unwrap(model)
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        # Liger itself only logs this at INFO; say it where the user looks.
        log.warning(
            f"model.liger: Liger has no RMSNorm/RoPE/SwiGLU kernels for architecture {model_type!r} "
            f"(it has them for {', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); only the loss uses Liger"
        )
        return False
    _apply_liger_kernel_to_instance(
        model=base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    log.info(f"model.liger: Liger's RMSNorm, RoPE and SwiGLU kernels applied to {type(base).__name__}")
    return True


def prepare_model(
    cfg: ModelConfig, placement: DevicePlacement, *, meta: bool = False, frozen: bool = False
) -> torch.nn.Module:
    """:func:`load_model`, then Liger's kernels (`cfg.liger`), then LoRA (`cfg.lora`), then
    gradient checkpointing (`cfg.gradient_checkpointing`), then `torch.compile` of the decoder
    layers (`cfg.compile`); logs the trainable and total parameter counts (`frozen`: the total
    only, for a model that never trains: a reference or a distillation teacher).

    Liger's environment (CUDA, liger-kernel) is checked before any weight is read. Its kernels
    go in before LoRA so that they patch the model's own modules (peft then wraps the Linear
    layers inside the patched MLPs); LoRA comes before checkpointing so that the checkpointed
    layers are the ones holding the adapters, and a quantized base is prepared for k-bit
    training before either.

    Raises:
        RuntimeError: `cfg.liger` without a CUDA GPU or without liger-kernel.
        what :func:`load_model` and :func:`apply_lora` raise.
    """
    if cfg.liger:
        require_liger()
    model = load_model(cfg, placement, meta=meta)
    if cfg.liger:
        apply_liger_kernels(model)
    if cfg.lora is not None:
        model = apply_lora(model, cfg.lora)
    # `auto` is the planner's to decide (resolve); a model config no run resolved (inference,
    # export) keeps it off, as the planner does without device memory.
    if cfg.gradient_checkpointing is True:
        enable_gradient_checkpointing(model)
    if cfg.compile:
        compile_decoder_layers(model)
    trainable, total = parameter_counts(model)
    if frozen:
        log.info(
            f"model {cfg.name_or_path}: {total:,} parameters, frozen (not trained){', meta device' if meta else ''}"
        )
        return model
    kind = "LoRA" if cfg.lora is not None else "full fine-tuning"
    log.info(
        f"model {cfg.name_or_path}: {trainable:,} trainable of {total:,} parameters "
        f"({100 * trainable / max(total, 1):.2f}%, {kind}{', meta device' if meta else ''})"
    )
    return model
