"""This rank's pipeline stage cut out of the loaded model, filled from its leader, and the unsplit
model put back together for the export: the pipeline's part of `parallelize.parallelize` and of
`runner.PipelineStepRunner`'s export.

The run's model is split into stages on the device mesh's ``pipeline`` dimension
(`pipeline.split_stage`), each stage FSDP2-sharded over its ``data_context`` ranks, its steps run by
`pipeline.PipelineRunner` (1F1B) under `runner.PipelineStepRunner`.

Loading: the first rank of each stage's data group (its ``data_context`` coordinate 0, the stage's
*leader*, `mesh.Parallelism.loads_weights`) reads the whole model on the CPU and keeps its stage's
weights; the other ranks build the model on the meta device. After sharding, each parameter's shards
are scattered from the leader over the data group (`distribute_tensor` with ``src_data_rank=0``) and
the buffers broadcast from it, as `set_model_state_dict(broadcast_from_rank0=True)` does from global
rank 0 without a pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from scaletune.models.introspection import unwrap
from scaletune.strategies.parallel.pipeline import PipelineStageModule, head_name, split_stage
from scaletune.strategies.process_group import broadcast_buffers

__all__ = ["fill_from_leaders", "split_into_stage", "whole"]


def split_into_stage(loss_module: nn.Module, stage_index: int, num_stages: int) -> PipelineStageModule:
    """This rank's `PipelineStageModule` of a `loss.CausalLMLoss` (its chunk kept), names unchanged.
    The modules other stages run move to the meta device (no storage); the stage keeps them all in
    `unsplit` for :func:`whole`."""
    base = unwrap(loss_module.causal_lm)
    decoder, head = base.get_decoder(), head_name(base)
    unsplit = {"layers": decoder.layers, "embed_tokens": decoder.embed_tokens, "norm": decoder.norm}
    unsplit[head] = base.get_output_embeddings()
    stage = split_stage(loss_module.causal_lm, stage_index, num_stages, chunk=loss_module.chunk)
    kept = {id(m) for m in stage.modules()}
    for module in [*unsplit["layers"], *(m for k, m in unsplit.items() if k != "layers")]:
        if id(module) not in kept:
            module.to("meta")
    stage.unsplit = unsplit
    return stage


@contextlib.contextmanager
def whole(stage: nn.Module) -> Iterator[None]:
    """The stage's model with every module of the unsplit model (the other stages' on the meta
    device), for `save_pretrained`: peft saves the adapter weights of the modules it finds."""
    base = unwrap(stage.causal_lm)
    decoder = base.get_decoder()
    split = {"layers": decoder.layers, "embed_tokens": decoder.embed_tokens, "norm": decoder.norm}
    unsplit = stage.unsplit
    head = next(k for k in unsplit if k not in split)
    split[head] = getattr(base, head)
    owners = {"layers": decoder, "embed_tokens": decoder, "norm": decoder, head: base}
    try:
        for name, module in unsplit.items():
            setattr(owners[name], name, module)
        yield
    finally:
        for name, module in split.items():
            setattr(owners[name], name, module)


@torch.no_grad()
def fill_from_leaders(
    model: nn.Module,
    full_state: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    data_group: Any,
    device: torch.device,
) -> None:
    """Fill the sharded stage from its leader's `full_state` / `buffers` (empty on other ranks), over
    the stage's data group; `device`: where the stage computes."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    leader = dist.get_rank(data_group) == 0
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        mesh = p.device_mesh
        where = device if mesh.device_type != "cpu" else torch.device("cpu")
        full = full_state[name].to(where, p.dtype) if leader else torch.empty(p.shape, dtype=p.dtype, device=where)
        p.to_local().copy_(distribute_tensor(full, mesh, p.placements, src_data_rank=0).to_local())
    broadcast_buffers(model, buffers, data_group)
