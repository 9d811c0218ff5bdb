"""The chunked head under DeepSpeed ZeRO-3 with unequal target counts per rank.

ZeRO-3 gathers the head's weight in a collective at every call of the head, so ranks that called
it once per chunk (different numbers of chunks) would wait on each other forever; scaletune calls
a ZeRO-3 head once per rank. Here rank 0 has 21 targets (6 chunks of 4) and rank 1 has none: the
run must finish, and the loss and the head's gradient must equal plain cross-entropy over all 21
rows on one process.

Run directly by the test under torchrun (2 ranks, gloo, DeepSpeed's CPU accelerator).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
HIDDEN, VOCAB, CHUNK, N = 16, 50, 4, 21


def data():
    import torch

    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(N, HIDDEN, generator=g),
        torch.randint(0, VOCAB, (N,), generator=g),
        torch.randn(VOCAB, HIDDEN, generator=g),
    )


def driver(out: Path) -> None:
    import deepspeed
    import torch
    from torch import nn

    from scaletune.models.loss import chunked_head_cross_entropy
    from scaletune.strategies.deepspeed import skip_shared_memory_all_reduce

    # As scaletune's DeepSpeed strategy does on CPUs: no shared-memory all-reduce, which DeepSpeed's
    # communication layer otherwise compiles at start (about 2 CPU-min on a fresh machine, and every
    # other DeepSpeed test of the run waiting on its build lock).
    if not torch.cuda.is_available():
        skip_shared_memory_all_reduce()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    hidden, targets, weight = data()

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
            with torch.no_grad():
                self.head.weight.copy_(weight)

        def forward(self, h, y):
            return chunked_head_cross_entropy(h, self.head, y, chunk=CHUNK, partitioned=True)

    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
    }
    model = Head()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=ds_config
    )
    assert hasattr(engine.module.head.weight, "ds_id")  # really partitioned
    mine = slice(0, N) if rank == 0 else slice(0, 0)
    loss = engine(hidden[mine], targets[mine])
    engine.backward(loss)
    grad = deepspeed.utils.safe_get_full_grad(engine.module.head.weight)
    total = loss.detach().clone()
    torch.distributed.all_reduce(total)
    if rank == 0:
        out.write_text(json.dumps({"loss": float(total), "grad": grad.flatten().tolist()}))


@pytest.mark.distributed
def test_zero3_head_with_unequal_chunk_counts_does_not_hang(tmp_path):
    import torch
    import torch.nn.functional as F

    out = tmp_path / "result.json"
    from tests.helpers import run_torchrun

    proc = run_torchrun(HERE, out)
    assert proc.returncode == 0, proc.stderr[-6000:]
    got = json.loads(out.read_text())

    hidden, targets, weight = data()
    w = weight.clone().requires_grad_(True)
    want = F.cross_entropy(hidden @ w.t(), targets, reduction="sum")
    want.backward()
    assert abs(got["loss"] - want.item()) <= 1e-5 * abs(want.item())
    # DeepSpeed averages gradients over the 2 data-parallel ranks.
    grad = torch.tensor(got["grad"]).view(VOCAB, HIDDEN) * 2
    assert float((grad - w.grad).abs().max()) <= 1e-5 * float(w.grad.abs().max())


if __name__ == "__main__":
    driver(Path(sys.argv[1]))
