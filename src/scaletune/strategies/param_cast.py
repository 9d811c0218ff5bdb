"""bfloat16 parameter copies over float32 master weights for strategies single and ddp
(`model.mixed_precision: bf16_params`, `Precision.cast_params`).

Under autocast the float32 weights compute in bf16 only inside autocast's matmuls; the embeddings,
the norms and the residual adds stay float32, and so do the activations between the layers.
Here the weights themselves are cast: torch's FSDP2 (`fully_shard`) over a `(world_size, 1)`
("replicate", "shard") mesh is HSDP with shard groups of one rank, that is data parallelism
(torch 2.13 skips the all-gather and the reduce-scatter of a one-rank shard group). Its
`MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` is exactly the scheme wanted: each
decoder layer (and the root: embeddings, final norm, head) computes with bf16 copies cast from the
fp32 parameters just before its forward and again before its backward (`reshard_after_forward`:
the copies never outlive a layer's use, and a forward without backward, evaluation, leaves no stale
copy behind after the optimizer step); bf16 gradients are upcast, accumulated over micro-batches and
all-reduced in fp32 into fp32 gradients of the fp32 parameters, which AdamW steps. The module's
parameters are those fp32 masters (replicated DTensors), so checkpoints (DCP) and the export hold
them exactly. torchtitan's `mixed_precision_param: bfloat16` / `mixed_precision_reduce: float32`
and DeepSpeed's bf16 mode keep the same state.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletune.strategies.base import Strategy, check_devices
from scaletune.strategies.ddp import DDPStrategy
from scaletune.strategies.frozen_reference import resident_whole
from scaletune.strategies.fsdp import FullyShardedState, refresh_units
from scaletune.strategies.single import SingleStrategy


class CastParams(FullyShardedState, Strategy):
    """What single and ddp do differently with `cast_params` (mixed in before them)."""

    # A device mesh needs a process group, also for one process (a group of one).
    needs_process_group = True

    def wrap(self, module: nn.Module) -> None:
        check_devices(module, self.device, strategy=self.name)
        replicate_cast(module, self.device, self.env.world_size, self.compute_dtype)
        self.log.info(f"{self.name}: bfloat16 copies of the float32 weights per layer (FSDP2 replicate mesh)")
        self.module = self.model = module
        self.optimizer = self.build_optimizer(module)
        self._finish_wrap()

    def wrap_reference(self, model: nn.Module) -> nn.Module:
        """The frozen reference whole on this rank, in the compute dtype: it computes as the policy's copies do."""
        self.reference = resident_whole(model, self.device, self.compute_dtype)
        return self.reference

    def micro_step(self, is_last: bool) -> contextlib.AbstractContextManager:
        # DDP's no_sync: accumulation micro-steps keep their gradients (upcast to fp32) on this rank;
        # the last one all-reduces the fp32 sum.
        assert self.model is not None
        self.model.set_requires_gradient_sync(is_last)  # type: ignore[operator]
        return contextlib.nullcontext()

    @property
    def grad_divisor(self) -> float:
        return float(self.env.world_size)  # the all-reduce averages over ranks

    def retarget(self, trainable: frozenset[str]) -> None:
        # As FSDPStrategy.retarget: FSDP2 fixes each unit's gradient dtypes at its lazy init from the
        # parameters trainable then; unshard() re-runs that init for the new trainable set.
        Strategy.retarget(self, trainable)
        refresh_units(self.module)


def replicate_cast(module: nn.Module, device: torch.device, world_size: int, dtype: torch.dtype) -> list[nn.Module]:
    """Apply FSDP2 over a `(world_size, 1)` replicate mesh to every decoder layer of `module` and then
    to `module` itself, with bf16 (`dtype`) parameters and fp32 gradient reduction (module docstring).
    Every unit re-casts its copies in backward (`reshard_after_forward=True`, the root too).

    Returns:
        The layers wrapped.

    Raises:
        RuntimeError: no process group, or no decoder layer class in `module`.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from scaletune.models import decoder_layer_classes
    from scaletune.strategies.parallel.parallelize import register_generate

    if not dist.is_initialized():
        raise RuntimeError("model.mixed_precision bf16_params needs a process group (the strategy starts one)")
    mesh = init_device_mesh(device.type, (world_size, 1), mesh_dim_names=("replicate", "shard"))
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": True,
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
    }
    classes = tuple(decoder_layer_classes(module))
    if not classes:
        raise RuntimeError("bf16_params: found no decoder layer class (model._no_split_modules is empty)")
    layers = [m for m in module.modules() if isinstance(m, classes)]
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(module, **kwargs)
    register_generate(module)
    return layers


class SingleCastStrategy(CastParams, SingleStrategy):
    """`single` with bf16 parameter copies: one process, a mesh of one rank."""


class DDPCastStrategy(CastParams, DDPStrategy):
    """`ddp` with bf16 parameter copies: FSDP2's data parallelism instead of DistributedDataParallel."""
