"""The model a run trains, as the loop receives it: loaded (`from_pretrained`, or your
`model.factory`), wrapped in its loss module, and what trains in each stage (`stages[].trainable`
/ `frozen`), applied before the engine wraps it and re-targeted at stage boundaries."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from torch import nn

from scaletune.env import get_logger
from scaletune.trainer.freezing import apply_trainable, checkpointed_frozen, peak_stage, trainable_sets

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec
    from scaletune.strategies.base import Strategy

get_logger()
log = logging.getLogger("scaletune")


def meta_model(spec: RunSpec) -> nn.Module:
    """The run's Hugging Face model on the meta device in its storage dtype (resolved precision),
    with LoRA if asked: no weights read, no storage (the planner and the preflight count and name
    its parameters)."""
    import torch

    from scaletune.models import DevicePlacement, apply_lora, load_model

    m = spec.config.model
    model_cfg = m.model_copy(update={"dtype": spec.precision.storage, "quantization": None})
    model = load_model(model_cfg, DevicePlacement(None, "cpu"), meta=True)
    if m.lora is not None:
        with torch.device("meta"):
            model = apply_lora(model, m.lora)
    return model


def load_model(spec: RunSpec, strategy: Strategy) -> tuple[nn.Module, Any]:
    """The run's model in its storage dtype, where the strategy wants it (the meta device on ranks
    the engine fills), and the tokenizer or processor a factory returned (else None).

    Raises:
        UserError: what `models.prepare_model` or `models.factory.build_model` raise.
    """
    from scaletune.models import prepare_model

    m = spec.config.model
    placement = strategy.placement
    if not spec.custom_model:
        model_cfg = m.model_copy(update={"dtype": spec.precision.storage})
        return prepare_model(model_cfg, placement, meta=strategy.load_meta()), None
    from scaletune.models.factory import build_model, checkpoint_blocks, shard_classes

    meta = strategy.load_meta()
    model, processor = build_model(m, meta=meta, dtype=spec.precision.storage, device=placement.device)
    blocks = shard_classes(model, m.shard_modules)
    if m.gradient_checkpointing:
        n = checkpoint_blocks(model, blocks)
        log.info(f"gradient checkpointing: {n} blocks of the factory's module (non-reentrant)")
    if m.compile:
        for block in [b for b in model.modules() if isinstance(b, blocks)]:
            block.compile()
    total = sum(p.numel() for p in model.parameters())
    log.info(
        f"model.factory {m.factory}: {type(model).__name__}, {total:,} parameters{' (meta device)' if meta else ''}"
    )
    return model, processor


def loss_module(spec: RunSpec, model: nn.Module, strategy: Strategy) -> nn.Module:
    """What the engine wraps: `loss.CausalLMLoss` around a Hugging Face model, or
    `models.custom.CustomModelLoss` around a factory's module."""
    m = spec.config.model
    if spec.custom_model:
        from scaletune.models.custom import CustomModelLoss
        from scaletune.models.factory import shard_classes

        classes = shard_classes(model, m.shard_modules)
        return CustomModelLoss(model, m, classes, activation_offload=m.activation_offload)
    from scaletune.models.loss import CausalLMLoss

    return CausalLMLoss(
        model, activation_offload=m.activation_offload, liger=m.liger, partitioned_head=strategy.partitions_head
    )


class StageFreezing:
    """What trains in each stage, as full names of the loss module's parameters.

    Args:
        spec: the run (its stages' `trainable` / `frozen`).
        model: the loaded model, before its loss module, with `requires_grad` as loaded.

    Raises:
        UserError: a pattern that matches no parameter, a stage with nothing to train.
    """

    def __init__(self, spec: RunSpec, model: nn.Module) -> None:
        prefix = "model." if spec.custom_model else "causal_lm."
        self.sets = trainable_sets(model, spec.stages, prefix=prefix, numbered=bool(spec.config.stages))
        self.current: frozenset[str] | None = None
        #: The stage the memory plan is for (the one training the most); None: any.
        self.peak = peak_stage(self.sets, model, prefix=prefix)

    def before_wrap(self, module: nn.Module, strategy: Strategy, stage_index: int) -> None:
        """Set what trains in the stage the run starts in (for a resume: the stage that wrote the
        checkpoint, whose optimizer state it holds) before the engine builds its optimizer."""
        if not self.sets:
            return
        self.current = self.sets[stage_index]
        trainable, total = apply_trainable(module, self.current)
        strategy.checkpointed_frozen = checkpointed_frozen(self.sets, stage_index)
        log.info(f"stage {stage_index}: {trainable:,} of {total:,} parameters train")

    def enter(self, strategy: Strategy, stage_index: int) -> bool:
        """At a stage's start: re-target the engine when this stage trains another set. Returns
        True when it did (the optimizer is new; the loop builds the scheduler again)."""
        if not self.sets:
            return False
        strategy.checkpointed_frozen = checkpointed_frozen(self.sets, stage_index)
        if self.sets[stage_index] == self.current:
            return False
        self.current = self.sets[stage_index]
        strategy.retarget(self.current)
        n = len([p for n, p in strategy.module.named_parameters() if p.requires_grad])
        log.info(f"stage {stage_index}: optimizer rebuilt over {n} trainable tensors")
        return True
