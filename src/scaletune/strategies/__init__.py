"""Parallelism engines behind one interface (`base.Strategy`): single, ddp, fsdp, deepspeed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # importing this package stays torch-free (deepspeed_config is used by `config deepspeed`)
    from scaletune.resolve import RunSpec
    from scaletune.strategies.base import Strategy


def make_strategy(spec: RunSpec) -> Strategy:
    """Instantiate the engine the run resolved to, importing only what it needs."""
    if spec.precision.cast_params:  # single or ddp with model.mixed_precision bf16_params
        from scaletune.strategies.param_cast import DDPCastStrategy, SingleCastStrategy

        return SingleCastStrategy(spec) if spec.strategy == "single" else DDPCastStrategy(spec)
    if spec.strategy == "single":
        from scaletune.strategies.single import SingleStrategy

        return SingleStrategy(spec)
    if spec.strategy == "ddp":
        from scaletune.strategies.ddp import DDPStrategy

        return DDPStrategy(spec)
    if spec.strategy == "fsdp":
        from scaletune.strategies.fsdp import FSDPStrategy

        return FSDPStrategy(spec)
    if spec.strategy == "deepspeed":
        from scaletune.strategies.deepspeed import DeepSpeedStrategy

        return DeepSpeedStrategy(spec)
    raise AssertionError(f"resolve produced an unknown strategy {spec.strategy!r}")


@contextlib.contextmanager
def torn_down(strategy: Strategy) -> Iterator[Strategy]:
    """Set up the strategy and tear its process group down on exit and on error."""
    strategy.setup()
    try:
        yield strategy
    finally:
        strategy.teardown()
