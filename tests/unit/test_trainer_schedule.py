"""trainer/schedule.py: the run's learning-rate schedule against transformers' `get_scheduler` run
step by step as the control (built, continued across a re-target, restored from a checkpoint),
and stepped by the loop after the optimizer's step."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import get_scheduler

from scaletune.config import TrainingConfig
from scaletune.trainer.schedule import Schedule

PEAK = 1e-3


def optimizer(frozen_bias: bool = False) -> torch.optim.Optimizer:
    """AdamW over a matrix and a bias in two groups (one group when the bias is frozen)."""
    w, b = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.zeros(3))
    groups = [{"params": [w], "weight_decay": 0.1}] + ([] if frozen_bias else [{"params": [b], "weight_decay": 0.0}])
    return torch.optim.AdamW(groups, lr=123.0)  # the schedule sets the peak itself


def control(name: str, warmup: int, total: int, steps: int, **kw) -> list[float]:
    """The rate of each of `steps` optimizer steps, from transformers' own scheduler."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=PEAK)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total, **kw)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def run(schedule: Schedule, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        assert all(g["lr"] == rates[-1] for g in opt.param_groups)
        opt.step()
        schedule.step()
    return rates


def training(kind: str = "cosine", warmup: int = 2, **kw) -> TrainingConfig:
    return TrainingConfig(learning_rate=PEAK, lr_scheduler=kind, warmup_steps=warmup, **kw)


@pytest.mark.parametrize(
    ("kind", "name", "kw"),
    [
        ("cosine", "cosine", {}),
        ("linear", "linear", {}),
        ("constant", "constant_with_warmup", {}),
    ],
)
def test_a_stage_of_its_own_follows_transformers(kind, name, kw):
    opt = optimizer()
    schedule = Schedule()
    schedule.enter(opt, training(kind), 10, continues=False, retargeted=False)
    assert run(schedule, opt, 10) == pytest.approx(control(name, 2, 10, 10), rel=1e-12, abs=0)


def test_min_lr_ratio_follows_cosine_with_min_lr():
    opt = optimizer()
    schedule = Schedule()
    schedule.enter(opt, training(min_lr_ratio=0.1), 8, continues=False, retargeted=False)
    want = control("cosine_with_min_lr", 2, 8, 8, scheduler_specific_kwargs={"min_lr_rate": 0.1})
    assert run(schedule, opt, 8) == pytest.approx(want, rel=1e-12, abs=0)


@pytest.mark.parametrize(("frozen_before", "frozen_after"), [(False, False), (False, True), (True, False)])
def test_a_continuing_stage_keeps_the_schedule_across_a_retarget(frozen_before, frozen_after):
    """Stage 0 runs 4 of the 10 steps its schedule spans; stage 1 continues it on a new optimizer
    (another trainable set, with as many or fewer or more parameter groups): the 10 rates are those
    of one uninterrupted schedule, on every group."""
    first = optimizer(frozen_bias=frozen_before)
    schedule = Schedule()
    schedule.enter(first, training(), 10, continues=False, retargeted=False)
    rates = run(schedule, first, 4)
    second = optimizer(frozen_bias=frozen_after)
    schedule.enter(second, training(), 10, continues=True, retargeted=True)
    rates += run(schedule, second, 6)
    assert rates == pytest.approx(control("cosine", 2, 10, 10), rel=1e-12, abs=0)


def test_a_continuing_stage_without_a_retarget_keeps_the_running_schedule():
    opt = optimizer()
    schedule = Schedule()
    schedule.enter(opt, training(), 10, continues=False, retargeted=False)
    rates = run(schedule, opt, 3)
    schedule.enter(opt, training(), 10, continues=True, retargeted=False)
    rates += run(schedule, opt, 7)
    assert rates == pytest.approx(control("cosine", 2, 10, 10), rel=1e-12, abs=0)


def test_a_stage_of_its_own_after_another_starts_again_at_its_peak():
    opt = optimizer()
    schedule = Schedule()
    schedule.enter(opt, training(), 4, continues=False, retargeted=False)
    run(schedule, opt, 4)
    schedule.enter(opt, training("linear", warmup=1), 5, continues=False, retargeted=False)
    assert run(schedule, opt, 5) == pytest.approx(control("linear", 1, 5, 5), rel=1e-12, abs=0)


@pytest.mark.parametrize("horizon", [10, 16])
def test_restore_continues_at_the_saved_position(horizon):
    """Saved after 4 of 10 steps (through JSON, as scheduler.json), restored on a fresh optimizer:
    the next rates are the control's from step 5 on, over the new horizon when max_steps was raised."""
    opt = optimizer()
    schedule = Schedule()
    schedule.enter(opt, training(), 10, continues=False, retargeted=False)
    run(schedule, opt, 4)
    saved = json.loads(json.dumps(schedule.state_dict()))

    fresh = optimizer()
    resumed = Schedule()
    resumed.enter(fresh, training(), horizon, continues=False, retargeted=False)
    resumed.restore(saved)
    rest = run(resumed, fresh, horizon - 4)
    assert rest == pytest.approx(control("cosine", 2, horizon, horizon)[4:], rel=1e-12, abs=0)


def test_restore_into_a_continuing_stage_rebuilds_its_origins_schedule():
    """A run resumed in stage 1, which continues stage 0's schedule: no schedule runs yet, so
    entering builds the origin's, and the saved state puts it at the saved step (the optimizer has
    the groups of the stage that saved, as `StageFreezing.before_wrap` sets them)."""
    opt = optimizer(frozen_bias=True)
    schedule = Schedule()
    schedule.enter(opt, training(), 10, continues=False, retargeted=False)
    run(schedule, opt, 6)
    saved = schedule.state_dict()

    fresh = optimizer(frozen_bias=True)
    resumed = Schedule()
    resumed.enter(fresh, training(), 10, continues=True, retargeted=False)
    resumed.restore(saved)
    assert run(resumed, fresh, 4) == pytest.approx(control("cosine", 2, 10, 10)[6:], rel=1e-12, abs=0)


def test_the_loop_steps_the_schedule_after_the_optimizer(tiny_model_dir, tmp_path):
    """Real steps of the tiny model under the single strategy: the strategy's step leaves the rate
    alone, and the rate each step used (`strategy.lr()` before it) is the control's."""
    from scaletune.data import Collator
    from scaletune.models import load_tokenizer, prepare_model
    from scaletune.models.loss import CausalLMLoss
    from scaletune.resolve import resolve
    from scaletune.strategies import make_strategy, torn_down
    from scaletune.trainer import train_step
    from tests.helpers import make_config, make_env

    spec = resolve(make_config(tiny_model_dir, tmp_path / "run", as_config=True), make_env())
    strategy = make_strategy(spec)
    tok = load_tokenizer(spec.config.model)
    batch = Collator(tok.pad_token_id)([{"input_ids": list(range(5, 30)), "labels": list(range(5, 30))}] * 2)
    with torn_down(strategy):
        strategy.wrap(CausalLMLoss(prepare_model(spec.config.model, strategy.placement)))
        schedule = Schedule()
        schedule.enter(strategy.optimizer, training(), 5, continues=False, retargeted=False)
        rates = []
        for _ in range(5):
            rates.append(strategy.lr())
            train_step(strategy, [batch])
            assert strategy.lr() == rates[-1]  # the engine's step does not move the rate
            schedule.step()
    assert rates == pytest.approx(control("cosine", 2, 5, 5), rel=1e-12, abs=0)
