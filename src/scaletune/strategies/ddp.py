"""Data parallelism with `torch.nn.parallel.DistributedDataParallel`: a full replica per rank,
gradients all-reduced (averaged) in buckets during backward."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from scaletune.strategies.base import Strategy, check_devices


class DDPStrategy(Strategy):
    """DDP configured for LoRA + gradient checkpointing.

    "Expected to mark a variable ready only once" comes from reentrant checkpointing re-running
    forward inside backward, so DDP's autograd hooks fire twice for the same parameter. With
    non-reentrant checkpointing (models.enable_gradient_checkpointing) each parameter's hook fires
    once; `find_unused_parameters=False` because every trainable parameter (LoRA or full) is used
    in each forward, and `static_graph` is not needed and would be wrong if a step skipped a module.
    """

    name = "ddp"

    def wrap(self, module: nn.Module) -> None:
        check_devices(module, self.device, strategy=self.name)
        self.module = module
        self.model = self._replicate(module)
        self.optimizer = self.build_optimizer(module)
        self._finish_wrap()

    def _replicate(self, module: nn.Module) -> DistributedDataParallel:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(
            module,
            device_ids=device_ids,
            find_unused_parameters=False,
            gradient_as_bucket_view=True,
        )

    def retarget(self, trainable: frozenset[str]) -> None:
        # DDP's reducer buckets and hooks the parameters that required grad when it was built: a
        # parameter unfrozen later would never be all-reduced, one frozen later would be waited
        # for forever. A new wrapper over the same module builds a new reducer; dropping the old
        # one removes its hooks.
        super().retarget(trainable)
        self.model = None
        self.model = self._replicate(self.module)

    def micro_step(self, is_last: bool) -> contextlib.AbstractContextManager:
        # Gradients of accumulation micro-steps stay local; only the last one all-reduces.
        assert isinstance(self.model, DistributedDataParallel)
        return contextlib.nullcontext() if is_last else self.model.no_sync()

    @property
    def grad_divisor(self) -> float:
        return float(self.env.world_size)
