"""Batching: the collator that pads rows into tensors, token counts of a batch, and the samplers
and loaders that deal rows to ranks and micro-batches (resumable mid-epoch)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DistributedSampler

from scaletune.data.sources import IGNORE_INDEX

if TYPE_CHECKING:
    from scaletune.config import BatchArithmetic
    from scaletune.env import DistributedEnv


class Collator:
    """Pads rows into a micro-batch (right padding, to the longest row).

    Returns ``input_ids``, ``labels`` (-100 on padding), ``position_ids`` and, for a batch of unpacked
    rows, ``attention_mask`` (1 real, 0 padding): all ``[B, T]`` int64.

    A batch with a packed row (position_ids restart inside it) has NO ``attention_mask``. transformers
    turns a 2D mask into a plain causal+padding mask, which would let the examples of a pack see
    each other; without one, ``masking_utils.find_packed_sequence_indices`` splits each row where
    position_ids do not increase by 1 and masks attention block-diagonally (sdpa, eager, flex; see
    :func:`check_packing_support`). transformers does this only when there is no KV cache, so the
    model must be called with ``use_cache=False`` (or ``config.use_cache = False``): with the
    default ``use_cache=True`` it makes a ``DynamicCache`` even in training and packs leak silently.

    Padding gets position 0 at every pad token, so each pad token is its own one-token sequence
    (no fully masked softmax row), and the real length of a row stays readable from position_ids
    (see :func:`count_input_tokens`). Right padding never changes real tokens under causal attention.
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        if pad_token_id is None:
            raise ValueError("Collator needs a pad_token_id (the tokenizer's pad or eos token id)")
        self.pad_token_id = int(pad_token_id)
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            longest = (longest + m - 1) // m * m
        shape = (len(rows), longest)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(shape, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        packed = False
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            input_ids[i, :n] = torch.as_tensor(r["input_ids"])
            labels[i, :n] = torch.as_tensor(r["labels"])
            pos = torch.as_tensor(r["position_ids"]) if "position_ids" in r else torch.arange(n)
            position_ids[i, :n] = pos
            attention_mask[i, :n] = 1
            packed = packed or bool((pos[1:] == 0).any())
        out = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
        if not packed:
            out["attention_mask"] = attention_mask
        return out


def count_target_tokens(labels: torch.Tensor) -> int:
    """Tokens the loss is computed on: ``(labels[:, 1:] != -100).sum()`` for ``[B, T]`` unshifted
    labels (the causal shift drops the first column)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def count_input_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Non-padding tokens of a :class:`Collator` batch (the ``tokens`` of metrics.jsonl).

    Uses ``attention_mask`` when present; for packed batches, the padding is the trailing run of
    position 0 (every example built here has at least 2 tokens, so its last position is >= 1).
    """
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    pos = batch["position_ids"]
    idx = torch.arange(1, pos.shape[1] + 1, device=pos.device)
    return int((idx * (pos != 0)).amax(dim=1).sum())


class ResumableSampler(DistributedSampler):
    """`DistributedSampler` that can skip the samples of this rank already consumed in the epoch
    a run resumes in (the permutation does not depend on world size, so neither does the skip).

    `skip` applies to the next iteration only.
    """

    skip = 0

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


def make_loader(dataset: Any, collator: Any, batch: BatchArithmetic, env: DistributedEnv, seed: int, num_workers: int):
    """A DataLoader of micro-batches for this rank.

    `DistributedSampler` draws one permutation of all rows (seeded by seed + epoch, the same at
    every world size) and gives data-parallel rank r rows r, r+W, r+2W, ... (W data-parallel ranks); so the first global batch is
    permutation[0:global_batch_size] whatever W is, split across ranks and micro-batches.
    """
    from torch.utils.data import DataLoader

    sampler = ResumableSampler(
        dataset, num_replicas=batch.world_size, rank=data_rank(batch, env), shuffle=True, seed=seed, drop_last=True
    )
    loader = DataLoader(
        dataset,
        batch_size=batch.micro_batch_size,
        sampler=sampler,
        collate_fn=collator,
        drop_last=True,
        num_workers=num_workers,
        pin_memory=env.cuda_available,
        persistent_workers=num_workers > 0,
        # Its own generator: without one, each iter() draws the workers' base seed from the global
        # RNG, so a resumed run (global RNG restored, then a new iterator) and the uninterrupted one
        # (iterator made at the start) would run dropout with masks one draw apart.
        generator=torch.Generator().manual_seed(seed),
    )
    return loader, sampler


def global_batches(
    loader: Any, sampler: Any, batch: BatchArithmetic, steps_per_epoch: int, first_epoch: int = 0, first_step: int = 0
) -> Iterator[tuple[int, int, list]]:
    """Yield (epoch, step_in_epoch, micro_batches) forever, one global batch per step, starting at
    step `first_step` of epoch `first_epoch` (a resumed run)."""
    gas = batch.gradient_accumulation_steps
    epoch, start = first_epoch, first_step
    while True:
        sampler.set_epoch(epoch)
        sampler.skip = start * gas * batch.micro_batch_size
        it = iter(loader)
        for i in range(start, steps_per_epoch):
            yield epoch, i, [next(it) for _ in range(gas)]
        epoch, start = epoch + 1, 0


class EvalBatches:
    """This rank's share of an eval set as micro-batches, the same number on every rank.

    Rank r evaluates rows r, r+W, r+2W, ... (no row dropped or repeated; the loop all-reduces the
    sums). The shares differ by at most one row, and so can differ by a micro-batch: FSDP and
    ZeRO-3 gather parameters in every forward, so a rank that stopped early would leave the others
    waiting in an all-gather until the collective timeout. A rank with fewer micro-batches than the
    largest share runs filler batches (row 0 of the set, collated alone) whose loss and targets the
    caller must not count.

    Iterating yields ``(micro_batch, counted)``; ``len`` is the number of micro-batches, equal on
    every rank: ``ceil(ceil(N / W) / micro_batch_size)``.
    """

    def __init__(self, dataset: Any, collator: Any, micro_batch_size: int, rank: int, world_size: int) -> None:
        from torch.utils.data import DataLoader, Subset

        self.dataset, self.collator = dataset, collator
        rows = list(range(rank, len(dataset), world_size))
        self.loader = DataLoader(Subset(dataset, rows), batch_size=micro_batch_size, collate_fn=collator)
        largest_share = -(-len(dataset) // world_size)
        self.batches = -(-largest_share // micro_batch_size)
        self.fillers = self.batches - len(self.loader)
        assert 0 <= self.fillers <= 1, (len(dataset), world_size, micro_batch_size, rank)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[tuple[Any, bool]]:
        for batch in self.loader:
            yield batch, True
        for _ in range(self.fillers):
            yield self.collator([self.dataset[0]]), False


def make_eval_loader(dataset: Any, collator: Any, batch: BatchArithmetic, env: DistributedEnv) -> EvalBatches:
    """This rank's eval micro-batches (:class:`EvalBatches`): every row once over all ranks, the
    same number of forwards on every rank."""
    return EvalBatches(dataset, collator, batch.micro_batch_size, data_rank(batch, env), batch.world_size)


def data_rank(batch: BatchArithmetic, env: DistributedEnv) -> int:
    """Which share of the data this rank reads: its data-parallel index (`batch.world_size` shares);
    the ranks of one tensor or context group read the same rows."""
    return batch.mesh.data_rank(env.rank) if batch.mesh is not None else env.rank
