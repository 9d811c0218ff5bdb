"""The run configurations the distributed tier's parity, resume, export and mesh tests share (and
the GPU tier's NCCL mesh test): the single-process reference, the engines at world size 2, the mesh
layouts, and `resume_run`. `run_once` (tests/distributed/conftest.py) trains each name once per
session, so the tests that share a name must pass the same sections: these."""

from __future__ import annotations

from tests.helpers import make_config, train

SINGLE = {"strategy": "single", "num_processes": 1}

STRATEGIES = {
    "single": SINGLE,
    "ddp": {"strategy": "ddp", "num_processes": 2},
    "fsdp": {"strategy": "fsdp", "num_processes": 2},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2, "num_processes": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3, "num_processes": 2},
}

# Rows of 128 tokens hold several Alpaca examples (at the base 64 most rows would hold one, truncated).
PACKED = {"packing": True, "max_seq_length": 128}
LAYOUTS = {
    "tensor2": {"tensor_parallel": 2, "num_processes": 2},
    "context2": {"context_parallel": 2, "num_processes": 2},
    "data2-tensor2": {"tensor_parallel": 2, "num_processes": 4},
    "data2-context2": {"context_parallel": 2, "num_processes": 4},
    # 2 stages of the tiny model's 2 layers; 4 micro-batches a step (global 8, micro 2, data 1) >= 2 stages.
    "pipeline2": {"pipeline_parallel": 2, "num_processes": 2},
    # 2 micro-batches a step per data rank; the two data ranks' rows differ in length (one padded shape).
    "data2-pipeline2": {"pipeline_parallel": 2, "num_processes": 4},
}


def resume_run(tiny_model_dir, tmp_path, checkpoint, dist: dict, name: str = "resumed", model=None, **training):
    cfg = make_config(
        tiny_model_dir,
        tmp_path / name,
        model=model or {},
        distributed=dist,
        training={"resume": str(checkpoint), **training},
    )
    proc = train(cfg, tmp_path, name=f"{name}.yaml")
    return tmp_path / name, proc
