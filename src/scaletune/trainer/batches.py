"""What the loop feeds the model from a micro-batch and how it counts it: text rows for
`loss.CausalLMLoss` (a Hugging Face causal LM), or any batch for a factory's model
(`models.custom.CustomModelLoss`), whatever the data's source (`model_source.ModelSource.kind`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from scaletune.data import count_batch_tokens, count_input_tokens, count_target_tokens, count_units, custom_inputs
from scaletune.models.loss import target_index
from scaletune.models.vision import IMAGE_INPUTS, TOKEN_INPUTS
from scaletune.objectives.module import kl_inputs, preference_inputs


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors `loss.CausalLMLoss.forward` takes (a vision-language model's image tensors too),
    with the target positions added on the host."""
    out = {
        k: batch[k]
        for k in (
            "input_ids",
            "labels",
            "attention_mask",
            "position_ids",
            "full_position_ids",
            *IMAGE_INPUTS,
            *TOKEN_INPUTS,
        )
        if k in batch
    }
    out["target_index"] = target_index(batch["labels"])
    return out


@dataclass(frozen=True)
class BatchKind:
    """How the loop reads a micro-batch.

    Attributes:
        inputs: the keyword arguments of the loss module's forward.
        targets: the target units the loss sums over (tokens after the causal shift for text);
            the step divides by their all-rank sum.
        tokens: the non-padding input tokens (metrics.jsonl `tokens`).
        checks_units: the loss module reports its own count (`CustomModelLoss.check_units`).
    """

    inputs: Callable[[dict], dict[str, Any]]
    targets: Callable[[dict], int]
    tokens: Callable[[dict], int]
    checks_units: bool = False
    #: The loss module leaves detached stats sums after each forward (`PreferenceLoss.last_stats`).
    collects_stats: bool = False
    #: Runs before a step's (or an evaluation's) forwards, over its ``(micro_batch, counted)`` pairs,
    #: before the step counts their units: KTO's KL pass, whose global mean every micro-batch's loss
    #: needs; an online objective's rollout, which turns each micro-batch's prompts into completion rows.
    before_step: Callable[[Any, list], Any] | None = None


TEXT = BatchKind(model_inputs, lambda b: count_target_tokens(b["labels"]), count_input_tokens)
CUSTOM = BatchKind(custom_inputs, count_units, count_batch_tokens, checks_units=True)


def kto_kl_pass(strategy: Any, batches: list) -> float:
    """KTO's reference point for one step: the mean over the global batch of (policy - reference)
    log-probs of the KL rows, clamped at 0 and detached (Ethayarajh et al. 2024, eq. 8; TRL takes it
    per micro-batch, which makes it depend on the batching). Every rank runs the same forwards.

    Each micro-batch of `batches` gets it as ``kl`` (the value of a float32, as a float: a float
    tensor would be cast to the compute dtype by FSDP2's mixed-precision input cast), which
    `objectives.module.preference_inputs` hands the loss. Returns it."""
    import torch

    total = torch.zeros(2, dtype=torch.float64, device=strategy.device)
    with torch.no_grad():
        for mb, counted in batches:
            with strategy.forward_context():
                out = strategy.model(**strategy.move_batch(kl_inputs(mb)), output="kl")
            if counted:
                total += out.detach().to(total.device, torch.float64)
    total = strategy.all_reduce_sum(total)
    # A host read at every step, logged or not: the step's losses need the value, as a float (the
    # docstring says why not a tensor), before their forwards start.
    kl = float((total[0] / total[1].clamp(min=1)).clamp(min=0).float())
    for mb, _ in batches:
        mb["kl"] = kl
    return kl


def preference_kind(objective: Any, kl_pass: Callable[[Any, list], Any]) -> BatchKind:
    """How the loop reads a micro-batch of `objective` (an `objectives.Objective`): its units, the
    non-padding tokens of the rows trained on, its stats, and `kl_pass` before each step where the
    objective has one (KTO's, `kto_kl_pass` through `trainer.objectives.StageObjectives.kl_pass`)."""
    return BatchKind(
        preference_inputs,
        objective.units,
        lambda b: int(b["attention_mask"].sum()),
        collects_stats=True,
        before_step=kl_pass if objective.kl_pass else None,
    )


def online_kind(objective: Any, rollout: Callable[[Any, list], Any]) -> BatchKind:
    """How the loop reads a micro-batch of an online objective (`objectives.rl.GRPO`): the prompts
    the loader gives become completion rows in `rollout` (`rollout.Rollout.before_step`), before the
    step counts its units; the tokens are the rows' real tokens (prompt and completion)."""
    return BatchKind(
        preference_inputs,
        objective.units,
        lambda b: int(b["attention_mask"].sum()),
        collects_stats=True,
        before_step=rollout,
    )


def distill_kind(objective: Any, rollout: Callable[[Any, list], Any] | None = None) -> BatchKind:
    """How the loop reads a micro-batch of distillation (`objectives.distill.Distill`): SFT's rows
    and counts (target tokens; the target positions found on the host), and the objective's stats.
    On-policy, the prompts the loader gives become the student's completion rows in `rollout`
    (`rollout.Rollout.before_step`) first."""
    return BatchKind(model_inputs, objective.units, count_input_tokens, collects_stats=True, before_step=rollout)
