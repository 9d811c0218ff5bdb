"""The run's learning-rate schedule, owned in one place: built at a stage's start (or continued,
when the stage's `schedule_origin` is an earlier stage), moved to a new optimizer after a re-target
at the same position, restored from a checkpoint, stepped after every optimizer step and saved.

The schedule is transformers' `get_scheduler` (a `LambdaLR`) built by `strategies.optim.make_scheduler`
on the strategy's current optimizer; the strategy itself knows nothing of it."""

from __future__ import annotations

from typing import Any

import torch

from scaletune.config import TrainingConfig
from scaletune.strategies.optim import make_scheduler

__all__ = ["Schedule"]


class Schedule:
    """The learning rate of every optimizer step of the run (none before the first stage starts)."""

    def __init__(self) -> None:
        self._lr: Any = None  # the LambdaLR of the running schedule

    def enter(
        self,
        optimizer: torch.optim.Optimizer,
        origin: TrainingConfig,
        steps: int,
        *,
        continues: bool,
        retargeted: bool,
        saved: dict | None = None,
    ) -> None:
        """At a stage's start: a stage that continues the running schedule keeps it (on the new
        optimizer, at the same position, when the stage re-targeted); a continuing stage entered
        right after resuming from the previous stage's end checkpoint (`saved`: its schedule state)
        builds it at the position saved; any other stage, and a continuing one resumed inside itself
        (:meth:`restore` follows), builds one.

        Args:
            optimizer: the strategy's optimizer now (a new one after a re-target).
            origin: the training settings of the stage that starts the schedule (peak rate, warmup, kind).
            steps: the optimizer steps the schedule spans (`StagePlan.schedule_steps`).
            continues: the stage's `schedule_origin` is an earlier stage.
            retargeted: the optimizer is new since the last step (`StageFreezing.enter`).
            saved: the schedule state of the previous stage's end checkpoint the run resumed from.
        """
        if continues and self._lr is not None:
            if retargeted:
                self._move_to(optimizer, origin, steps, self._lr.last_epoch)
            return
        if continues and saved is not None:
            self._move_to(optimizer, origin, steps, int(saved["last_epoch"]))
            return
        self._lr = make_scheduler(optimizer, origin, steps)

    def _move_to(self, optimizer: torch.optim.Optimizer, origin: TrainingConfig, steps: int, steps_taken: int) -> None:
        """The schedule on a (new) optimizer, at the position `steps_taken` the running one reached.
        The position is all that carries over: the new optimizer may have another number of
        parameter groups (a stage that freezes every bias has no no-decay group), so the old
        scheduler's per-group state does not fit it."""
        self._lr = make_scheduler(optimizer, origin, steps)
        sched = self._lr
        sched.last_epoch = steps_taken
        rates = [base * rate(steps_taken) for base, rate in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        for group, lr in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = lr
        sched._last_lr = rates

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's `state_dict()` (call after :meth:`enter` of the stage it was
        saved in). The position comes from the checkpoint, the horizon from this run's schedule
        (longer when max_steps was raised): the next step's rate, from the schedule's own lambdas."""
        sched = self._lr
        sched.load_state_dict(state)
        for group, base, rate in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=False):
            group["lr"] = base * rate(sched.last_epoch)

    def step(self) -> None:
        """After each optimizer step (an fp16 step the loss scaler skipped too: the schedule counts steps)."""
        self._lr.step()

    def state_dict(self) -> dict:
        """The running schedule's state (JSON-serialisable: `checkpoints/step-N/scheduler.json`)."""
        return self._lr.state_dict()

    @property
    def last_lr(self) -> list[float]:
        """The rate of each optimizer parameter group for the next step."""
        return self._lr.get_last_lr()
