"""trainer/step.py and the model source under the single strategy, in process, on the tiny model:
one optimizer step against a plain PyTorch control (Hugging Face's own loss, clip, AdamW), the
micro-batch split that must not change a step, and what the loop calls on a strategy
(`strategies.protocol.LoopStrategy`)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from scaletune.resolve import resolve
from tests.helpers import make_config, make_env

CPU = make_env()


def spec_for(model_dir, tmp_path, **sections):
    return resolve(make_config(model_dir, tmp_path / "run", as_config=True, **sections), CPU)


def rows(n: int) -> list[dict]:
    """`n` sequences of different lengths, the first 3 tokens of each not a target."""
    out = []
    for k in range(n):
        ids = list(range(7 + k, 7 + k + 12 + 3 * k))
        out.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    return out


def wrapped(spec):
    """The run's model source, its model and the single strategy around its loss module."""
    from scaletune.strategies import make_strategy
    from scaletune.trainer.model_source import model_source
    from scaletune.trainer.step import seed_everything

    strategy = make_strategy(spec)
    strategy.setup()
    source = model_source(spec)
    seed_everything(0)
    model, processor = source.load(strategy)
    assert processor is None
    strategy.wrap(source.loss(model, strategy))
    return source, model, strategy


def test_one_step_equals_plain_pytorch(tiny_model_dir, tmp_path):
    """The control: the same weights trained one step by Hugging Face's own mean token loss over the
    whole batch, `clip_grad_norm_` and AdamW with the run's settings."""
    from scaletune.data import Collator
    from scaletune.models import load_tokenizer
    from scaletune.trainer.step import train_step

    spec = spec_for(tiny_model_dir, tmp_path)
    tok = load_tokenizer(spec.config.model)
    collate = Collator(tok.pad_token_id)
    data = rows(4)
    source, model, strategy = wrapped(spec)
    try:
        reference = copy.deepcopy(model)
        result = train_step(strategy, [collate(data[:2]), collate(data[2:])], source.kind)
    finally:
        strategy.teardown()

    full = collate(data)
    t = spec.config.training
    out = reference(input_ids=full["input_ids"], attention_mask=full["attention_mask"], labels=full["labels"])
    out.loss.backward()
    params = [p for p in reference.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        eps=t.adam_epsilon,
    )
    opt.step()

    assert float(result.loss) == pytest.approx(float(out.loss), rel=1e-5)
    assert float(result.grad_norm) == pytest.approx(float(norm), rel=1e-4)
    targets = sum(int((torch.tensor(r["labels"][1:]) != -100).sum()) for r in data)
    assert int(result.tokens) == sum(len(r["input_ids"]) for r in data) and targets > 0
    # Adam's first step moves each weight by about lr (2e-3) whatever its gradient's size (the loss
    # and the norm above check the scale): a gradient element near eps turns float rounding (fused
    # or not) into a few 1e-5 there; a missing or wrong step is off by ~lr everywhere.
    trained = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(
            trained[name], p, rtol=0, atol=0.1 * t.learning_rate, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_the_micro_batch_split_does_not_change_the_step(tiny_model_dir, tmp_path):
    """One micro-batch of 4 sequences or 4 of 1: the same loss, gradient norm and weights after."""
    from scaletune.data import Collator
    from scaletune.models import load_tokenizer
    from scaletune.trainer.step import train_step

    spec = spec_for(tiny_model_dir, tmp_path)
    collate = Collator(load_tokenizer(spec.config.model).pad_token_id)
    data = rows(4)
    results, weights = [], []
    for split in ([data], [[r] for r in data]):
        source, model, strategy = wrapped(spec)
        try:
            results.append(train_step(strategy, [collate(mb) for mb in split], source.kind))
        finally:
            strategy.teardown()
        weights.append({k: v.detach().clone() for k, v in model.named_parameters()})
    assert float(results[0].loss) == pytest.approx(float(results[1].loss), rel=1e-5)
    assert float(results[0].grad_norm) == pytest.approx(float(results[1].grad_norm), rel=1e-4)
    lr = spec.config.training.learning_rate  # Adam's first step: see test_one_step_equals_plain_pytorch
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, rtol=0, atol=0.1 * lr, msg=lambda m, name=name: f"{name}: {m}")


def test_the_prefix_names_the_parameters_as_the_engine_sees_them(tiny_model_dir, tmp_path):
    """StageFreezing's names (`ModelSource.prefix` + the model's) are the loss module's own."""
    from scaletune.trainer.model_setup import StageFreezing

    spec = spec_for(tiny_model_dir, tmp_path, stages=[{"name": "a", "frozen": ["*embed*"]}, {"name": "b"}])
    source, model, strategy = wrapped(spec)
    try:
        sets = StageFreezing(spec, model, source.prefix).sets
        names = {n for n, _ in strategy.module.named_parameters(remove_duplicate=False)}
    finally:
        strategy.teardown()
    assert sets[1] == names  # stage b trains everything, named as the loss module names it
    assert sets[0] < names and all("embed" in n for n in names - sets[0])


def test_every_strategy_has_what_the_loop_calls():
    """Each engine's class (and its instance attributes) provides every member of LoopStrategy."""
    from scaletune.strategies.base import Strategy
    from scaletune.strategies.ddp import DDPStrategy
    from scaletune.strategies.deepspeed import DeepSpeedStrategy
    from scaletune.strategies.fsdp import FSDPStrategy
    from scaletune.strategies.protocol import LoopStrategy
    from scaletune.strategies.single import SingleStrategy

    members = {n for n in vars(LoopStrategy) if not n.startswith("_")} | set(LoopStrategy.__annotations__)
    assert {"step", "wrap", "retarget", "keep_frozen", "optimizer"} <= members
    init = inspect.getsource(Strategy.__init__)
    for cls in (SingleStrategy, DDPStrategy, FSDPStrategy, DeepSpeedStrategy):
        missing = [n for n in members if not hasattr(cls, n) and f"self.{n}" not in init]
        assert not missing, f"{cls.__name__} lacks {missing}"
        assert not inspect.isabstract(cls)
    assert not hasattr(Strategy, "scheduler") and "self.scheduler" not in init  # the loop's schedule owns it
