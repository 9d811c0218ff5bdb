"""Pipeline parallelism inside `FSDPStrategy`: the run's model split into stages on the device mesh's
``pipeline`` dimension (`pipeline_parallel.split_stage`), each stage FSDP2-sharded over its
``data_context`` ranks, steps run by `pipeline_parallel.PipelineRunner` (1F1B).

Loading: the first rank of each stage's data group (its ``data_context`` coordinate 0, the stage's
*leader*) reads the whole model on the CPU and keeps its stage's weights; the other ranks build the
model on the meta device. After sharding, each parameter's shards are scattered from the leader over
the data group (`distribute_tensor` with ``src_data_rank=0``) and the buffers broadcast from it, as
`set_model_state_dict(broadcast_from_rank0=True)` does from global rank 0 without a pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletune.models.introspection import unwrap
from scaletune.strategies.mesh import DATA_CONTEXT
from scaletune.strategies.pipeline_parallel import (
    PipelineRunner,
    head_name,
    pipeline_clip_grad_norm_,
    split_stage,
)
from scaletune.strategies.process_group import broadcast_buffers

__all__ = ["PipelineEngine", "is_stage_leader"]


def is_stage_leader(mesh: Any, rank: int) -> bool:
    """True for the rank that loads its stage's weights: data_shard, context and tensor coordinate 0."""
    c = mesh.coordinates(rank)
    return c["data_shard"] == 0 and c["context"] == 0 and c["tensor"] == 0


class PipelineEngine:
    """This rank's stage and its schedule.

    Args:
        device_mesh: the run's `DeviceMesh` (`strategies/mesh.py`), pipeline degree > 1.
        device: where the stage computes.
    """

    def __init__(self, device_mesh: Any, device: torch.device) -> None:
        pp = device_mesh["pipeline"]
        self.stage_index, self.num_stages = pp.get_local_rank(), pp.size()
        self.group = pp.get_group()
        self.data_group = device_mesh[DATA_CONTEXT].get_group()
        self.device = device
        self._runners: dict[int, PipelineRunner] = {}
        self._whole: dict[str, Any] = {}

    def split(self, loss_module: nn.Module) -> nn.Module:
        """This rank's `PipelineStageModule` of a `loss.CausalLMLoss` (its chunk kept), names unchanged.
        The modules other stages run move to the meta device (no storage), kept for :meth:`whole`."""
        base = unwrap(loss_module.causal_lm)
        decoder, head = base.get_decoder(), head_name(base)
        whole = {"layers": decoder.layers, "embed_tokens": decoder.embed_tokens, "norm": decoder.norm}
        whole[head] = base.get_output_embeddings()
        stage = split_stage(loss_module.causal_lm, self.stage_index, self.num_stages, chunk=loss_module.chunk)
        kept = {id(m) for m in stage.modules()}
        for module in [*whole["layers"], *(m for k, m in whole.items() if k != "layers")]:
            if id(module) not in kept:
                module.to("meta")
        self._whole = whole
        return stage

    @contextlib.contextmanager
    def whole(self, stage: nn.Module) -> Iterator[None]:
        """The stage's model with every module of the unsplit model (the other stages' on the meta
        device), for `save_pretrained`: peft saves the adapter weights of the modules it finds."""
        base = unwrap(stage.causal_lm)
        decoder = base.get_decoder()
        split = {"layers": decoder.layers, "embed_tokens": decoder.embed_tokens, "norm": decoder.norm}
        head = next(k for k in self._whole if k not in split)
        split[head] = getattr(base, head)
        owners = {"layers": decoder, "embed_tokens": decoder, "norm": decoder, head: base}
        try:
            for name, module in self._whole.items():
                setattr(owners[name], name, module)
            yield
        finally:
            for name, module in split.items():
                setattr(owners[name], name, module)

    @torch.no_grad()
    def fill(self, model: nn.Module, full_state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        """Fill the sharded stage from its leader's `full_state` / `buffers` (empty on other ranks)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        leader = dist.get_rank(self.data_group) == 0
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            mesh = p.device_mesh
            where = self.device if mesh.device_type != "cpu" else torch.device("cpu")
            full = full_state[name].to(where, p.dtype) if leader else torch.empty(p.shape, dtype=p.dtype, device=where)
            p.to_local().copy_(distribute_tensor(full, mesh, p.placements, src_data_rank=0).to_local())
        broadcast_buffers(model, buffers, self.data_group)

    def _runner(self, module: nn.Module, n: int, grad_divisor: float) -> PipelineRunner:
        if n not in self._runners:
            self._runners[n] = PipelineRunner(
                module, self.stage_index, self.num_stages, self.group, self.device, n, grad_divisor
            )
        return self._runners[n]

    def _everywhere(self, loss: torch.Tensor, comm_device: torch.device) -> torch.Tensor:
        # The last stage's loss on every stage (0 on the others before the sum).
        loss = loss.to(comm_device)
        dist.all_reduce(loss, group=self.group)
        return loss.to(self.device)

    def _same_shape(self, inputs: list[dict], comm_device: torch.device) -> list[dict]:
        """Pad the first micro-batch to the largest rows and length of any micro-batch on any rank of
        the data group (padding: token 0, label -100, mask 0, position 0, as `PipelineRunner` pads).
        The runner rebuilds its stage (running a forward, FSDP2 all-gathers included) when the shape
        changes: every rank of a data group must change at the same steps, or their FSDP2
        collectives go out of step."""
        local = [max(x["input_ids"].size(0) for x in inputs), max(x["input_ids"].size(1) for x in inputs)]
        shape = torch.tensor(local, dtype=torch.int64, device=comm_device)
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

    def forward_backward(
        self, module: nn.Module, inputs: list[dict], denominator: torch.Tensor, grad_divisor: float, comm: torch.device
    ) -> torch.Tensor:
        """1F1B over this rank's micro-batches; returns their summed divided loss on every stage."""
        inputs = self._same_shape(inputs, comm)
        loss = self._runner(module, len(inputs), grad_divisor).step(inputs, denominator)
        return self._everywhere(loss, comm)

    def forward_only(self, module: nn.Module, inputs: list[dict], comm: torch.device) -> torch.Tensor:
        """The summed token loss of `inputs` (at least `num_stages`), the same on every stage."""
        inputs = self._same_shape(inputs, comm)
        loss = self._runner(module, len(inputs), 1.0).forward_only(inputs)
        return self._everywhere(loss, comm)

    def clip(self, params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
        """Clip by the gradient norm over every stage; returns it (before clipping)."""
        return pipeline_clip_grad_norm_(params, max_norm if max_norm is not None else float("inf"), self.group)

    def full_state_dict(self, module: nn.Module, is_main: bool) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on global rank 0 (CPU), None elsewhere: each stage gathers its own
        (FSDP2 all-gathers over its data group), the stages' leaders send theirs to rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

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
