"""trainer/position.py and the throughput window: the position a checkpoint records, checked
against the control of an uninterrupted run (the batch a resumed run starts with is the one the
uninterrupted run takes next), the epoch fraction, and tokens per second over a window."""

from __future__ import annotations

import pytest
import torch

from scaletune.checkpoint import Progress
from scaletune.resolve import BatchArithmetic
from scaletune.trainer.metrics import ThroughputWindow
from scaletune.trainer.position import Position
from tests.helpers import make_env

ROWS, GLOBAL, MICRO = 20, 4, 2  # 5 steps per epoch, 2 micro-batches per step on one rank
BATCH = BatchArithmetic(GLOBAL, MICRO, 1, GLOBAL // MICRO, 8)


def batches(first_epoch: int = 0, first_step: int = 0):
    """The real loader and global batches of a stage over rows 0..19 (each row: its index)."""
    from scaletune.data import global_batches, make_loader

    data = [{"i": i} for i in range(ROWS)]
    loader, sampler = make_loader(data, lambda rows: torch.tensor([r["i"] for r in rows]), BATCH, make_env(), 7, 0)
    return global_batches(loader, sampler, BATCH, ROWS // GLOBAL, first_epoch, first_step)


def rows_of(micro: list) -> list[int]:
    return [int(i) for mb in micro for i in mb]


def save_at(position: Position, *, complete: bool = False) -> Progress:
    return position.progress(
        stage_index=1,
        stage_name="b",
        steps_per_epoch=ROWS // GLOBAL,
        global_batch_size=GLOBAL,
        world_size=1,
        strategy="single",
        checkpoint_format="dcp",
        stage_complete=complete,
    )


@pytest.mark.parametrize("saved_after", [1, 4, 5, 6, 10, 12])
def test_a_resumed_run_continues_with_the_next_batch(saved_after):
    """Saved after `saved_after` steps (mid-epoch, at an epoch's end, in the second and third epoch):
    the resumed loader yields exactly the batches the uninterrupted run takes next."""
    position = Position(step=100)  # steps of earlier stages
    uninterrupted = batches()
    for _ in range(saved_after):
        epoch, i, _micro = next(uninterrupted)
        position.advance(epoch, i)
    progress = save_at(position)
    assert (progress.step, progress.stage_step) == (100 + saved_after, saved_after)
    assert progress.sample_offset == progress.step_in_epoch * GLOBAL

    resumed = Position(step=progress.step)
    resumed.enter_stage(progress)
    assert resumed.stage_step == saved_after
    continued = batches(progress.epoch, progress.step_in_epoch)
    for _ in range(6):
        (e0, i0, a), (e1, i1, b) = next(uninterrupted), next(continued)
        assert (e0, i0, rows_of(a)) == (e1, i1, rows_of(b))
        position.advance(e0, i0)
        resumed.advance(e1, i1)
        assert resumed == position


def test_the_epoch_fraction_counts_steps_done():
    position = Position()
    assert position.next_start(5) == (0, 0)
    position.advance(0, 0)
    assert position.epochs(5) == 0.2 and position.next_start(5) == (0, 1)
    position.advance(0, 4)
    assert position.epochs(5) == 1.0 and position.next_start(5) == (1, 0)
    position.advance(1, 0)
    assert position.epochs(3) == pytest.approx(1.3333) and position.next_start(3) == (1, 1)


def test_entering_a_stage_starts_its_count_again():
    position = Position(step=7, stage_step=7, epoch=1, done_in_epoch=2)
    position.enter_stage()
    assert position == Position(step=7)


def test_the_throughput_window_restarts_at_each_close():
    now = [10.0]
    window = ThroughputWindow(clock=lambda: now[0])
    window.add(300)
    window.add(100)
    assert window.close(12.0) == 200.0  # 400 tokens in 2 s
    window.add(50)
    assert window.close(12.5) == 100.0  # only the tokens since the last close
    assert window.close(12.5) == 0.0


class _HostReads(torch.Tensor):
    """A tensor that counts reads back to the host (what waits for a GPU)."""

    reads = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__float__, torch.Tensor.__int__, torch.Tensor.item, torch.Tensor.tolist):
            cls.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_throughput_window_sums_device_counts_and_reads_once():
    """The loop adds each step's global token count as the tensor the step left on the device;
    the window reads it back once, when the step is logged (issue 20: no per-step host sync)."""
    clock = iter([0.0, 4.0]).__next__
    window = ThroughputWindow(clock)
    counts = [torch.tensor(t, dtype=torch.float64).as_subclass(_HostReads) for t in (1000.0, 1500.0, 1500.5)]
    _HostReads.reads = 0
    for c in counts:
        window.add(c)
    assert _HostReads.reads == 0
    assert window.close(clock()) == (1000.0 + 1500.0 + 1500.5) / 4.0
    assert _HostReads.reads == 1
    window.add(7.0)  # plain numbers still work
    assert window.close(6.0) == 7.0 / 2.0
