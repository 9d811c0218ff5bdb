"""The device mesh of a run and every fact of a rank's place on it (:class:`Parallelism`).

The mesh of a run with tensor, context or pipeline parallelism is torch's `DeviceMesh` over the
dimensions ``(pipeline, data_shard, context, tensor)`` (`resolve.spec.MESH_DIMS`, tensor innermost,
so the ranks of one tensor group are neighbours and on one node where it fits), plus the flattened
``data_context`` dimension: FSDP2 shards over it, and the step's target counts and losses are summed
over it (the ranks of one tensor group hold the same data and the same loss; the ranks of one
context group hold different slices of the same rows). This is torchtitan's layout
(`torchtitan/distributed/parallel_dims.py`, its ``dp_shard_cp`` dimension). Without those degrees
there is no `DeviceMesh`: FSDP2 shards over the whole world.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from scaletune.resolve.spec import MESH_DIMS, Mesh
from scaletune.strategies.parallel.context import split_batch

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


class Parallelism:
    """The one owner of this rank's mesh facts, built once (`FSDPStrategy.setup`) from the resolved
    degrees (`RunSpec.mesh`): the `DeviceMesh` and its groups, which ranks load the weights, the
    gradient divisor, this rank's context slice and the data ranks' sum. Nothing else derives them.

    Args:
        mesh: the decided degrees.
        rank: this rank in the world.
        world_size: ranks of the process group.
        device_type: ``"cuda"`` or ``"cpu"``.

    Raises:
        RuntimeError: see :func:`build_device_mesh` (a model-parallel mesh for another world size).
    """

    def __init__(self, mesh: Mesh, rank: int, world_size: int, device_type: str) -> None:
        self.mesh, self.rank, self.world_size = mesh, rank, world_size
        #: The `DeviceMesh` where some model-parallel degree is above 1, else None (FSDP2 shards over the world).
        self.device_mesh = build_device_mesh(mesh, device_type, world_size) if mesh.model_parallel else None

    @property
    def tensor(self) -> int:
        return self.mesh.tensor

    @property
    def context(self) -> int:
        return self.mesh.context

    @property
    def num_stages(self) -> int:
        """The pipeline degree."""
        return self.mesh.pipeline

    @property
    def stage_index(self) -> int:
        """This rank's pipeline stage (0 without a pipeline)."""
        return self.mesh.coordinates(self.rank)["pipeline"]

    def group(self, dim: str) -> Any:
        """The process group of this rank along `dim` (``pipeline``, ``context``, ``tensor``, :data:`DATA_CONTEXT`).

        Raises:
            AssertionError: no device mesh.
        """
        assert self.device_mesh is not None, f"no device mesh, so no {dim} group"
        return self.device_mesh[dim].get_group()

    @property
    def shard_mesh(self) -> Any:
        """The mesh FSDP2 shards over: the ``data_context`` dimension, or None (the whole world)."""
        return self.device_mesh[DATA_CONTEXT] if self.device_mesh is not None else None

    @property
    def data_group(self) -> Any:
        """The ranks that hold different data (``data_shard`` x ``context``): None, the world, without a mesh."""
        return self.device_mesh[DATA_CONTEXT].get_group() if self.device_mesh is not None else None

    @property
    def loads_weights(self) -> bool:
        """True for the rank that reads the weights on the CPU (every other builds the model on the meta
        device): global rank 0, or with pipeline stages each stage's *leader*, its data_shard, context and
        tensor coordinate 0 (`stages.fill_from_leaders` scatters from it)."""
        if self.num_stages == 1:
            return self.rank == 0
        c = self.mesh.coordinates(self.rank)
        return c["data_shard"] == 0 and c["context"] == 0 and c["tensor"] == 0

    @property
    def grad_divisor(self) -> float:
        """The reduce-scatter averages over the ranks FSDP2 shards over: data_shard x context."""
        return float(self.world_size // (self.mesh.tensor * self.mesh.pipeline))

    def split_batch(self, micro_batch: dict[str, Any]) -> dict[str, Any]:
        """With context parallelism: this rank's slice of every row (`context.split_batch`); else all of it."""
        if self.context == 1:
            return micro_batch
        return split_batch(micro_batch, self.mesh.coordinates(self.rank)["context"], self.context)

    def all_reduce_data(self, value: torch.Tensor, comm_device: torch.device) -> torch.Tensor:
        """Sum over the data_shard x context ranks (the world without a mesh): a tensor group's ranks hold
        the same rows and loss, a pipeline's stages the same rows. Moves to `comm_device`."""
        t = value.to(comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.data_group)
        return t

    def describe(self) -> str:
        """``; device mesh ...`` where there is one (appended to the strategy's line), else empty."""
        return f"; device mesh {self.mesh.describe()}" if self.device_mesh is not None else ""
