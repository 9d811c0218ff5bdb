"""The preflight of a run with your own model or data (`model.factory`, `data.factory`) and of
per-stage freezing, before anything is written: the references import, the model builds on the
meta device (no storage), the data factory returns data sets and a collator, one collated batch
goes through the forward on the meta device and returns `(loss_sum, num_units)`, and every
`trainable` / `frozen` pattern matches a parameter. The planner reuses the meta build and the meta
forward (the bytes autograd saves are the activation estimate).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scaletune.errors import Problem, UserError, problems_of

if TYPE_CHECKING:
    from torch import nn

    from scaletune.resolve import RunSpec, Stage

log = logging.getLogger(__name__)


@dataclass
class MetaRun:
    """A factory run's model on the meta device and one batch of its first stage's data.

    Attributes:
        loss: `CustomModelLoss` around the module (meta parameters).
        processor: the tokenizer or processor the factory returned, or None.
        batch: one collated micro-batch of the first stage's data (CPU), or None when the data
            could not be built here (`note` says why).
    """

    loss: nn.Module
    processor: Any
    batch: dict | None
    note: str = ""


def _stage_bundle(stage: Stage, processor: Any, spec: RunSpec) -> Any:
    from scaletune.data import build_custom_data, build_datasets

    if stage.data.factory is not None:
        return build_custom_data(stage.data, processor, seed=spec.config.seed)
    return build_datasets(stage.data, processor, seed=spec.config.seed)


def _first_batch(bundle: Any, processor: Any, spec: RunSpec) -> dict:
    from scaletune.data import Collator

    collator = bundle.collator or Collator(processor.pad_token_id)
    n = min(spec.batch.micro_batch_size, len(bundle.train))
    return collator([bundle.train[i] for i in range(n)])


def meta_loss(spec: RunSpec) -> tuple[nn.Module, Any]:
    """A factory run's loss module on the meta device, and the factory's tokenizer or processor
    (else `model.tokenizer`'s, else None).

    Raises:
        UserError: the model factory's problems (import, arguments, type, shard_modules).
    """
    from scaletune.models.custom import CustomModelLoss
    from scaletune.models.factory import build_model, shard_classes

    m = spec.config.model
    module, processor = build_model(m, meta=True, dtype=spec.precision.storage)
    module.to("meta")  # a factory that had to build on the CPU (it reads weights itself)
    if processor is None and m.tokenizer:
        from scaletune.models import load_tokenizer

        processor = load_tokenizer(m)
    return CustomModelLoss(module, m, shard_classes(module, m.shard_modules)), processor


def meta_run(spec: RunSpec) -> MetaRun:
    """:func:`meta_loss` and one batch of the first stage's data.

    Raises:
        UserError: the model factory's and the first stage's data factory's problems.
    """
    loss, processor = meta_loss(spec)
    bundle = _stage_bundle(spec.stages[0], processor, spec)
    return MetaRun(loss, processor, _first_batch(bundle, processor, spec))


def meta_forward(loss: nn.Module, batch: dict) -> int:
    """Run `batch` through `loss` on the meta device with autograd on; returns the bytes of the
    tensors autograd saves for backward (activations; parameters and their views excluded).

    Raises:
        UserError: the forward does not return `(loss_sum, num_units)` (`models.custom.check_output`).
        Exception: whatever the forward raises on the meta device (ops that read values cannot run
            there); callers treat it as "not checkable here".
    """
    import torch

    from scaletune.trainer.batches import CUSTOM

    params = {id(p) for p in loss.parameters()}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        base = t._base if t._base is not None else t
        if id(t) not in seen and id(base) not in params and id(t) not in params:
            seen.add(id(t))
            total += t.numel() * t.element_size()
        return t

    inputs = {k: v.to("meta") if torch.is_tensor(v) else v for k, v in CUSTOM.inputs(batch).items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(**inputs)
    return total


def factory_problems(spec: RunSpec) -> list[Problem]:
    """Every problem of a factory run (or of stage patterns) found without writing anything; empty
    for a Hugging Face run with neither. Data factories are called on rank 0 only (they may
    download); rank 0 alone then reports their problems, as it does the run directory's."""
    from scaletune.data.factory import batch_problems
    from scaletune.trainer.freezing import trainable_sets

    custom = spec.custom_model
    data_factories = [s for s in spec.stages if s.data.factory is not None]
    if not (custom or spec.freezes_per_stage or data_factories):
        return []
    problems: list[Problem] = []
    model: Any = None
    loss: Any = None
    processor: Any = None
    try:
        if custom:
            loss, processor = meta_loss(spec)
            model = loss.model
        else:
            from scaletune.models import load_tokenizer
            from scaletune.trainer.model_setup import meta_model

            processor = load_tokenizer(spec.config.model)
            model = meta_model(spec) if spec.freezes_per_stage else None
    except UserError as exc:
        problems += problems_of(exc, "model factory")
    bundles: dict[int, Any] = {}
    model_failed = bool(problems)
    for stage in data_factories if spec.env.is_main else []:
        try:
            bundles[stage.index] = _stage_bundle(stage, processor, spec)
        except UserError as exc:
            problems += _new(problems_of(exc, "data factory"), problems)
        except Exception as exc:
            if not model_failed:
                raise
            # Called without the model's tokenizer (the model factory failed): the run stops anyway.
            log.info(f"data.factory {stage.data.factory}: not checked further without a model ({exc})")
    first: dict[int, dict] = {}
    if bundles:
        vocab = _vocab_size(loss, spec) if not model_failed else None
        for index, bundle in bundles.items():
            ref = spec.stages[index].data.factory
            try:
                batch = _first_batch(bundle, processor, spec)
            except Exception as exc:  # the factory's collator: its failure is bad input, said once
                problems.append(
                    Problem(
                        "data factory",
                        None,
                        f"data.factory {ref!r}: its collator fails on the first items: {type(exc).__name__}: {exc}",
                    )
                )
                continue
            found = batch_problems(batch, ref, vocab_size=vocab, text=loss is None)
            problems += found
            if not found:
                first[index] = batch
    if loss is not None and 0 in first:  # text data is not tokenized here: checked at the first step
        try:
            problems += _forward_problems(MetaRun(loss, processor, first[0]))
        except UserError as exc:
            problems += _new(problems_of(exc, "model factory"), problems)
    if model is not None:
        try:
            trainable_sets(model, spec.stages, numbered=bool(spec.config.stages))
        except UserError as exc:
            problems += problems_of(exc, "stage patterns")
    return problems


def _new(found: list[Problem], known: list[Problem]) -> list[Problem]:
    """`found` without the problems already in `known` (by their text: one message said once)."""
    seen = {p.text() for p in known}
    return [p for p in found if p.text() not in seen]


def _vocab_size(loss: Any, spec: RunSpec) -> int | None:
    """Rows of the input embedding the data factory's ids index: the factory module's
    `get_input_embeddings()` (None where it has none), else the Hugging Face config's vocab_size."""
    if loss is not None:
        get = getattr(loss.model, "get_input_embeddings", None)
        try:
            emb = get() if callable(get) else None
        except (NotImplementedError, AttributeError):
            emb = None
        return getattr(emb, "num_embeddings", None)
    from scaletune.models import load_config

    try:
        hf = load_config(spec.config.model)
    except UserError:
        return None  # model_facts reports it
    return getattr(hf.get_text_config(), "vocab_size", None)


def _forward_problems(run: MetaRun) -> list[Problem]:
    from scaletune.trainer.batches import CUSTOM

    assert run.batch is not None
    try:
        CUSTOM.targets(run.batch)
        meta_forward(run.loss, run.batch)
    except UserError as exc:
        return problems_of(exc, "model factory")
    except Exception as exc:  # an op that needs values: checked at the first step instead
        log.info(
            f"model.factory: the forward cannot run on the meta device ({type(exc).__name__}: {exc}); "
            "its output is checked at the first step"
        )
    return []
