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
    loss: torch.Tensor  # global mean loss (0-dim, on device)
    grad_norm: torch.Tensor
    tokens: torch.Tensor  # non-padding tokens, global count (float64, on device: read it at log time)
    # fp16: the loss scaler skipped the update (gradients overflowed); a 0-dim bool tensor on the
    # device where `torch.amp.GradScaler` decided it (read at log time), a bool from DeepSpeed.
    skipped: bool | torch.Tensor = False
    stats: torch.Tensor | None = None  # a preference objective's global stats sums (float64, on device)


def _units(kind: BatchKind, mb: dict) -> tuple[int, ...]:
    units = kind.targets(mb)
    return tuple(units) if isinstance(units, (tuple, list)) else (units,)


def train_step(
    strategy: LoopStrategy,
    micro_batches: list[dict[str, torch.Tensor]],
    kind: BatchKind = TEXT,
    check_units: bool = False,
) -> StepResult:
    """Forward/backward every micro-batch of this rank's share of the global batch, then step.

    The loss of each micro-batch is its summed token loss divided by the target tokens of the
    whole global batch (all-reduced first), so accumulation and world size do not change the step.
    A preference objective's loss has one component per unit it averages over (pairs; ORPO also
    chosen tokens), each divided by that unit's global count. `kind` says how batches are read and
    counted (`batches.TEXT`, `batches.CUSTOM`, `batches.preference_kind`); `check_units` compares a
    factory module's own count of its first micro-batch with the loop's.
    """
    device = strategy.device
    micro_batches = [strategy.split_batch(mb) for mb in micro_batches]  # a context slice each
    if kind.before_step is not None:  # first: an online objective's rollout makes the rows counted next
        kind.before_step(strategy, [(mb, True) for mb in micro_batches])
    per_batch = [_units(kind, mb) for mb in micro_batches]
    k = len(per_batch[0])
    counts = torch.tensor(
        [sum(u[j] for u in per_batch) for j in range(k)] + [sum(kind.tokens(mb) for mb in micro_batches)],
        dtype=torch.float64,
    )
    if device.type == "cuda":
        # Pinned and non-blocking: a copy from pageable memory waits for the GPU to finish everything
        # queued before it (the previous step's optimizer), at the start of every step. The counts
        # then stay on the device (StepResult.tokens); the loop reads them when it logs.
        counts = counts.pin_memory().to(device, non_blocking=True)
    counts = strategy.all_reduce_data(counts)
    denominator = counts[:k].clamp(min=1).to(device, torch.float32)
    stats = None

    def each(i: int) -> None:  # after micro-batch i's backward
        nonlocal stats
        if check_units and i == 0 and kind.checks_units:
            strategy.module.check_units(kind.targets(micro_batches[0]))
        if kind.collects_stats:
            mb_stats = strategy.module.last_stats.to(device)
            stats = mb_stats if stats is None else stats + mb_stats

    loss_total = strategy.forward_backward([kind.inputs(mb) for mb in micro_batches], denominator, each)
    grad_norm = strategy.step()
    if stats is None:
        return StepResult(strategy.all_reduce_data(loss_total), grad_norm, counts[k], strategy.skipped_step)
    both = strategy.all_reduce_data(torch.cat([loss_total.double().reshape(1), stats]))
    return StepResult(both[0].float(), grad_norm, counts[k], strategy.skipped_step, both[1:])


@torch.no_grad()
def evaluate(strategy: LoopStrategy, loader: Any, kind: BatchKind = TEXT) -> tuple[float, torch.Tensor | None]:
    """Mean loss over the whole eval set: each loss component's sum over every rank's micro-batches,
    all-reduced, divided once by its unit's total (as one process would): the mean token loss for
    SFT, the objective's loss for preference data. Returns (loss, the objective's global stats sums
    or None).

    `loader` yields ``(micro_batch, counted)`` (`data.EvalBatches`): every rank runs the same number
    of forwards, filler batches included (FSDP and ZeRO-3 gather parameters in each), and a filler's
    loss and targets are not counted.
    """
    strategy.train_mode(False)
    if strategy.eval_group > 1:
        return _evaluate_grouped(strategy, loader, kind)
    device = strategy.device
    batches = loader
    if kind.before_step is not None:
        batches = list(loader)  # KTO: the KL pass over the whole set first
        kind.before_step(strategy, batches)
    sums: torch.Tensor | None = None
    units: list[float] = []
    stats = None
    k = 1
    for mb, counted in batches:
        mb = strategy.split_batch(mb)
        inputs = strategy.move_batch(kind.inputs(mb))
        with strategy.forward_context():
            loss = strategy.model(**inputs)
        k = len(_units(kind, mb))
        if not counted:
            continue
        loss = loss.detach().to(device, torch.float64).reshape(-1)
        sums = loss if sums is None else sums + loss
        mb_units = _units(kind, mb)
        units = [a + b for a, b in zip(units, mb_units)] if units else list(mb_units)
        if kind.collects_stats:
            mb_stats = strategy.module.last_stats.to(device)
            stats = mb_stats if stats is None else stats + mb_stats
    strategy.train_mode(True)
    if sums is None:  # this rank evaluated fillers only: zeros of the right length for the all-reduce
        sums, units = torch.zeros(k, dtype=torch.float64, device=device), [0.0] * k
        if kind.collects_stats:
            stats = torch.zeros_like(strategy.module.last_stats, device=device)
    k = sums.numel()
    parts = [sums, torch.tensor(units, dtype=torch.float64, device=device)] + ([stats] if stats is not None else [])
    total = strategy.all_reduce_data(torch.cat(parts)).cpu()
    loss = float((total[:k] / total[k : 2 * k].clamp(min=1)).sum())
    return loss, (total[2 * k :] if stats is not None else None)


def _evaluate_grouped(strategy: LoopStrategy, loader: Any, kind: BatchKind) -> tuple[float, torch.Tensor | None]:
    """`evaluate` for a pipeline: forwards of `strategy.eval_group` micro-batches at once (text rows
    only). A filler's labels are all ignored (it scores nothing), and a short last group is filled
    with such fillers; every rank of a pipeline reads the same micro-batches."""
    device, size = strategy.device, strategy.eval_group
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    units = 0.0
    group: list[dict] = []
    pending = list(loader)
    for j, (mb, counted) in enumerate(pending):
        inputs = kind.inputs(mb)
        if counted:
            units += sum(_units(kind, mb))
        else:
            inputs = {**inputs, "labels": torch.full_like(inputs["labels"], -100)}
        group.append(inputs)
        if len(group) == size or j == len(pending) - 1:
            while group and len(group) < size:
                group.append({**group[0], "labels": torch.full_like(group[0]["labels"], -100)})
            loss_sum += strategy.forward_only(group).to(device, torch.float64)
            group = []
    strategy.train_mode(True)
    total = strategy.all_reduce_data(torch.stack([loss_sum, torch.tensor(units, dtype=torch.float64, device=device)]))
    total = total.cpu()
    return float(total[0] / total[1].clamp(min=1)), None
