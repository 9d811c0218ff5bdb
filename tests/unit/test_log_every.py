"""`training.log_every`: between logged steps the loop reads nothing from the device and asks
NVML nothing (issue 38); on logged steps every value is in metrics.jsonl.

A real in-process run of the tiny model (`Trainer.fit`, single strategy, CPU) with three spies:
- the step's values (loss, gradient norm, token count, the fp16 skip flag) are handed to the loop
  as a tensor subclass that records the step at which the host reads them or anything computed from
  them (`item`, `tolist`, `float()`...): on a GPU each such read waits for the device;
- the peak device memory read (`torch.cuda.max_memory_allocated` through the loop's
  `peak_device_bytes`) and NVML's utilisation (`torch.cuda.utilization`) record their step too; they
  answer as a GPU would, so their values reach the metrics on the CPU;
- in fp16, `GradScaler.get_scale` (a read of the scale to the host) records its step.
"""

from __future__ import annotations

import json
import math
from typing import ClassVar

import pytest
import torch

from tests.helpers import make_config, make_env

#: Tensor methods that copy a value to the host (each a device sync on a GPU).
HOST_READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"}
PEAK, UTIL = 3 * 2**20, 42  # what the pretended GPU answers


class Watched(torch.Tensor):
    """A step's value on the "device": any host read of it, or of a tensor computed from it (torch
    keeps the subclass through operations), is recorded with the step the loop is at."""

    reads: ClassVar[list[tuple[int, str]]] = []
    step: ClassVar = staticmethod(lambda: -1)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            cls.reads.append((cls.step(), name))
        return super().__torch_function__(func, types, args, kwargs or {})


def watched(value):
    return value.as_subclass(Watched) if torch.is_tensor(value) else value


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_nothing_is_read_between_log_steps(tiny_model_dir, tmp_path, monkeypatch, dtype):
    from scaletune.resolve import resolve
    from scaletune.run.rundir import opened
    from scaletune.trainer import loop
    from scaletune.trainer.step import StepResult

    cfg = make_config(
        tiny_model_dir,
        tmp_path / "run",
        as_config=True,
        model={"dtype": dtype},
        training={"max_steps": 5, "log_every": 2, "save_every": 0, "global_batch_size": 4, "warmup_steps": 0},
    )
    trainer = loop.Trainer(resolve(cfg, make_env()), open_run_dir=opened)
    at: dict[str, list[int]] = {"peak": [], "nvml": [], "get_scale": []}

    def now() -> int:
        return trainer.position.step

    real_step = loop.train_step

    def step_on_the_device(*args, **kwargs):
        r = real_step(*args, **kwargs)
        return StepResult(*(watched(v) for v in (r.loss, r.grad_norm, r.tokens, r.skipped, r.stats)))

    def peak(devices):
        at["peak"].append(now())
        return PEAK

    def utilization(device=None):
        at["nvml"].append(now())
        return UTIL

    real_get_scale = torch.amp.GradScaler.get_scale

    def get_scale(self):
        at["get_scale"].append(now())
        return real_get_scale(self)

    Watched.reads, Watched.step = [], staticmethod(now)
    monkeypatch.setattr(loop, "train_step", step_on_the_device)
    monkeypatch.setattr(loop, "peak_device_bytes", peak)
    monkeypatch.setattr(torch.cuda, "utilization", utilization)
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", get_scale)
    trainer.fit()

    logged = [2, 4, 5]  # every log_every steps, and the last
    assert sorted({step for step, _ in Watched.reads}) == logged, Watched.reads
    assert at["peak"] == at["nvml"] == logged
    assert all(step in logged for step in at["get_scale"]), at["get_scale"]
    assert (trainer.strategy.scaler is not None) == (dtype == "float16")  # the fp16 skip decision ran

    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == logged
    for r in steps:
        assert math.isfinite(r["loss"]) and r["tokens"] > 0 and r["tokens_per_s"] > 0
        assert r["memory_bytes"] == [PEAK] and r["gpu_util"] == [UTIL] and r["memory_of"] == "device peak"
        # fp16: a step the scaler skipped is logged as such, and only such a step has an infinite norm.
        assert r.get("skipped", False) == (not math.isfinite(r["grad_norm"]))
