"""Your own data (`data.factory`): the factory called and its result checked, the eval split, and
how the loop counts and feeds the batches of your collator.

The factory is called as `build(tokenizer=TOKENIZER, **data.factory_kwargs)` (TOKENIZER: the
model's tokenizer or processor, or None) and returns `(train, collator)`, `(train, eval,
collator)` or a mapping with `train`, `collator` and optionally `eval`: map-style data sets
(`__len__`, `__getitem__`) and a callable turning a list of items into a dict of tensors. The same
sampler, accumulation, resume position and rank-0-first building as text data apply.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import torch

from scaletune.config import DataConfig
from scaletune.config.user_code import call_checked, import_callable
from scaletune.data.build import DataBundle
from scaletune.data.sources import IGNORE_INDEX, split_records
from scaletune.errors import Problem, UserError

#: The optional batch key that says how many target units a micro-batch has (not passed to forward).
NUM_UNITS = "num_units"


def _is_map_style(ds: Any) -> bool:
    return hasattr(ds, "__len__") and hasattr(ds, "__getitem__")


def _unpack(out: Any, ref: str) -> tuple[Any, Any, Any]:
    if isinstance(out, Mapping):
        if "train" not in out or "collator" not in out:
            raise UserError(
                f"data.factory {ref!r} returned a mapping with keys {sorted(out)}; it needs train and collator (eval optional)",
                title="invalid data factory",
            )
        return out["train"], out.get("eval"), out["collator"]
    if isinstance(out, tuple | list) and len(out) in (2, 3):
        return (out[0], None, out[1]) if len(out) == 2 else tuple(out)
    raise UserError(
        f"data.factory {ref!r} returned {type(out).__name__}; it must return (train, collator), "
        "(train, eval, collator) or a mapping {train, eval, collator}",
        title="invalid data factory",
    )


def _seeded_call(fn: Any, kwargs: dict, ref: str, seed: int) -> Any:
    """Call the factory with Python, NumPy and torch seeded by `seed`, restoring their state after:
    every rank builds the same data whatever its RNG went through (a meta-device model build
    draws nothing; a real one does)."""
    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
            return call_checked(fn, kwargs, "data.factory", ref)
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def build_custom_data(data_cfg: DataConfig, tokenizer: Any, *, seed: int) -> DataBundle:
    """The stage's data from `data.factory`, with `data.eval_fraction` held out when given.

    Raises:
        UserError: the reference does not import or its arguments do not fit; a result that is not
            map-style data sets and a callable collator; an empty training set; eval_fraction with
            an eval set of the factory's own.
    """
    ref = data_cfg.factory
    assert ref is not None
    fn = import_callable(ref, "data.factory")
    train, eval_set, collator = _unpack(
        _seeded_call(fn, {"tokenizer": tokenizer, **data_cfg.factory_kwargs}, ref, seed), ref
    )
    problems = []
    for name, ds in (("train", train), ("eval", eval_set)):
        if ds is not None and not _is_map_style(ds):
            problems.append(
                f"data.factory {ref!r}: its {name} set is a {type(ds).__name__}, not a map-style data set "
                "(__len__ and __getitem__)"
            )
    if not callable(collator):
        problems.append(f"data.factory {ref!r}: its collator is a {type(collator).__name__}, not a callable")
    if not problems and len(train) == 0:
        problems.append(f"data.factory {ref!r}: the training set is empty")
    if data_cfg.eval_fraction is not None and eval_set is not None:
        problems.append(f"data.factory {ref!r} returns an eval set and data.eval_fraction is given: use one")
    if problems:
        raise UserError(problems, title="invalid data factory")
    if data_cfg.eval_fraction is not None:
        train_idx, eval_idx = split_records(list(range(len(train))), data_cfg.eval_fraction, seed)
        train, eval_set = torch.utils.data.Subset(train, train_idx), torch.utils.data.Subset(train, eval_idx)
    stats = {"train_samples": len(train)}
    if eval_set is not None:
        stats["eval_samples"] = len(eval_set)
    return DataBundle(train, eval_set, stats, collator=collator)


#: The keys a batch for a Hugging Face causal LM may hold (`trainer.batches.model_inputs`).
TEXT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def batch_problems(batch: Any, ref: str, *, vocab_size: int | None, text: bool) -> list[Problem]:
    """What in one collated batch of `data.factory` would fail (or train wrongly) at the first step,
    found before anything is written.

    Args:
        batch: what the factory's collator returned for a list of items.
        ref: the factory reference, for messages.
        vocab_size: the embedding's rows: `input_ids` must lie in [0, vocab_size) and `labels`
            there or at -100 (None: not checked).
        text: the batch feeds a Hugging Face causal LM (`input_ids`, `labels` of the same [batch,
            seq] shape, integer; `attention_mask` or else `position_ids` of that shape); else a
            factory's model, whose forward takes any keys: only `input_ids` and `num_units` are
            checked there, and the target count (`labels` or `num_units`).

    Returns:
        the problems, each naming the key; empty for a batch the loop can run.
    """
    where = f"data.factory {ref!r}: a batch of its collator"
    if not isinstance(batch, Mapping) or not all(isinstance(k, str) for k in batch):
        return [_batch(f"{where} is a {type(batch).__name__}, not a mapping of names to tensors")]
    problems: list[Problem] = []
    ids = batch.get("input_ids")
    if text:
        missing = [k for k in ("input_ids", "labels") if k not in batch]
        if "attention_mask" not in batch and "position_ids" not in batch:
            missing.append("attention_mask or position_ids")
        if missing:
            return [_batch(f"{where} lacks {', '.join(missing)} (keys: {sorted(batch)}); a causal LM needs them")]
        for key in TEXT_KEYS:
            if key in batch:
                problems += _tensor_problems(batch[key], key, where, 2, ids if key != "input_ids" else None)
    elif ids is not None:
        problems += _tensor_problems(ids, "input_ids", where, None, None)
    if problems:
        return problems
    if ids is not None and vocab_size is not None and ids.numel():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            problems.append(
                _batch(f"{where}: input_ids range over [{low}, {high}], outside the model's {vocab_size} embeddings")
            )
    labels = batch.get("labels")
    if text and vocab_size is not None and labels.numel():
        bad = labels[(labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))]
        if bad.numel():
            problems.append(
                _batch(
                    f"{where}: labels hold {int(bad[0])}, neither a token id below {vocab_size} nor {IGNORE_INDEX} (no target)"
                )
            )
    if text and "position_ids" in batch and batch["position_ids"].numel() and int(batch["position_ids"].min()) < 0:
        problems.append(_batch(f"{where}: position_ids are negative"))
    if not text:
        if NUM_UNITS in batch and not (isinstance(batch[NUM_UNITS], int) or _integer_scalar(batch[NUM_UNITS])):
            problems.append(_batch(f"{where}: {NUM_UNITS} is a {type(batch[NUM_UNITS]).__name__}, not an integer"))
        elif NUM_UNITS not in batch and not torch.is_tensor(labels):
            problems.append(_batch(f"{where} has neither {NUM_UNITS!r} nor a 'labels' tensor (keys: {sorted(batch)})"))
    return problems


def _batch(message: str) -> Problem:
    """A problem with a batch of `data.factory` (the message names the factory and the key)."""
    return Problem("data factory batch", None, message)


def _integer_scalar(value: Any) -> bool:
    return torch.is_tensor(value) and value.numel() == 1 and not value.is_floating_point() and value.dtype != torch.bool


def _tensor_problems(value: Any, key: str, where: str, ndim: int | None, like: Any) -> list[Problem]:
    if not torch.is_tensor(value):
        return [_batch(f"{where}: {key} is a {type(value).__name__}, not a tensor")]
    if value.is_floating_point() or value.is_complex() or (value.dtype == torch.bool and key != "attention_mask"):
        return [_batch(f"{where}: {key} is {str(value.dtype).removeprefix('torch.')}, not an integer tensor")]
    if ndim is not None and value.dim() != ndim:
        return [_batch(f"{where}: {key} has {value.dim()} dimensions {list(value.shape)}, not [batch, sequence]")]
    if like is not None and torch.is_tensor(like) and value.shape != like.shape:
        return [
            _batch(f"{where}: {key} has shape {list(value.shape)}, input_ids {list(like.shape)}: they must be the same")
        ]
    return []


def count_units(batch: dict[str, Any]) -> int:
    """Target units of a custom micro-batch: `batch["num_units"]`, else the entries of `labels`
    that are not -100 (no causal shift: mark every position without a target -100).

    Raises:
        UserError: the batch has neither.
    """
    if NUM_UNITS in batch:
        return int(batch[NUM_UNITS])
    labels = batch.get("labels")
    if torch.is_tensor(labels):
        return int((labels != IGNORE_INDEX).sum())
    raise UserError(
        f"a batch of the data factory's collator has neither {NUM_UNITS!r} nor a 'labels' tensor (keys: "
        f"{sorted(batch)}), so the loop cannot count its target units (docs/custom-models.md)",
        title="invalid batch",
    )


def count_batch_tokens(batch: dict[str, Any]) -> int:
    """The `tokens` of metrics.jsonl for a custom batch: `attention_mask.sum()`, else the elements of
    `input_ids`, else its target units."""
    if torch.is_tensor(batch.get("attention_mask")):
        return int(batch["attention_mask"].sum())
    if torch.is_tensor(batch.get("input_ids")):
        return int(batch["input_ids"].numel())
    return count_units(batch)


def custom_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """What your forward receives: the batch without `num_units`."""
    return {k: v for k, v in batch.items() if k != NUM_UNITS}
