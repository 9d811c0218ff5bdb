"""The device mesh of a run with tensor or context parallelism: torch's `DeviceMesh` over the
dimensions ``(pipeline, data_shard, context, tensor)`` (`resolve.spec.MESH_DIMS`, tensor innermost,
so the ranks of one tensor group are neighbours and on one node where it fits), plus the flattened
``data_context`` dimension: FSDP2 shards over it, and the step's target counts and losses are summed
over it (the ranks of one tensor group hold the same data and the same loss; the ranks of one
context group hold different slices of the same rows). This is torchtitan's layout
(`torchtitan/distributed/parallel_dims.py`, its ``dp_shard_cp`` dimension).
"""

from __future__ import annotations

from typing import Any

from scaletune.resolve.spec import MESH_DIMS, Mesh

DATA_CONTEXT = "data_context"


def build_device_mesh(mesh: Mesh, device_type: str, world_size: int) -> Any:
    """The `DeviceMesh` of `mesh`'s degrees over the initialised process group.

    Args:
        mesh: the decided degrees (`RunSpec.mesh`).
        device_type: ``"cuda"`` or ``"cpu"``.
        world_size: ranks of the process group.

    Raises:
        RuntimeError: the job has another number of ranks than the mesh was decided for.
    """
    from torch.distributed.device_mesh import init_device_mesh

    if mesh.world_size != world_size:
        raise RuntimeError(
            f"the device mesh ({mesh.describe()}) was decided for {mesh.world_size} ranks but the job has {world_size}"
        )
    device_mesh = init_device_mesh(device_type, mesh.shape, mesh_dim_names=MESH_DIMS)
    device_mesh["data_shard", "context"]._flatten(DATA_CONTEXT)  # torchtitan's dp_shard_cp
    return device_mesh
