"""How a parallelized model runs its steps: :class:`StepRunner` (every rank runs its module on its
micro-batches one after another, `Strategy`'s loop), :class:`TensorStepRunner` (the same, the norm
taken over parameters on two meshes) and :class:`PipelineStepRunner` (the stages run a 1F1B schedule
over all of a step's micro-batches). `FSDPStrategy` delegates to the one :func:`step_runner` picks:
the forward and backward of a step and of evaluation, the gradient norm and clipping of the step,
what a checkpoint and the export gather.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletune.strategies.base import Strategy
from scaletune.strategies.parallel.mesh import DATA_CONTEXT, Parallelism
from scaletune.strategies.parallel.pipeline import PipelineRunner, pipeline_clip_grad_norm_
from scaletune.strategies.parallel.stages import whole
from scaletune.strategies.parallel.tensor import grad_norm_and_clip

__all__ = ["PipelineStepRunner", "StepRunner", "TensorStepRunner", "gather_full_state", "step_runner"]


def step_runner(host: Strategy, parallelism: Parallelism) -> StepRunner:
    """The runner of `parallelism`'s layout for the strategy `host` (its model, precision, devices)."""
    if parallelism.num_stages > 1:
        return PipelineStepRunner(host, parallelism)
    if parallelism.tensor > 1:
        return TensorStepRunner(host, parallelism)
    return StepRunner(host, parallelism)


def gather_full_state(module: nn.Module, is_main: bool) -> dict[str, torch.Tensor] | None:
    """The whole weights of an FSDP2-sharded `module` on rank 0 (CPU), None elsewhere. A collective:
    every rank gathers, only rank 0 keeps the result; under param_cast these are the fp32 masters,
    whole on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if is_main else None


class StepRunner:
    """Every rank runs the whole (sharded) module on each of its micro-batches: `Strategy`'s loop.

    Args:
        host: the strategy whose model, precision and devices the steps use.
        parallelism: this rank's mesh facts.
    """

    def __init__(self, host: Strategy, parallelism: Parallelism) -> None:
        self.host, self.parallelism = host, parallelism

    @property
    def eval_group(self) -> int:
        """Micro-batches per `forward_only` call in evaluation."""
        return 1

    def forward_backward(self, inputs: list[dict], denominator: torch.Tensor, each: Any = None) -> torch.Tensor:
        """`Strategy.forward_backward`: micro-batch after micro-batch."""
        return Strategy.forward_backward(self.host, inputs, denominator, each)

    def forward_only(self, inputs: list[dict]) -> torch.Tensor:
        """`Strategy.forward_only`: the summed loss of `inputs`."""
        return Strategy.forward_only(self.host, inputs)

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """The total gradient norm before clipping, the gradients scaled to at most `max_norm` (inf:
        measured only): torch's `clip_grad_norm_` (DTensor gradients on one mesh)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def merge_param_groups(self, optim_sd: dict[str, Any]) -> None:
        """The optimizer state dict as every rank must hold it for DCP (here: as it is)."""

    def state_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """The shapes a checkpoint holds, from this rank's (here: the same)."""
        return shapes

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on rank 0 (CPU), None elsewhere (a collective)."""
        return gather_full_state(module, self.host.env.is_main)

    def whole(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """`module` as the export saves it (here: as it is)."""
        return contextlib.nullcontext()


class TensorStepRunner(StepRunner):
    """Tensor parallelism: parameters are DTensors on two meshes (tensor-parallel weights on
    data_context x tensor, the rest on data_context), which torch's clip_grad_norm_ cannot stack."""

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """`tensor.grad_norm_and_clip`: the norm per mesh, made whole, combined."""
        assert self.host.scaler is None
        return grad_norm_and_clip(params, max_norm)


