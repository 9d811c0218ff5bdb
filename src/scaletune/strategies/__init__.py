"""Parallelism engines behind one interface (`base.Strategy`): single, ddp, fsdp, deepspeed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from scaletune.config import BatchArithmetic, Config
from scaletune.env import DistributedEnv

if TYPE_CHECKING:  # choose_strategy stays importable without torch (doctor uses it)
    from scaletune.strategies.base import Strategy


def choose_strategy(cfg: Config, env: DistributedEnv) -> str:
    """The strategy name for this run: the configured one, or for `auto` `single` on one process
    and `ddp` on several (the memory planner refines `auto` where it is available)."""
    name = cfg.distributed.strategy
    if name != "auto":
        return name
    return "ddp" if env.world_size > 1 else "single"


def make_strategy(name: str, cfg: Config, env: DistributedEnv, batch: BatchArithmetic) -> "Strategy":
    """Instantiate the engine `name`, importing only what it needs."""
    args = (env, cfg.distributed, cfg.model, cfg.training, batch)
    if name == "single":
        from scaletune.strategies.single import SingleStrategy

        return SingleStrategy(*args)
    if name == "ddp":
        from scaletune.strategies.ddp import DDPStrategy

        return DDPStrategy(*args)
    if name == "fsdp":
        from scaletune.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(*args)
    if name == "deepspeed":
        from scaletune.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(*args)
    raise ValueError(f"unknown strategy {name!r}")
