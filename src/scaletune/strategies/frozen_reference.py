"""The frozen reference model of preference training (`training.preference.reference: model`,
issue 24), made resident the way each engine keeps the policy, so it costs what the planner says
(`plan/reference_model.py`) and no more:

* single / ddp: the whole model on the rank's device, outside DDP (nothing to all-reduce);
* fsdp: sharded by THE FSDP2 sharding function with the policy's mixed-precision and offload
  policies, every unit resharded after its forward (the root too: no backward would ever reshard
  it), filled from rank 0 as the policy is (`parallel.parallelize.parallelize`);
* DeepSpeed ZeRO-3: partitioned by `deepspeed.initialize` without an optimizer (as TRL's
  `trl.models.utils.prepare_deepspeed` does for its reference model), the config from THE generator
  less its training-only blocks; ZeRO-1/2: the whole model on the device, its parameters cast to the
  compute dtype as DeepSpeed casts the policy's.

Every engine: `requires_grad` False, eval mode, no optimizer, no gradient hook. What the engines
wrap is a :class:`FrozenReference` around the causal LM: the loss calls the reference's decoder and
head itself (`objectives.logprobs.sequence_logps(causal_lm, ...)`), and a sharded engine gathers a
module's parameters only inside a forward that enters through its root (FSDP2's root unit holds the
embeddings, final norm and head; ZeRO-3 restarts its fetch trace at the root). So the whole reference
pass is one call, `reference(sequence_logps, input_ids, labels, ...)`, under `torch.no_grad()`
inside the policy's forward, the same number of times on every rank.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

__all__ = [
    "FrozenReference",
    "cast_parameters",
    "freeze",
    "reference_ds_config",
    "reference_tensors",
    "resident_whole",
]


class FrozenReference(nn.Module):
    """The root the engines wrap around the frozen reference causal LM.

    `forward(fn, *args, **kwargs)` returns `fn(self.causal_lm, *args, **kwargs)`: whatever the loss
    computes from the reference (its decoder, then its head in chunks) runs inside this one forward,
    where FSDP2 has gathered the root's parameters and ZeRO-3's hooks fetch each module's.
    """

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        # The decoder blocks FSDP2 shards one unit each (`models.decoder_layer_classes` reads it).
        self._no_split_modules = getattr(causal_lm, "_no_split_modules", None)

    def forward(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return fn(self.causal_lm, *args, **kwargs)


def freeze(model: nn.Module) -> FrozenReference:
    """`model` in a :class:`FrozenReference` (unless it is one), no parameter requiring a gradient,
    in eval mode (no dropout)."""
    ref = model if isinstance(model, FrozenReference) else FrozenReference(model)
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref.eval()


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters to `dtype`, buffers as they are: what DeepSpeed does to the policy's module
    (`DeepSpeedEngine._cast_module_mixed_precision` without a `buffer_dtype`)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def resident_whole(model: nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> FrozenReference:
    """The whole frozen model (:func:`freeze`) on `device` (single, ddp, ZeRO-1/2), its parameters cast
    to `dtype` if given.

    Raises:
        RuntimeError: the model is on the meta device (only sharding engines load it there).
    """
    if any(p.is_meta for p in model.parameters()):
        raise RuntimeError("the reference model was built on the meta device, but this engine keeps it whole")
    ref = freeze(model)
    if dtype is not None:
        cast_parameters(ref, dtype)
    # A single process's device_map (`model.device_map: auto`) spreads it as it spreads the policy.
    return ref if getattr(ref.causal_lm, "hf_device_map", None) else ref.to(device)


def reference_ds_config(engine_config: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config of the reference's ZeRO-3 engine: the policy's (THE generator's, merged
    with the user's JSON) less what only an optimizer uses (optimizer, scheduler, optimizer
    offload: DeepSpeed would build a CPU Adam or a schedule with nothing to step), as TRL's
    `prepare_deepspeed` drops them. Parameter offload stays: the reference's partitions live
    where the policy's do."""
    cfg = copy.deepcopy(engine_config)
    cfg.pop("optimizer", None)
    cfg.pop("scheduler", None)
    cfg.get("zero_optimization", {}).pop("offload_optimizer", None)
    return cfg


def reference_tensors(model: nn.Module | None) -> list[Any]:
    """The parameter tensors of the reference this rank holds: its parameters (DTensor shards count
    their local part) and ZeRO-3's partitions (`ds_tensor`); `memory.count_bytes` counts each storage once."""
    if model is None:
        return []
    params = list(model.parameters())
    return params + [getattr(p, "ds_tensor", None) for p in params]
