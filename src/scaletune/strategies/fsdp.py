"""Fully sharded data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each decoder layer is one FSDP unit (all-gathered just before its forward, resharded after it
when `reshard_after_forward`), and the root holds the embeddings, final norm and head. Parameters,
gradients and optimizer state live as DTensor shards, 1/world_size per rank (of the data ranks on a
device mesh).

The other degrees of a device mesh (tensor, context, pipeline) are `strategies/parallel/`'s:
`FSDPStrategy` builds this rank's `Parallelism` (the mesh facts) and its step runner once in `setup`,
hands the loaded model to `parallelize` (which shards it with `shard_model` and FSDP2's policies
given here, and fills it from the loading rank(s)), and delegates the steps to the runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletune.strategies.base import Strategy
from scaletune.strategies.parallel.mesh import Parallelism
from scaletune.strategies.parallel.parallelize import parallelize
from scaletune.strategies.parallel.runner import StepRunner, gather_full_state, step_runner


def refresh_units(module: nn.Module) -> None:
    """Re-run each FSDP2 unit's lazy init (idempotent), which fixes its gradient dtypes from the
    parameters trainable now."""
    from torch.distributed.fsdp import FSDPModule

    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()
            unit.reshard()


class FullyShardedState:
    """`step` and `full_state_dict` of a model whose units FSDP2's `fully_shard` wrapped: FSDPStrategy,
    and the bf16 parameter copies of strategies/param_cast.py (a one-rank shard mesh). A mixin before
    the Strategy it completes."""

    def step(self) -> torch.Tensor:
        norm = super().step()  # type: ignore[misc]
        # The norm over DTensor gradients is a replicated DTensor: every rank has the total.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return gather_full_state(self.model, self.env.is_main)  # type: ignore[attr-defined]


class FSDPStrategy(FullyShardedState, Strategy):
    name = "fsdp"
    # Rank 0 loads on the CPU; the shards are materialised on each rank's device in `wrap`.
    engine_places_model = True
    needs_process_group = True

    @property
    def cpu_collectives(self) -> bool:  # type: ignore[override]
        # With CPU offload the state-dict broadcast and the gradient-norm reduction run on CPU DTensors.
        return self.spec.offload_params

    def load_meta(self) -> bool:
        # Only the loading rank(s) read the weights (`Parallelism.loads_weights`).
        return not self.parallelism.loads_weights

    def setup(self) -> None:
        super().setup()
        #: This rank's place on the device mesh (`strategies/parallel/mesh.py`).
        self.parallelism = Parallelism(self.spec.mesh, self.env.rank, self.env.world_size, self.env.device_type)
        #: How the steps run on that layout (`strategies/parallel/runner.py`).
        self.runner: StepRunner = step_runner(self, self.parallelism)

    def all_reduce_data(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that hold different data (`Parallelism.all_reduce_data`)."""
        return self.parallelism.all_reduce_data(value, self.comm_device)

    def split_batch(self, micro_batch: dict[str, Any]) -> dict[str, Any]:
        return self.parallelism.split_batch(micro_batch)

    def forward_backward(self, inputs: list[dict], denominator: torch.Tensor, each: Any = None) -> torch.Tensor:
        return self.runner.forward_backward(inputs, denominator, each)

    @property
    def eval_group(self) -> int:
        return self.runner.eval_group

    def forward_only(self, inputs: list[dict]) -> torch.Tensor:
        return self.runner.forward_only(inputs)

    def clip_grad_norm(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        return self.runner.clip(params, max_norm)

    def save_state(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.module is not None and self.optimizer is not None
        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=self._state_options())
        self.runner.merge_param_groups(optim_sd)  # every rank must write the same param groups
        dcp.save({"model": self._checkpointed(model_sd), "optim": optim_sd}, checkpoint_id=str(path / "state"))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.runner.state_shapes(super().state_shapes())

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.runner.full_state_dict(self.model)  # type: ignore[arg-type]

    def export(self, out_dir: Path, trained_base: frozenset[str] = frozenset()) -> None:
        state = self.full_state_dict()
        with self.runner.whole(self.model):  # type: ignore[arg-type]
            self._write_export(out_dir, state, trained_base)

    def describe(self) -> str:
        return super().describe() + self.parallelism.describe()

    def make_scaler(self) -> Any:
        """fp16: FSDP's `ShardedGradScaler`, which all-reduces the overflow flag over the ranks' shards."""
        if self.compute_dtype != torch.float16:
            return None
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.env.device_type)

    def wrap(self, model: nn.Module) -> None:  # model: the CausalLMLoss; it becomes the FSDP root
        reshard = self.spec.config.distributed.reshard_after_forward
        model = parallelize(model, self.parallelism, self.device, **self._fsdp_options(reshard_after_forward=reshard))
        self.module = self.model = model
        self.optimizer = self.build_optimizer(model)
        self._finish_wrap()

    def wrap_reference(self, model: nn.Module) -> nn.Module:
        """The frozen reference sharded like the policy (its mixed-precision and offload policies),
        every unit resharded after its forward, filled from rank 0 (`strategies/frozen_reference.py`)."""
        from scaletune.strategies.frozen_reference import freeze

        ref = freeze(model)
        options = self._fsdp_options(reshard_after_forward=True, no_backward=True)
        self.reference = parallelize(ref, self.parallelism, self.device, **options)
        return self.reference

    def _fsdp_options(self, *, reshard_after_forward: bool, no_backward: bool = False) -> dict[str, Any]:
        """`parallelize`'s FSDP2 keyword arguments: resharding, the mixed-precision and offload policies.

        Raises:
            RuntimeError: no process group.
        """
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        if not dist.is_initialized():
            raise RuntimeError("strategy fsdp needs a process group: start it with torchrun or num_processes")
        kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward, "no_backward": no_backward}
        if self.compute_dtype != torch.float32:
            # bf16/fp16 all-gathers and compute, fp32 gradient reduction and fp32 sharded master weights.
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        if self.spec.offload_params:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.env.cuda_available)
        return kwargs

    @property
    def grad_divisor(self) -> float:
        return self.parallelism.grad_divisor

    def retarget(self, trainable: frozenset[str]) -> None:
        # FSDP2 re-reads requires_grad from each sharded parameter at every all-gather, but fixes a
        # unit's gradient dtypes at its lazy init from the parameters trainable then: a unit that was
        # all frozen would reduce a mixed-precision gradient in its low dtype. unshard() re-runs that
        # (idempotent) init; with float32 compute there are no other dtypes to fix.
        super().retarget(trainable)
        if self.compute_dtype != torch.float32:
            refresh_units(self.module)
