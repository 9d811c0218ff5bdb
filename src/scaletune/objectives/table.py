"""Every training objective's loss object by name: the preference objectives (`objectives.objective`),
the online one (`objectives.rl`) and distillation (`objectives.distill`), one per row of
`config.preference.OBJECTIVES` but sft."""

from __future__ import annotations

from typing import Any

from scaletune.config.preference import OBJECTIVES as FACTS
from scaletune.objectives.distill import Distill
from scaletune.objectives.objective import OBJECTIVES as PREFERENCE
from scaletune.objectives.objective import Objective
from scaletune.objectives.rl import GRPO

__all__ = ["LOSSES", "objective_for"]

LOSSES: dict[str, type[Objective]] = {**PREFERENCE, GRPO.name: GRPO, Distill.name: Distill}
assert set(LOSSES) == set(FACTS) - {"sft"}, "every objective has its row of facts and its loss"


def objective_for(name: str, settings: Any) -> Objective | None:
    """The objective `training.objective` names (None for sft), with its settings: the stage's
    `training.preference` (a `PreferenceConfig`), `training.rl` (an `RLConfig`) for grpo, or
    `training.distill` (a `DistillConfig`) for distill."""
    return None if name == "sft" else LOSSES[name](settings)
