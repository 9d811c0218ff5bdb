"""Scale by simulation: the run's meta model sharded by THE FSDP2 sharding function
(`strategies.parallel.parallelize.shard_model`) over PyTorch's fake process group of W ranks, in this one
process; rank 0's shard bytes are what the planner's fsdp entry predicts."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec


def simulate_fsdp(spec: RunSpec, world_size: int) -> dict:
    """Shard the run's meta model with FSDP2 over a fake process group of `world_size` ranks and
    report rank 0's shard bytes (parameters as scaletune stores them).

    Returns:
        {"world_size", "params_bytes" (rank 0's local shards), "full_bytes", "tensors", "seconds"}.

    Raises:
        RuntimeError: a process group already exists in this process.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from scaletune.models import decoder_layer_classes
    from scaletune.plan.shapes import meta_model
    from scaletune.strategies.parallel.parallelize import shard_model

    t0 = time.perf_counter()
    if dist.is_initialized():
        raise RuntimeError("simulate_fsdp needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        model = meta_model(spec)
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        mesh = init_device_mesh("cpu", (world_size,))
        shard_model(model, tuple(decoder_layer_classes(model)), mesh=mesh)
        local = [p.to_local() for p in model.parameters()]
        shard = sum(t.numel() * t.element_size() for t in local)
        return {
            "world_size": world_size,
            "params_bytes": int(shard),
            "full_bytes": int(full),
            "tensors": len(local),
            "seconds": round(time.perf_counter() - t0, 2),
        }
    finally:
        dist.destroy_process_group()
