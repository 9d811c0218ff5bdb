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
from scaletune.config.references import call_checked, import_callable
from scaletune.data.build import DataBundle
from scaletune.data.sources import IGNORE_INDEX, split_records
from scaletune.errors import UserError

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
