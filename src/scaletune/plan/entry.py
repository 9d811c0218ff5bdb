"""One entry of a plan: a strategy's (or a device mesh's) bytes per rank."""

from __future__ import annotations

from dataclasses import dataclass, field

GiB = 1024**3


@dataclass
class StrategyPlan:
    """One strategy's bytes per rank (rank 0, which holds the largest shard).

    `per_rank_bytes` = device memory: params, grads, optimizer (with DeepSpeed's fp32 master
    partition), activations (as configured: with or without checkpointing), reference (the frozen
    reference model of preference training, `plan/reference.py`), total (the five plus `margin`).
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

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.reference + self.margin

    @property
    def per_rank_bytes(self) -> dict[str, int]:
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "reference": self.reference,
            "total": self.total,
        }

    def to_json(self) -> dict:
        return {"name": self.name, "per_rank_bytes": self.per_rank_bytes, "fits": self.fits}
