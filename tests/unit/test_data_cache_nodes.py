"""The tokenised-data cache across ranks and nodes (issue 20): the turns in which ranks build a
stage's data (global rank 0, then each other node's first rank, then the rest). One writer per
cache entry when processes sharing a cache miss it together starts processes: it is in
tests/distributed/test_data_cache_nodes.py."""

from __future__ import annotations

import pytest

from scaletune.env import DistributedEnv
from scaletune.trainer.stages import build_turn


def _env(rank: int, world: int, per_node: int) -> DistributedEnv:
    return DistributedEnv(
        "torchrun", rank=rank, local_rank=rank % per_node, world_size=world, local_world_size=per_node
    )


@pytest.mark.parametrize(
    "world, per_node, want",
    [
        (1, 1, [(0, 2)]),
        (4, 4, [(0, 2), (1, 2), (1, 2), (1, 2)]),  # one node: rank 0, then the rest
        (4, 2, [(0, 3), (2, 3), (1, 3), (2, 3)]),  # two nodes: node 1's first rank (rank 2) in turn 1
        (6, 2, [(0, 3), (2, 3), (1, 3), (2, 3), (1, 3), (2, 3)]),
    ],
)
def test_build_turns(world, per_node, want):
    assert [build_turn(_env(r, world, per_node)) for r in range(world)] == want
