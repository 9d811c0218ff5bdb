"""One optimizer step and one evaluation, the same for every engine (the strategy does the
engine's part): what `trainer.Trainer` runs at each step.

One optimizer step consumes one global batch of `global_batch_size` sequences; its loss is the
mean token loss over every target token of that global batch on all ranks, so a step is the same
computation on 1 or 64 ranks and with any micro-batch split (Hugging Face's `num_items_in_batch`
normalisation, transformers#34191, done across ranks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from scaletune.strategies.protocol import LoopStrategy
from scaletune.trainer.batches import TEXT, BatchKind, model_inputs

__all__ = ["DivergenceError", "StepResult", "evaluate", "model_inputs", "seed_everything", "train_step"]


class DivergenceError(RuntimeError):
    """A non-finite loss or gradient norm: the run stops before any checkpoint of that state."""


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights (LoRA init included) everywhere."""
    import numpy as np

    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


@dataclass
class StepResult:
    loss: torch.Tensor  # global mean token loss (0-dim, on device)
    grad_norm: torch.Tensor
    tokens: torch.Tensor  # non-padding tokens, global count (float64, on device: read it at log time)
    skipped: bool = False  # fp16: the loss scaler skipped the update (gradients overflowed)


def train_step(
    strategy: LoopStrategy,
    micro_batches: list[dict[str, torch.Tensor]],
    kind: BatchKind = TEXT,
    check_units: bool = False,
) -> StepResult:
    """Forward/backward every micro-batch of this rank's share of the global batch, then step.

    The loss of each micro-batch is its summed token loss divided by the target tokens of the
    whole global batch (all-reduced first), so accumulation and world size do not change the step.
    `kind` says how batches are read and counted (`batches.TEXT`, `batches.CUSTOM`); `check_units`
    compares a factory module's own count of its first micro-batch with the loop's.
    """
    device = strategy.device
    counts = torch.tensor(
        [sum(kind.targets(mb) for mb in micro_batches), sum(kind.tokens(mb) for mb in micro_batches)],
        dtype=torch.float64,
    )
    if device.type == "cuda":
        # Pinned and non-blocking: a copy from pageable memory waits for the GPU to finish everything
        # queued before it (the previous step's optimizer), at the start of every step. The counts
        # then stay on the device (StepResult.tokens); the loop reads them when it logs.
        counts = counts.pin_memory().to(device, non_blocking=True)
    counts = strategy.all_reduce_sum(counts)
    denominator = counts[0].clamp(min=1).to(device, torch.float32)
    loss_total = torch.zeros((), dtype=torch.float32, device=device)
    n = len(micro_batches)
    for i, mb in enumerate(micro_batches):
        inputs = strategy.move_batch(kind.inputs(mb))
        with strategy.micro_step(is_last=i == n - 1):
            with strategy.forward_context():
                loss = strategy.model(**inputs) / denominator
            if check_units and i == 0 and kind.checks_units:
                strategy.module.check_units(kind.targets(mb))
            strategy.backward(loss)
        loss_total += loss.detach()
    grad_norm = strategy.step()
    return StepResult(strategy.all_reduce_sum(loss_total), grad_norm, counts[1], strategy.skipped_step)


@torch.no_grad()
def evaluate(strategy: LoopStrategy, loader: Any, kind: BatchKind = TEXT) -> float:
    """Mean token loss (loss per target unit) over the whole eval set: the summed loss and target
    count of every rank's micro-batches, all-reduced, then divided once (as one process would).

    `loader` yields ``(micro_batch, counted)`` (`data.EvalBatches`): every rank runs the same number
    of forwards, filler batches included (FSDP and ZeRO-3 gather parameters in each), and a filler's
    loss and targets are not counted.
    """
    strategy.train_mode(False)
    device = strategy.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    targets = 0
    for mb, counted in loader:
        inputs = strategy.move_batch(kind.inputs(mb))
        with strategy.forward_context():
            loss = strategy.model(**inputs)
        if counted:
            loss_sum += loss.detach().to(device, torch.float64)
            targets += kind.targets(mb)
    strategy.train_mode(True)
    total = torch.stack([loss_sum, torch.tensor(float(targets), dtype=torch.float64, device=device)])
    total = strategy.all_reduce_sum(total).cpu()
    return float(total[0] / total[1].clamp(min=1))
