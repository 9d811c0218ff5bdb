"""`parallelize`: THE composition of the device mesh's degrees on a loaded model, torchtitan's
`parallelize` (`torchtitan/models/llama3/infra/parallelize.py`), and `shard_model`, THE FSDP2 sharding.

Loading is memory-efficient: the loading rank(s) (`mesh.Parallelism.loads_weights`: rank 0, or each
pipeline stage's leader) read the weights on the CPU, every other rank builds the architecture on
the meta device (no storage); after sharding, the loading rank sends each tensor and every rank
keeps only its shard (`set_model_state_dict(..., broadcast_from_rank0=True)`, as torchtune does, or
`stages.fill_from_leaders`). No other rank ever holds a full copy.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from scaletune.models.introspection import decoder_layer_classes
from scaletune.strategies.parallel.context import install
from scaletune.strategies.parallel.mesh import Parallelism
from scaletune.strategies.parallel.stages import fill_from_leaders, split_into_stage
from scaletune.strategies.parallel.tensor import apply_tensor_parallel
from scaletune.strategies.process_group import broadcast_buffers

log = logging.getLogger(__name__)


def shard_model(
    model: nn.Module,
    layer_classes: tuple[type, ...],
    *,
    reshard_after_forward: bool = True,
    no_backward: bool = False,
    **fully_shard_kwargs: Any,
) -> list[nn.Module]:
    """THE FSDP2 sharding: `fully_shard` every instance of `layer_classes` (the decoder layers), then
    the root, with the same keyword arguments (mesh, mp_policy, offload_policy). Used by
    :func:`parallelize` and by the planner's fake-world simulation.

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
    register_generate(model)
    return layers


def register_generate(root: nn.Module) -> None:
    """Run the FSDP2 root unit's hooks around `root.generate` (the rollout engine's,
    `models.loss.CausalLMLoss.generate`), as around its forward: the root holds the embeddings and
    the head, which generation reads outside any forward of the root (nothing for a module without
    `generate`)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if hasattr(root, "generate"):
        register_fsdp_forward_method(root, "generate")


def retie(model: nn.Module) -> None:
    """`to("meta")` gives each module a new Parameter, so a tied head and its embeddings come apart
    on rank 0 while the ranks built on the meta device keep them tied (and FSDP2 would shard two
    tensors there, one elsewhere): tie them again, on the outermost Hugging Face model."""
    from transformers import PreTrainedModel

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is not None:
        hf.tie_weights()


def parallelize(
    model: nn.Module,
    parallelism: Parallelism,
    device: torch.device,
    *,
    reshard_after_forward: bool,
    no_backward: bool = False,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """This rank's part of `model`, every degree of `parallelism` applied, filled from the loading rank(s).

    In order: the pipeline split (this rank's stage, `stages.split_into_stage`; the other stages'
    modules to the meta device), the loading rank's weights taken aside and the model moved to the
    meta device, tensor parallelism (`tensor.apply_tensor_parallel`), context parallelism
    (`context.install`), FSDP2 sharding over the data ranks (:func:`shard_model`), storage on
    `device`, and the fill. torchtitan splits the pipeline first too and parallelizes each stage;
    the resolved mesh never combines a pipeline with tensor or context parallelism.

    Args:
        model: the loss module (`loss.CausalLMLoss`), or a frozen reference (`reference.FrozenReference`,
            `no_backward`, never on a model-parallel mesh: preference objectives refuse one); full on
            the loading rank(s), on the meta device elsewhere.
        parallelism: this rank's mesh facts.
        device: where this rank computes.
        reshard_after_forward, no_backward: see :func:`shard_model`.
        fully_shard_kwargs: FSDP2's own facts: ``mp_policy``, ``offload_policy`` (parameters then
            materialise on the CPU; buffers stay on `device`).

    Returns:
        The module this rank runs: `model` itself, or its `pipeline.PipelineStageModule`.

    Raises:
        RuntimeError: no decoder layer class to shard; ValueError: see the degrees' functions.
    """
    if parallelism.num_stages > 1:  # this rank's stage, the loss module's names kept
        model = split_into_stage(model, parallelism.stage_index, parallelism.num_stages)
    loads = parallelism.loads_weights
    full_state = model.state_dict() if loads else {}
    # Non-persistent buffers (rotary inv_freq) are not in the state dict: keep the loader's to broadcast.
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()} if loads else {}
    if loads:
        full_state = {k: v.detach() for k, v in full_state.items()}
        model.to("meta")
        retie(model)
    if parallelism.tensor > 1:
        apply_tensor_parallel(model.causal_lm, parallelism.device_mesh["tensor"])  # type: ignore[union-attr,index]
    if parallelism.context > 1:
        install(model.causal_lm, parallelism.group("context"))  # type: ignore[union-attr]
    if parallelism.shard_mesh is not None:
        fully_shard_kwargs["mesh"] = parallelism.shard_mesh
    _shard_and_place(model, parallelism, device, reshard_after_forward, no_backward, fully_shard_kwargs)
    if parallelism.num_stages > 1:
        fill_from_leaders(model, full_state, buffers, parallelism.data_group, device)
        return model
    fill_from_rank0(model, full_state, buffers)
    return model


def _shard_and_place(
    model: nn.Module,
    parallelism: Parallelism,
    device: torch.device,
    reshard_after_forward: bool,
    no_backward: bool,
    fully_shard_kwargs: dict[str, Any],
) -> None:
    """:func:`shard_model` (the stage's decoder layers under a pipeline), then storage: on `device`,
    or on the CPU with an offload policy (buffers on `device` all the same)."""
    offload = fully_shard_kwargs.get("offload_policy") is not None
    layer_classes = tuple(decoder_layer_classes(model.causal_lm if parallelism.num_stages > 1 else model))
    layers = shard_model(
        model, layer_classes, reshard_after_forward=reshard_after_forward, no_backward=no_backward, **fully_shard_kwargs
    )
    log.info(
        f"fsdp: sharded {len(layers)} x {', '.join(c.__name__ for c in layer_classes)} and the root "
        f"over {parallelism.world_size} ranks (reshard_after_forward={reshard_after_forward}"
        f"{', CPU offload' if offload else ''})"
    )
    model.to_empty(device="cpu" if offload else device)
    if offload:
        # FSDP2 offloads parameters only; buffers (rotary inv_freq) are used by the forward next to
        # the activations, so they live on the GPU (and their broadcast below is an NCCL one).
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)


def fill_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    """Every rank's shards and buffers of the sharded `model` from rank 0's `full_state` / `buffers`
    (empty elsewhere). `full_state` is emptied: rank 0's full copy goes before the buffers' broadcast."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(
        model,
        full_state,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
    full_state.clear()
    broadcast_buffers(model, buffers)
