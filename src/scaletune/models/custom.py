"""The loss module of a factory's model: what every engine wraps, as `loss.CausalLMLoss` is for a
Hugging Face causal LM.

Your module's `forward(**batch)` returns `(loss_sum, num_units)`: the SUM of the loss over the
micro-batch's target units (tokens, images, ...) and how many units that is (docs/custom-models.md).
The loop divides by the number of units of the whole global batch, all ranks together, counted on
the host before the step (`data.factory.count_units`), so that a step is the same computation on
1 or 64 ranks and with any micro-batch split; the count your forward returns is checked against it.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from scaletune.config import ModelConfig
from scaletune.errors import UserError
from scaletune.models.factory import write_export

#: The prefix of every parameter name of the loss module (`model.` + your module's names).
PREFIX = "model."


def check_output(out: Any, ref: str) -> tuple[torch.Tensor, Any]:
    """(loss_sum, num_units) from what a factory module's forward returned.

    Raises:
        UserError: not a pair, or a loss that is not a 0-dim floating-point tensor.
    """
    if not isinstance(out, tuple | list) or len(out) != 2:
        what = "None" if out is None else type(out).__name__
        raise UserError(
            f"model.factory {ref!r}: forward(**batch) returned {what}, not (loss_sum, num_units): it returned no loss "
            "the loop can use (docs/custom-models.md)",
            title="invalid model output",
        )
    loss, units = out
    if not (torch.is_tensor(loss) and loss.dim() == 0 and loss.is_floating_point()):
        shape = f"a tensor of shape {list(loss.shape)}" if torch.is_tensor(loss) else type(loss).__name__
        raise UserError(
            f"model.factory {ref!r}: forward(**batch) returned {shape} as its loss; it must be a 0-dim "
            "floating-point tensor, the SUM of the loss over the batch's target units",
            title="invalid model output",
        )
    if not (isinstance(units, int) or (torch.is_tensor(units) and units.numel() == 1)):
        raise UserError(
            f"model.factory {ref!r}: forward(**batch) returned {type(units).__name__} as num_units; it must be "
            "an int or a one-element tensor",
            title="invalid model output",
        )
    return loss, units


class CustomModelLoss(nn.Module):
    """Holds a factory's module as `.model` and returns its summed loss.

    Args:
        model: the module `model.factory` built.
        cfg: the model section (the factory reference, for messages and the export).
        shard_classes: the block classes (`models.factory.shard_classes`); named in
            `_no_split_modules`, where FSDP2's sharding and ZeRO-3's leaf modules look.
        activation_offload: run the forward under `torch.autograd.graph.save_on_cpu` (see
            `loss.CausalLMLoss`).

    Attributes:
        returned_units: the `num_units` of the last forward (the loop checks it).
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: ModelConfig,
        shard_classes: tuple[type, ...] = (),
        *,
        activation_offload: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.ref = cfg.factory or "?"
        self.model_config = cfg
        self._no_split_modules = [c.__name__ for c in shard_classes]
        self.activation_offload = activation_offload
        self.returned_units: Any = None

    def forward(self, **batch: Any) -> torch.Tensor:
        context = (
            torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            if self.activation_offload
            else contextlib.nullcontext()
        )
        with context:
            out = self.model(**batch)
        loss, self.returned_units = check_output(out, self.ref)
        return loss.float()

    def check_units(self, expected: int) -> None:
        """Compare the last forward's `num_units` with the loop's count of the same micro-batch.

        Raises:
            UserError: they differ (the loss would be normalised by the wrong count).
        """
        got = int(self.returned_units)
        if got != expected:
            raise UserError(
                f"model.factory {self.ref!r}: forward returned num_units {got} for a micro-batch in which the loop "
                f"counts {expected} target units (the batch's num_units, else its labels != -100); make them agree "
                "(docs/custom-models.md)",
                title="invalid model output",
            )

    def save_export(self, out_dir: Path, state: dict[str, torch.Tensor]) -> None:
        """Write `final/` from the full state dict of this module (keys `model.*`)."""
        write_export(out_dir, {k.removeprefix(PREFIX): v for k, v in state.items()}, self.model_config)
