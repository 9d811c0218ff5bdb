"""The run configurations the distributed tier's parity, resume, export and mesh tests share (and
the GPU tier's NCCL mesh test): the single-process reference, the engines at world size 2, the mesh
layouts, and `resume_run`. `run_once` (tests/distributed/conftest.py) trains each name once per
session, so the tests that share a name must pass the same sections: these."""

from __future__ import annotations

from tests.helpers import LORA, make_config, train

SINGLE = {"strategy": "single", "num_processes": 1}

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


# test_parity.py's engines at world size 2 on the full fine-tune, and with LoRA and checkpointing.
FULL_CASES = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp"},
    "fsdp-offload": {"strategy": "fsdp", "offload_params": True},
    "zero1": {"strategy": "deepspeed", "zero_stage": 1},
    "zero2": {"strategy": "deepspeed", "zero_stage": 2},
    "zero3": {"strategy": "deepspeed", "zero_stage": 3},
    "zero2-offload-optimizer": {"strategy": "deepspeed", "zero_stage": 2, "offload_optimizer": True},
    "zero3-offload-params": {
        "strategy": "deepspeed",
        "zero_stage": 3,
        "offload_params": True,
        "offload_optimizer": True,
    },
}
LORA_CASES = {"ddp-lora-gc": {"strategy": "ddp"}, "fsdp-lora-gc": {"strategy": "fsdp"}}
# The engines test_resume.py resumes: the single process, and those full-fine-tune runs at world size 2.
STRATEGIES = {"single": SINGLE, **{k: {**FULL_CASES[k], "num_processes": 2} for k in ("ddp", "fsdp", "zero2", "zero3")}}
# (layout, method, packed) of test_mesh_parity.py; the two in USER_LAYOUTS start through the plain
# command (`scaletune train ... num_processes=N`, re-executed under torchrun), one at each world size.
MESH_CASES = [
    ("context2", "full", True),
    ("data2-tensor2", "lora", True),
    ("data2-context2", "lora", False),
    ("pipeline2", "full", False),
    ("pipeline2", "lora", True),
    ("data2-pipeline2", "full", True),
]
USER_LAYOUTS = {("data2-tensor2", "lora", True), ("pipeline2", "full", False)}


def single_name(method: str, packed: bool = False) -> str:
    """The run_once name of the single-process reference of `method` ("full" or "lora")."""
    return {"full": "single", "lora": "single-lora"}[method] + ("-packed" if packed else "")


def layout_name(layout: str, method: str, packed: bool) -> str:
    return f"{layout}-{method}{'-packed' if packed else ''}"


def _method(method: str) -> dict:
    return {"model": LORA} if method == "lora" else {}


def _packed(packed: bool) -> dict:
    return {"data": PACKED} if packed else {}


# Every run `run_once` trains by name, with its sections: the runs of one world size that are not
# started as users start them train one after another in the ranks of one torchrun
# (tests/helpers.py train_batch), all of them when the first is asked for.
SHARED_RUNS: dict[str, dict] = {
    **{
        single_name(m, p): {**_method(m), "distributed": SINGLE, **_packed(p)}
        for m in ("full", "lora")
        for p in (False, True)
    },
    "single-lora-lr0": {"model": LORA, "distributed": SINGLE, "training": {"learning_rate": 0.0}},
    **{case: {"distributed": {**d, "num_processes": 2}} for case, d in FULL_CASES.items()},
    **{case: {"model": LORA, "distributed": {**d, "num_processes": 2}} for case, d in LORA_CASES.items()},
    **{
        layout_name(*case): {
            **_method(case[1]),
            "distributed": {"strategy": "fsdp", **LAYOUTS[case[0]]},
            **_packed(case[2]),
        }
        for case in MESH_CASES
    },
}

STARTED_AS_USERS_DO = {layout_name(*case) for case in USER_LAYOUTS}


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
