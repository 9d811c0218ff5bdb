"""What the loop (`trainer.loop.Trainer`) is handed and hands between its phases: the run directory
it opens, what `fit` prepares before the engine wraps the model, and a resumed run's hand-off."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from scaletune.checkpoint import Progress
    from scaletune.resolve import RunSpec
    from scaletune.trainer.model_setup import StageFreezing
    from scaletune.trainer.stages import StagePlan

__all__ = ["OpenRunDirectory", "Prepared", "Resumed", "RunDirectory"]


class RunDirectory(Protocol):
    """The run directory as the loop uses it (`run.rundir.RunDirectory`)."""

    def checking(self) -> contextlib.AbstractContextManager[None]:
        """Around the last checks (model wrapped, checkpoint resumed): a replaced run is rolled back on failure."""
        ...


#: Opens (locks, prepares) a run's directory for the run's lifetime (`run.rundir.opened`).
OpenRunDirectory = Callable[["RunSpec"], contextlib.AbstractContextManager[RunDirectory]]


@dataclass(frozen=True)
class Prepared:
    """What `fit` prepares before the engine wraps the model, all of it there for every stage."""

    tokenizer: Any  # the tokenizer or a factory's processor; None: a factory's model without one
    plans: list[StagePlan]
    freezing: StageFreezing
    processor: Any = None  # a vision-language model's processor (it renders the data); saved in final/


@dataclass(frozen=True)
class Resumed:
    """A resumed run's hand-off to the stage it continues in (taken once, by that stage's entry)."""

    path: Path  # the checkpoint
    progress: Progress
    scheduler: dict  # the schedule's saved state
