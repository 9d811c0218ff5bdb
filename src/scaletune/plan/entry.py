"""One entry of a plan: a strategy's (or a device mesh's) bytes per rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

GiB = 1024**3


@dataclass
class StrategyPlan:
    """One strategy's bytes per rank (rank 0, which holds the largest shard).

    `per_rank_bytes` = device memory: params, grads, optimizer (with DeepSpeed's fp32 master
    partition), activations (as configured: with or without checkpointing), reference (the frozen
    reference model of preference training, `plan/reference_model.py`), kv_cache (online RL's
    generation, `plan/rollout.py`: alive before the step's forward, so the larger of it and the
    activations counts), total (the states, the reference, that larger one and `margin`).
    Offloaded state is in `host_bytes` instead.
    """

    name: str
    params: int
    grads: int
    optimizer: int
    activations: int
    margin: int
    fits: bool | None
    activations_no_ckpt: int = 0
    activations_ckpt: int = 0
    host_bytes: int = 0
    scaletune: dict = field(default_factory=dict)  # {"strategy": ..., zero_stage / offload overrides}
    reference: int = 0
    kv_cache: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        working = max(self.activations, self.kv_cache)
        return self.params + self.grads + self.optimizer + working + self.reference + self.margin

    @property
    def per_rank_bytes(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "reference": self.reference,
            "kv_cache": self.kv_cache,
            "total": self.total,
        }

    def to_json(self) -> dict:
        return {"name": self.name, "per_rank_bytes": self.per_rank_bytes, "fits": self.fits}


def assemble(
    name: str,
    spec: Any,
    *,
    params: int,
    grads: int,
    optimizer: int,
    act_ckpt: int,
    act_full: int,
    margin: int,
    scaletune: dict,
    host_bytes: int = 0,
) -> StrategyPlan:
    """THE assembly of one entry (a strategy's or a mesh's): the activations as the run is configured
    (`model.gradient_checkpointing`), and the working margin plus 10% of the rest for allocator
    fragmentation and temporaries. `fits` is left to the caller, which knows the device memory."""
    act = act_ckpt if spec.config.model.gradient_checkpointing else act_full
    margin += (params + grads + optimizer + act) // 10
    return StrategyPlan(
        name=name,
        params=params,
        grads=grads,
        optimizer=optimizer,
        activations=act,
        margin=margin,
        fits=None,
        activations_no_ckpt=act_full,
        activations_ckpt=act_ckpt,
        host_bytes=host_bytes,
        scaletune=scaletune,
    )
