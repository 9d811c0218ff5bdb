"""The planner's choices for a resolved run, in the settings resolve applies:
`distributed.strategy: auto` (the fastest strategy that fits this rank's GPU) and
`model.gradient_checkpointing: auto` (on only where the run's strategy does not fit without it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletune.plan.estimates import plan, scaletune_settings
from scaletune.resolve import AutoChoice, CheckpointingChoice

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec

__all__ = ["choose_auto", "choose_checkpointing"]

GIB = 2**30


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


def choose_checkpointing(spec: RunSpec) -> CheckpointingChoice:
    """The planner's answer for `model.gradient_checkpointing: auto` (resolve asks it with the run's
    strategy decided and checkpointing assumed on).

    Recomputing each layer in backward costs about a fifth of a step (a second forward of the
    decoder), so it is on only where the plan of the run's strategy (:meth:`Plan.for_run`) does not
    fit this rank's GPU (`env.device_memory_bytes`) without it: the activations of every layer
    (`activations_no_ckpt`) in place of the checkpointed ones, with the plan's 10 % allowance on
    them. Without device memory (a CPU, or a machine the run only plans for): off.
    """
    mem = spec.env.device_memory_bytes
    if mem is None:
        return CheckpointingChoice(False, "no device memory to plan with")
    entry = plan(spec, gpu_memory_bytes=mem).for_run(spec)
    assert entry.activations == entry.activations_ckpt, "asked with checkpointing assumed on"
    with_it = entry.total
    extra = entry.activations_no_ckpt - entry.activations_ckpt
    without = with_it + extra + extra // 10
    per_rank = f"{without / GIB:.1f} GiB a rank without it, {with_it / GIB:.1f} with it, of {mem / GIB:.1f}"
    if without <= mem:
        return CheckpointingChoice(False, f"the plan fits without it ({per_rank})")
    return CheckpointingChoice(True, f"the plan does not fit without it ({per_rank})")
