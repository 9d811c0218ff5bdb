"""The model a run trains, beyond loading (`model_source.py`): its meta-device twin for the planner
and the preflight, and what trains in each stage (`stages[].trainable` / `frozen`), applied before
the engine wraps it and re-targeted at stage boundaries."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from torch import nn

from scaletune.trainer.freezing import apply_trainable, checkpointed_frozen, peak_stage, trainable_sets

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec
    from scaletune.strategies.protocol import LoopStrategy

log = logging.getLogger(__name__)


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


class StageFreezing:
    """What trains in each stage, as full names of the loss module's parameters.

    The one owner of the strategy's `checkpointed_frozen` (`Strategy.keep_frozen`).

    Args:
        spec: the run (its stages' `trainable` / `frozen`).
        model: the loaded model, before its loss module, with `requires_grad` as loaded.
        prefix: the model's name prefix inside its loss module (`ModelSource.prefix`).

    Raises:
        UserError: a pattern that matches no parameter, a stage with nothing to train.
    """

    def __init__(self, spec: RunSpec, model: nn.Module, prefix: str) -> None:
        self.sets = trainable_sets(model, spec.stages, prefix=prefix, numbered=bool(spec.config.stages))
        default = {prefix + n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        #: What some stage trains that trains by default in none (under LoRA: base weights beside the
        #: adapters, such as a vision-language model's projector): final/'s adapter carries them.
        self.trained_base: frozenset[str] = frozenset().union(*self.sets) - default
        self.current: frozenset[str] | None = None
        #: The stage the memory plan is for (the one training the most); None: any.
        self.peak = peak_stage(self.sets, model, prefix=prefix)

    def before_wrap(self, module: nn.Module, strategy: LoopStrategy, stage_index: int) -> None:
        """Set what trains in the stage the run starts in (for a resume: the stage that wrote the
        checkpoint, whose optimizer state it holds) before the engine builds its optimizer."""
        if not self.sets:
            return
        self.current = self.sets[stage_index]
        trainable, total = apply_trainable(module, self.current)
        strategy.keep_frozen(checkpointed_frozen(self.sets, stage_index))
        log.info(f"stage {stage_index}: {trainable:,} of {total:,} parameters train")

    def enter(self, strategy: LoopStrategy, stage_index: int) -> bool:
        """At a stage's start: re-target the engine when this stage trains another set. Returns
        True when it did (the optimizer is new; the loop's schedule moves to it)."""
        if not self.sets:
            return False
        strategy.keep_frozen(checkpointed_frozen(self.sets, stage_index))
        if self.sets[stage_index] == self.current:
            return False
        self.current = self.sets[stage_index]
        strategy.retarget(self.current)
        n = len([p for n, p in strategy.module.named_parameters() if p.requires_grad])
        log.info(f"stage {stage_index}: optimizer rebuilt over {n} trainable tensors")
        return True
