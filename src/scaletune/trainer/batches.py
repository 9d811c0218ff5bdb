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


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors `loss.CausalLMLoss.forward` takes, with the target positions added on the host."""
    out = {k: batch[k] for k in ("input_ids", "labels", "attention_mask", "position_ids") if k in batch}
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


TEXT = BatchKind(model_inputs, lambda b: count_target_tokens(b["labels"]), count_input_tokens)
CUSTOM = BatchKind(custom_inputs, count_units, count_batch_tokens, checks_units=True)