class PipelineStepRunner(StepRunner):
    """This rank's pipeline stage (`parallelize` split it) and its 1F1B schedules, one per number of
    micro-batches (`pipeline.PipelineRunner`); the losses, norms and state gathered over the stages."""

    def __init__(self, host: Strategy, parallelism: Parallelism) -> None:
        super().__init__(host, parallelism)
        self.stage_index, self.num_stages = parallelism.stage_index, parallelism.num_stages
        self.group = parallelism.group("pipeline")
        self.data_group = parallelism.group(DATA_CONTEXT)
        self._runners: dict[tuple[int, float], PipelineRunner] = {}

    @property
    def eval_group(self) -> int:
        return self.num_stages

    def _runner(self, n: int, grad_divisor: float) -> PipelineRunner:
        # Keyed by the divisor too: evaluation (divisor 1) may ask first for the micro-batch count
        # training uses (an eval before the first step, as many stages as micro-batches), and
        # training must not reuse its runner (gradients off by the data x context degree).
        key = (n, grad_divisor)
        if key not in self._runners:
            self._runners[key] = PipelineRunner(
                self.host.model, self.stage_index, self.num_stages, self.group, self.host.device, n, grad_divisor
            )
        return self._runners[key]

    def _everywhere(self, loss: torch.Tensor) -> torch.Tensor:
        # The last stage's loss on every stage (0 on the others before the sum).
        loss = loss.to(self.host.comm_device)
        dist.all_reduce(loss, group=self.group)
        return loss.to(self.host.device)

    def _same_shape(self, inputs: list[dict]) -> list[dict]:
        """Pad the first micro-batch to the largest rows and length of any micro-batch on any rank of
        the data group (padding: token 0, label -100, mask 0, position 0, as `PipelineRunner` pads).
        The runner rebuilds its stage (running a forward, FSDP2 all-gathers included) when the shape
        changes: every rank of a data group must change at the same steps, or their FSDP2
        collectives go out of step."""
        local = [max(x["input_ids"].size(0) for x in inputs), max(x["input_ids"].size(1) for x in inputs)]
        shape = torch.tensor(local, dtype=torch.int64, device=self.host.comm_device)
        dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=self.data_group)
        rows, length = (int(v) for v in shape.tolist())
        if [rows, length] == local:
            return inputs
        fill = {"input_ids": 0, "labels": -100, "attention_mask": 0, "position_ids": 0}
        first = dict(inputs[0])
        for key, value in fill.items():
            t = first.get(key)
            if t is not None:
                out = t.new_full((rows, length), value)
                out[: t.size(0), : t.size(1)] = t
                first[key] = out
        return [first, *inputs[1:]]

    def forward_backward(self, inputs: list[dict], denominator: torch.Tensor, each: Any = None) -> torch.Tensor:
        """1F1B over this rank's micro-batches; returns their summed divided loss on every stage."""
        with self.host.forward_context():
            inputs = self._same_shape(inputs)
            loss = self._runner(len(inputs), self.host.grad_divisor).step(inputs, denominator)
            return self._everywhere(loss)

    def forward_only(self, inputs: list[dict]) -> torch.Tensor:
        """The summed token loss of `inputs` (at least `num_stages`), the same on every stage."""
        with self.host.forward_context():
            inputs = self._same_shape(inputs)
            loss = self._runner(len(inputs), 1.0).forward_only(inputs)
            return self._everywhere(loss)

    def clip(self, params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip by the gradient norm over every stage; returns it (before clipping)."""
        assert self.host.scaler is None
        return pipeline_clip_grad_norm_(params, max_norm, self.group)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on global rank 0 (CPU), None elsewhere: each stage gathers its own
        (FSDP2 all-gathers over its data group), the stages' leaders send theirs to rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        is_main = self.host.env.is_main
        # cpu_offload=True would keep the result on global rank 0 only: gather, then move.
        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        state = {k: v.detach().cpu() for k, v in state.items()}
        if dist.get_rank(self.data_group) != 0:
            return None
        parts: list[Any] = [None] * self.num_stages if is_main else None  # type: ignore[assignment]
        dist.gather_object(state, parts, group=self.group, group_dst=0)
        if not is_main:
            return None
        return {k: v for part in parts for k, v in part.items()}

    def merge_param_groups(self, optim_sd: dict[str, Any]) -> None:
        """Make each param group's ``params`` (parameter names) the union over the stages, in place.

        DCP writes a non-tensor value under one key once, from whichever rank its deduplication
        picks, so every rank must hold the same list; the loader then finds each of its parameters'
        group by name (`set_optimizer_state_dict`), with any pipeline degree."""
        groups = optim_sd["param_groups"]
        parts: list[Any] = [None] * self.num_stages
        dist.all_gather_object(parts, [list(g["params"]) for g in groups], group=self.group)
        if any(len(part) != len(groups) for part in parts):
            raise RuntimeError("pipeline stages have different numbers of optimizer param groups")
        for i, group in enumerate(groups):
            group["params"] = [name for part in parts for name in part[i]]

    def state_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Every stage's tensor shapes merged (a checkpoint holds them all)."""
        parts: list[Any] = [None] * self.num_stages
        dist.all_gather_object(parts, shapes, group=self.group)
        return {k: v for part in parts for k, v in part.items()}

    def whole(self, module: nn.Module) -> contextlib.AbstractContextManager:
        """On rank 0 (which writes the export): the stage with every module of the unsplit model (`stages.whole`)."""
        return whole(module) if self.host.env.is_main else contextlib.nullcontext()
