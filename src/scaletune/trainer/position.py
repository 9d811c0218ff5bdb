"""Where a run stands, step by step: optimizer steps since the run began, steps in the current
stage, and the epoch and step within it of the last step; and how that becomes a checkpoint's
`Progress` (the position of the *next* step, where a resumed run's data continues)."""

from __future__ import annotations

from dataclasses import dataclass

from scaletune.checkpoint import Progress

__all__ = ["Position"]


@dataclass
class Position:
    """The run's position after its last optimizer step.

    Attributes:
        step: optimizer steps since the run began (all stages, before a resume too).
        stage_step: optimizer steps done in the current stage.
        epoch: the epoch (within the stage, from 0) of the last step.
        done_in_epoch: steps done in that epoch (the last step's index in it, plus one).
    """

    step: int = 0
    stage_step: int = 0
    epoch: int = 0
    done_in_epoch: int = 0

    def enter_stage(self, start: Progress | None = None) -> None:
        """At a stage's start: from its beginning, or from the checkpoint `start` written in it."""
        if start is None:
            self.stage_step, self.epoch, self.done_in_epoch = 0, 0, 0
        else:
            self.stage_step, self.epoch, self.done_in_epoch = start.stage_step, start.epoch, start.step_in_epoch

    def advance(self, epoch: int, index: int) -> None:
        """One optimizer step done: the `index`-th step (from 0) of `epoch`."""
        self.step += 1
        self.stage_step += 1
        self.epoch, self.done_in_epoch = epoch, index + 1

    def epochs(self, steps_per_epoch: int) -> float:
        """Epochs done in the stage, fractional (metrics.jsonl `epoch`), to 4 decimals."""
        return round(self.epoch + self.done_in_epoch / steps_per_epoch, 4)

    def next_start(self, steps_per_epoch: int) -> tuple[int, int]:
        """(epoch, steps done in it) of the next step: an epoch's last step moves on to the next epoch."""
        if self.done_in_epoch < steps_per_epoch:
            return self.epoch, self.done_in_epoch
        return self.epoch + 1, 0

    def progress(
        self,
        *,
        stage_index: int,
        stage_name: str,
        steps_per_epoch: int,
        global_batch_size: int,
        world_size: int,
        strategy: str,
        checkpoint_format: str,
        stage_complete: bool,
    ) -> Progress:
        """The checkpoint record of this position: a resume continues with the next step's data."""
        epoch, in_epoch = self.next_start(steps_per_epoch)
        return Progress(
            step=self.step,
            stage_index=stage_index,
            stage_name=stage_name,
            stage_step=self.stage_step,
            epoch=epoch,
            step_in_epoch=in_epoch,
            sample_offset=in_epoch * global_batch_size,
            world_size=world_size,
            strategy=strategy,
            checkpoint_format=checkpoint_format,
            stage_complete=stage_complete,
        )
