"""scaletune's model loading for people who keep their own Hugging Face `Trainer` / TRL scripts.

::

    from transformers import Trainer
    from scaletune.hf import load_model_for_training, training_arguments

    model, tokenizer = load_model_for_training(
        "meta-llama/Llama-3.2-1B", lora={"r": 16, "alpha": 32}, gradient_checkpointing=True
    )
    args = training_arguments(output_dir="out", per_device_train_batch_size=4, gradient_checkpointing=True)
    Trainer(model=model, args=args, train_dataset=..., processing_class=tokenizer).train()

The same script then runs as one process (`python train.py`: `device_map="auto"` spreads a model
too large for one GPU over all of them) and under `torchrun` / `accelerate launch` / the
deepspeed launcher (each rank loads its own copy onto its own GPU, `device_map` set aside with a
log line saying why), with LoRA, k-bit quantization and activation checkpointing set up exactly
as `scaletune train` does (:mod:`scaletune.models`).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from scaletune.config import LoraConfig, ModelConfig, QuantizationConfig, error_messages
from scaletune.env import DistributedEnv, configure_logging
from scaletune.errors import UserError
from scaletune.models import (
    apply_lora,
    enable_gradient_checkpointing,
    load_model,
    load_tokenizer,
    parameter_counts,
    resolve_device_map,
)
from scaletune.resolve import quantization_problem

log = logging.getLogger(__name__)

__all__ = ["load_model_for_training", "training_arguments"]


def _dtype_name(dtype: Any) -> str:
    if dtype is None:
        # The checkpoint's own dtype, as from_pretrained does by default in transformers 5.
        return "auto"
    if isinstance(dtype, str):
        return dtype
    name = str(dtype).removeprefix("torch.")
    return name


# How long the exit handler leaves the GIL to gloo's worker threads (seconds): far above the
# microseconds a worker needs to release a finished collective, short against a training run.
_WORKER_DRAIN_S = 0.25


def _destroy_process_group() -> None:
    import time

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # destroy_process_group joins gloo's threads only when nothing else holds the group, and
        # the Trainer's DDP wrapper still does (gloo has no shutdown of its own in torch 2.13), so
        # the threads live on into finalization. Sleeping releases the GIL while the interpreter
        # still answers: a worker that just finished the last collective takes it now and drops
        # its tensors, instead of asking during finalization (the abort the docstring below names).
        time.sleep(_WORKER_DRAIN_S)


@functools.cache
def _destroy_process_group_at_exit() -> None:
    """Destroy the default process group at interpreter exit, if one is still up then.

    A user's Trainer script never destroys the group accelerate starts for it. gloo's worker threads
    then outlive Python: one still releasing a finished collective (the tensors it holds have Python
    objects) asks for the GIL while the interpreter finalizes, CPython ends that thread with a
    forced unwind through a noexcept destructor, and the rank dies with "terminate called without an
    active exception" (SIGABRT) after training, now and then (5 of 12 runs of a two-rank gloo
    all_reduce + barrier script that ends without destroying its group; it also failed once in CI
    with the group destroyed at exit, because the Trainer's DDP wrapper kept it, and its threads,
    alive). atexit runs before finalization: destroying the group joins those threads where nothing
    else holds it, and a short sleep lets them finish while Python still answers where something
    does. Registered once (cached), by the helpers a Trainer script calls."""
    atexit.register(_destroy_process_group)


def _validate(model_cls: type, data: Mapping[str, Any], what: str) -> Any:
    from pydantic import ValidationError

    try:
        return model_cls.model_validate(dict(data))
    except ValidationError as exc:
        raise UserError(error_messages(exc, what), title=f"invalid {what}") from None


def load_model_for_training(
    name_or_path: str | Path,
    *,
    device_map: str | None = "auto",
    dtype: Any = None,
    lora: LoraConfig | Mapping[str, Any] | Any = None,
    quantization: QuantizationConfig | Mapping[str, Any] | None = None,
    gradient_checkpointing: bool = False,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "sdpa",
    revision: str | None = None,
    tokenizer: str | Path | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer ready for a Hugging Face `Trainer`.

    Placement follows :func:`scaletune.models.resolve_device_map` for the environment this
    process was launched in: a single process honours `device_map`; under torchrun, accelerate
    or the deepspeed launcher the request is set aside (logged on rank 0) and the model goes on
    the rank's own device, which is what DDP / FSDP / ZeRO need. The default process group, if one
    is still up when the script ends, is destroyed at exit (no rank aborts in gloo's threads).

    Args:
        name_or_path: a local model folder or a hub id.
        device_map: `auto`, `sequential`, `balanced`, `balanced_low_0`, `cpu`, `cuda:N`, or None.
        dtype: `float32` / `bfloat16` / `float16` / `auto`, or a `torch.dtype`; None: the
            checkpoint's dtype.
        lora: LoRA adapters: the mapping of the YAML's `model.lora` (`{"r": 16, "alpha": 32,
            "dropout": 0.05, "target_modules": "auto"}`), a :class:`scaletune.config.LoraConfig`,
            or a `peft.LoraConfig`; None trains every weight.
        quantization: bitsandbytes k-bit base weights (QLoRA), the mapping of `model.quantization`
            (`{"bits": 4}`) or a :class:`scaletune.config.QuantizationConfig`; needs `lora` and a
            CUDA GPU.
        gradient_checkpointing: recompute activations in the backward pass (non-reentrant).
        trust_remote_code: run Python code shipped with the checkpoint; off unless you say so.
        attn_implementation: `sdpa`, `eager`, `flash_attention_2`, ... or None for the default.
        revision: the hub revision (branch, tag or commit).
        tokenizer: where the tokenizer is, when not beside the model.

    Returns:
        `(model, tokenizer)`: a `transformers` model, or a `peft.PeftModel` with `lora`; the
        tokenizer has a pad token and pads on the right.

    Raises:
        UserError: invalid arguments, a missing local path, custom code not allowed.
        RuntimeError: quantization without a CUDA GPU or without bitsandbytes; `cuda:N` that is
            not visible.
    """
    env = DistributedEnv.from_environ()
    # This function is the entry point of a user's own script: rank 0 logs, other ranks only warn.
    configure_logging(env.rank)
    _destroy_process_group_at_exit()

    if isinstance(quantization, Mapping):
        quantization = _validate(QuantizationConfig, quantization, "quantization")
    unlora = quantization_problem(quantization is not None, lora is not None, prefix="")
    if unlora is not None:
        raise UserError(unlora.text(), title="invalid arguments")
    if isinstance(lora, Mapping):
        lora = _validate(LoraConfig, lora, "lora")
    cfg = _validate(
        ModelConfig,
        {
            "name_or_path": str(name_or_path),
            "tokenizer": str(tokenizer) if tokenizer is not None else None,
            "revision": revision,
            "dtype": _dtype_name(dtype),
            "attn_implementation": attn_implementation,
            "trust_remote_code": trust_remote_code,
            "device_map": device_map,
            "gradient_checkpointing": gradient_checkpointing,
            "quantization": quantization.model_dump() if quantization is not None else None,
        },
        "model",
    )

    placement = resolve_device_map(cfg.device_map, env)
    model = load_model(cfg, placement)  # logs placement.message
    if lora is not None:
        model = apply_lora(model, lora)
    if gradient_checkpointing:
        enable_gradient_checkpointing(model)
    tok = load_tokenizer(cfg)
    trainable, total = parameter_counts(model)
    log.info(
        f"loaded {cfg.name_or_path} on {placement.device_map or placement.device} ({env.describe()}): "
        f"{trainable:,} trainable of {total:,} parameters"
    )
    return model, tok


