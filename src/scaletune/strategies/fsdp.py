"""Fully sharded data parallelism with FSDP2 (`torch.distributed.fsdp.fully_shard`).

Each decoder layer is one FSDP unit (all-gathered just before its forward, resharded after it
when `reshard_after_forward`), and the root holds the embeddings, final norm and head. Parameters,
gradients and optimizer state live as DTensor shards, 1/world_size per rank.

Loading is memory-efficient: rank 0 reads the weights on the CPU, every other rank builds the
architecture on the meta device (no storage); after sharding, rank 0 broadcasts each tensor and
every rank keeps only its shard (`set_model_state_dict(..., broadcast_from_rank0=True)`), as
torchtune does. No rank other than 0 ever holds a full copy.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletune.strategies.base import Strategy
from scaletune.strategies.process_group import broadcast_buffers


def shard_model(
    model: nn.Module,
    layer_classes: tuple[type, ...],
    *,
    reshard_after_forward: bool = True,
    no_backward: bool = False,
    **fully_shard_kwargs: Any,
) -> list[nn.Module]:
    """THE FSDP2 sharding: `fully_shard` every instance of `layer_classes` (the decoder layers), then
    the root, with the same keyword arguments (mesh, mp_policy, offload_policy). Used by the strategy
    and by the planner's fake-world simulation.

    `reshard_after_forward` goes to the layers as given. The root gets None when it is True: FSDP2
    then reshards every module but the root, whose parameters (embeddings, final norm, head) backward
    needs first, so they stay gathered from forward to backward (the root exemption, decided at
    FSDP2's lazy init). Passing True to the root would re-gather them at every step for nothing.
    `no_backward` (a frozen reference model): the root reshards after its forward too, since no
    backward would ever reshard it.

    Returns:
        The sharded layers.

    Raises:
        RuntimeError: no layer class to shard.
    """
    from torch.distributed.fsdp import fully_shard

    if not layer_classes:
        raise RuntimeError("fsdp: found no decoder layer class to shard (model._no_split_modules is empty)")
    layers = [m for m in model.modules() if isinstance(m, layer_classes)]
    for layer in layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **fully_shard_kwargs)
    root = True if no_backward else (None if reshard_after_forward else False)
    fully_shard(model, reshard_after_forward=root, **fully_shard_kwargs)
    return layers


def _retie(model: nn.Module) -> None:
    """`to("meta")` gives each module a new Parameter, so a tied head and its embeddings come apart
    on rank 0 while the ranks built on the meta device keep them tied (and FSDP2 would shard two
    tensors there, one elsewhere): tie them again, on the outermost Hugging Face model."""
    from transformers import PreTrainedModel

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is not None:
        hf.tie_weights()


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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if getattr(self, "pipeline", None) is not None:  # the stages' weights gathered to rank 0
            return self.pipeline.full_state_dict(self.model, self.env.is_main)  # type: ignore[attr-defined]

        # A collective: every rank gathers, only rank 0 keeps the result (on the CPU); under
        # param_cast these are the fp32 masters, whole on every rank.
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # type: ignore[attr-defined]
        return state if self.env.is_main else None  # type: ignore[attr-defined]


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
        if self.spec.mesh.pipeline > 1:  # each stage's leader loads (strategies/pipeline_fsdp.py)
            from scaletune.strategies.pipeline_fsdp import is_stage_leader

            return not is_stage_leader(self.spec.mesh, self.env.rank)
        return not self.env.is_main

    def setup(self) -> None:
        super().setup()
        #: The device mesh where tensor or context parallelism is on (`strategies/mesh.py`), else None.
        self.device_mesh = None
        #: This rank's pipeline stage and schedule where pipeline_parallel > 1 (`strategies/pipeline_fsdp.py`).
        self.pipeline: Any = None
        if self.spec.mesh.model_parallel:
            from scaletune.strategies.mesh import build_device_mesh

            self.device_mesh = build_device_mesh(self.spec.mesh, self.env.device_type, self.env.world_size)
        if self.spec.mesh.pipeline > 1:
            from scaletune.strategies.pipeline_fsdp import PipelineEngine

            self.pipeline = PipelineEngine(self.device_mesh, self.device)

    def _data_group(self) -> Any:
        from scaletune.strategies.mesh import DATA_CONTEXT

        return self.device_mesh[DATA_CONTEXT].get_group() if self.device_mesh is not None else None

    def all_reduce_data(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data_shard x context ranks: a tensor group's ranks hold the same rows and loss."""
        if self.device_mesh is None:
            return self.all_reduce_sum(value)
        t = value.to(self.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self._data_group())
        return t

    def split_batch(self, micro_batch: dict[str, Any]) -> dict[str, Any]:
        """With context parallelism: this rank's slice of every row (`context_parallel.split_batch`)."""
        mesh = self.spec.mesh
        if mesh.context == 1:
            return micro_batch
        from scaletune.strategies.context_parallel import split_batch

        return split_batch(micro_batch, mesh.coordinates(self.env.rank)["context"], mesh.context)

    def step(self) -> torch.Tensor:
        if self.device_mesh is not None and (self.spec.mesh.tensor > 1 or self.pipeline is not None):
            return self._mesh_step()
        return super().step()

    def forward_backward(self, inputs: list[dict], denominator: torch.Tensor, each: Any = None) -> torch.Tensor:
        if self.pipeline is None:
            return super().forward_backward(inputs, denominator, each)
        with self.forward_context():
            return self.pipeline.forward_backward(self.model, inputs, denominator, self.grad_divisor, self.comm_device)

    @property
    def eval_group(self) -> int:
        return self.pipeline.num_stages if self.pipeline is not None else 1

    def forward_only(self, inputs: list[dict]) -> torch.Tensor:
        if self.pipeline is None:
            return super().forward_only(inputs)
        with self.forward_context():
            return self.pipeline.forward_only(self.model, inputs, self.comm_device)

    def _mesh_step(self) -> torch.Tensor:
        """Clip and step where parameters are DTensors on two meshes (tensor-parallel weights on
        data_context x tensor, the rest on data_context), which torch's clip_grad_norm_ cannot stack."""
        from scaletune.strategies.tensor_parallel import grad_norm_and_clip

        assert self.optimizer is not None and self.model is not None and self.scaler is None
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.training.max_grad_norm
        if self.pipeline is not None:  # the norm over every stage
            norm = self.pipeline.clip(params, max_norm)
        else:
            norm = grad_norm_and_clip(params, max_norm if max_norm is not None else float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save_state(self, path: Path) -> None:
        if self.pipeline is None:
            return super().save_state(path)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer, options=self._state_options())
        self.pipeline.merge_param_groups(optim_sd)  # each stage names its own parameters only
        dcp.save({"model": self._checkpointed(model_sd), "optim": optim_sd}, checkpoint_id=str(path / "state"))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().state_shapes()
        return self.pipeline.state_shapes(shapes) if self.pipeline is not None else shapes

    def export(self, out_dir: Path) -> None:
        if self.pipeline is None:
            return super().export(out_dir)
        state = self.full_state_dict()
        with self.pipeline.whole(self.model) if self.env.is_main else contextlib.nullcontext():
            self._write_export(out_dir, state)

    def describe(self) -> str:
        text = super().describe()
        return text + (f"; device mesh {self.spec.mesh.describe()}" if self.device_mesh is not None else "")

    def make_scaler(self) -> Any:
        """fp16: FSDP's `ShardedGradScaler`, which all-reduces the overflow flag over the ranks' shards."""
        if self.compute_dtype != torch.float16:
            return None
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.env.device_type)

    def wrap(self, model: nn.Module) -> None:  # model: the CausalLMLoss; it becomes the FSDP root
        reshard = self.spec.config.distributed.reshard_after_forward
        if self.pipeline is not None:  # this rank's stage, the loss module's names kept
            model = self.pipeline.split(model)
        self._shard_and_fill(model, reshard_after_forward=reshard)
        self.module = self.model = model
        self.optimizer = self.build_optimizer(model)
        self._finish_wrap()

    def wrap_reference(self, model: nn.Module) -> nn.Module:
        """The frozen reference sharded like the policy (its mixed-precision and offload policies),
        every unit resharded after its forward, filled from rank 0 (`strategies/reference.py`)."""
        from scaletune.strategies.reference import freeze

        ref = freeze(model)
        self._shard_and_fill(ref, reshard_after_forward=True, no_backward=True)
        self.reference = ref
        return ref

    def _shard_and_fill(self, model: nn.Module, *, reshard_after_forward: bool, no_backward: bool = False) -> None:
        """Shard `model` (full on rank 0, on the meta device elsewhere) and fill every rank's shards
        and buffers from rank 0's weights.

        Raises:
            RuntimeError: no process group, or no decoder layer class to shard.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        from scaletune.models import decoder_layer_classes
        from scaletune.strategies.mesh import DATA_CONTEXT

        if not dist.is_initialized():
            raise RuntimeError("strategy fsdp needs a process group: start it with torchrun or num_processes")
        offload, reshard = self.spec.offload_params, reshard_after_forward
        loads = not self.load_meta()  # rank 0, or each pipeline stage's leader
        full_state = model.state_dict() if loads else {}
        # Non-persistent buffers (rotary inv_freq) are not in the state dict: keep rank 0's to broadcast.
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()} if loads else {}
        if loads:
            full_state = {k: v.detach() for k, v in full_state.items()}
            model.to("meta")
            _retie(model)

        kwargs: dict = {"reshard_after_forward": reshard, "no_backward": no_backward}
        if self.compute_dtype != torch.float32:
            # bf16/fp16 all-gathers and compute, fp32 gradient reduction and fp32 sharded master weights.
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.env.cuda_available)
        if self.device_mesh is not None:
            self._parallelize(model)
            kwargs["mesh"] = self.device_mesh[DATA_CONTEXT]
        layer_classes = tuple(decoder_layer_classes(model.causal_lm if self.pipeline is not None else model))
        layers = shard_model(model, layer_classes, **kwargs)
        self.log.info(
            f"fsdp: sharded {len(layers)} x {', '.join(c.__name__ for c in layer_classes)} and the root "
            f"over {self.env.world_size} ranks (reshard_after_forward={reshard}{', CPU offload' if offload else ''})"
        )

        model.to_empty(device="cpu" if offload else self.device)
        if offload:
            # FSDP2 offloads parameters only; buffers (rotary inv_freq) are used by the forward next to
            # the activations, so they live on the GPU (and their broadcast below is an NCCL one).
            for module in model.modules():
                for name, buf in module.named_buffers(recurse=False):
                    module._buffers[name] = buf.to(self.device)
        if self.pipeline is not None:
            self.pipeline.fill(model, full_state, buffers)
            return
        set_model_state_dict(
            model,
            full_state,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
        )
        del full_state
        broadcast_buffers(model, buffers)

    def _parallelize(self, model: nn.Module) -> None:
        """Tensor and context parallelism on the (meta-device) loss module, before FSDP2 shards it."""
        mesh, causal_lm = self.spec.mesh, model.causal_lm  # type: ignore[union-attr]
        if mesh.tensor > 1:
            from scaletune.strategies.tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(causal_lm, self.device_mesh["tensor"])
        if mesh.context > 1:
            from scaletune.strategies.context_parallel import install

            install(causal_lm, self.device_mesh["context"].get_group())

    @property
    def grad_divisor(self) -> float:
        # The reduce-scatter averages over the ranks FSDP2 shards over: data_shard x context.
        return float(self.env.world_size // (self.spec.mesh.tensor * self.spec.mesh.pipeline))

    def retarget(self, trainable: frozenset[str]) -> None:
        # FSDP2 re-reads requires_grad from each sharded parameter at every all-gather, but fixes a
        # unit's gradient dtypes at its lazy init from the parameters trainable then: a unit that was
        # all frozen would reduce a mixed-precision gradient in its low dtype. unshard() re-runs that
        # (idempotent) init; with float32 compute there are no other dtypes to fix.
        super().retarget(trainable)
        if self.compute_dtype != torch.float32:
            refresh_units(self.module)
