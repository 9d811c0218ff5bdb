"""`distributed.strategy: auto`: the planner's choice for a resolved run (the fastest strategy that
fits this rank's GPU), in the settings resolve applies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletune.plan.estimates import plan, scaletune_settings
from scaletune.resolve import AutoChoice

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec

__all__ = ["choose_auto"]


def choose_auto(spec: RunSpec) -> AutoChoice:
    """The planner's answer for `distributed.strategy: auto` (resolve asks it with the run decided as
    :meth:`AutoChoice.default`).

    With the memory of this rank's GPU (`env.device_memory_bytes`) the plan decides: the fastest
    strategy that fits. Without one (a CPU, or a machine the run only plans for) the default: single
    on one process, ddp on several.
    """
    default = AutoChoice.default(spec.world_size)
    mem = spec.env.device_memory_bytes
    if mem is None:
        return default
    p = plan(spec, gpu_memory_bytes=mem)
    if p.chosen == "ddp":
        return AutoChoice(default.strategy, p.reason)
    settings = dict(scaletune_settings(p.chosen))
    return AutoChoice(
        settings.pop("strategy"),
        p.reason,
        zero_stage=settings.get("zero_stage"),
        offload_optimizer=settings.get("offload_optimizer", False),
        offload_params=settings.get("offload_params", False),
    )