def training_arguments(**kwargs: Any) -> Any:
    """`transformers.TrainingArguments` with defaults that work under every launcher.

    Each default below applies only where `kwargs` does not set that argument:

    * `activation_checkpointing_kwargs={"use_reentrant": False}` (`gradient_checkpointing_kwargs`
      before transformers 5.x renamed it; the deprecated names `gradient_checkpointing*` are
      translated to the new ones, so passing either works and no FutureWarning is raised).
      Reentrant checkpointing runs each layer's backward as a nested backward pass; under DDP
      the reducer then sees a LoRA weight marked ready from inside another backward and stops with
      "Expected to mark a variable ready only once" as soon as it looks for unused parameters.
      Non-reentrant checkpointing has no nested pass and needs no input-grad hook.
    * `ddp_find_unused_parameters=False`: HF Trainer turns the search on for any model that is
      not a `PreTrainedModel`, such as a `peft.PeftModel`, which together with reentrant
      checkpointing is the failure above; every parameter of a dense decoder is used in each
      forward, so the search only costs an extra graph traversal per step. Set it to True for
      models that really skip parameters (some mixture-of-experts routers).
    * `use_cpu=True` where torch sees no CUDA GPU, so accelerate does not look for one (and uses
      gloo under torchrun).
    * `report_to="none"`: no experiment tracker is started unless you ask (older transformers
      defaulted to every installed integration).
    * `save_safetensors=True` only where the argument exists: transformers 5 removed it, having
      made safetensors the only format.

    Not an argument: the process group accelerate starts for the Trainer is destroyed at exit
    (:func:`load_model_for_training` arranges the same), so no rank aborts after training.

    Raises:
        TypeError: an argument TrainingArguments does not have (raised by transformers).
    """
    import torch
    from transformers import TrainingArguments

    fields = {f.name for f in dataclasses.fields(TrainingArguments)}
    kwargs = dict(kwargs)
    renamed = "activation_checkpointing_kwargs" in fields
    if renamed:
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if old in kwargs and new not in kwargs:
                kwargs[new] = kwargs.pop(old)
    checkpoint_kwargs = "activation_checkpointing_kwargs" if renamed else "gradient_checkpointing_kwargs"
    defaults: dict[str, Any] = {
        checkpoint_kwargs: {"use_reentrant": False},
        "ddp_find_unused_parameters": False,
        "report_to": "none",
    }
    if not torch.cuda.is_available():
        defaults["use_cpu"] = True
    if "save_safetensors" in fields:
        defaults["save_safetensors"] = True
    _destroy_process_group_at_exit()
    return TrainingArguments(**{**defaults, **kwargs})
