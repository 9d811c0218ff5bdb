"""Tensor, context and pipeline parallelism at world sizes 2 and 4, each layout against the single-process run of the same config (fp32, the same global batches): the loss
and gradient norm of every one of the 8 steps, the token count, the exported final/ model's logits,
the planner's bytes per rank, a checkpoint written with tensor 2 resumed with tensor 1 and one
written with pipeline 2 resumed with pipeline 1 and 2, and evaluation through the pipeline.

The single-process references are the parity runs of tests/distributed/test_parity.py (the same
`run_once` names and sections, trained once per session) and their packed twins here.

Every layout appears once; together the cases cover packed and unpacked rows, LoRA (with gradient
checkpointing) and full fine-tuning (the other cells of the 6 x 2 x 2 product: see MESH_CASES).

How they start: data 2 x tensor 2 (world size 4) and pipeline 2 through the user's command,
`scaletune train` with `num_processes` (re-executed under torchrun), tensor 2 under `torchrun -m
scaletune train`; the other four layouts' command lines one after another in the ranks of one
torchrun per world size (run_once: their subject is the layout's arithmetic and files)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.distributed.parity_cases import (
    LAYOUTS,
    MESH_CASES,
    USER_LAYOUTS,
    layout_name,
    resume_run,
    single_name,
)
from tests.helpers import (
    BUNDLED_ALPACA,
    GRAD_REL,
    assert_same_logits,
    assert_same_steps,
    logits,
    make_config,
    metrics,
    run_torchrun,
    steps,
    train,
)

pytestmark = pytest.mark.distributed

REL = 1e-4
STATES = ("params", "grads", "optimizer")
# (layout, method, packed): every layout of LAYOUTS (tensor 2 with full fine-tuning on unpacked rows
# is the torchrun test below, whose checkpoint the resume test reads), each of tensor, context and
# pipeline with both methods and both row kinds (parity_cases.MESH_CASES). The other cells of the
# 6 x 2 x 2 product add no code path of their own: the method and the row kind under each layout
# are held against one process per parameter by the drivers (tests/distributed/test_tensor_parallel.py:
# full and LoRA; test_context_parallel.py: padded and packed rows, with and without checkpointing;
# test_pipeline_parallel.py: pipeline 2 and pipeline 2 x data 2, full and LoRA, padded and packed).


def reference(run_once, method: str, packed: bool):
    """The single-process run (test_parity's for unpacked rows) of the same config."""
    name = single_name(method, packed)
    return run_once(name)[0]


def layout_run(run_once, layout: str, method: str, packed: bool):
    """The layout's run: through the plain command (re-executed under torchrun) for
    parity_cases.USER_LAYOUTS, else in run_once's torchrun of its world size."""
    name = layout_name(layout, method, packed)
    launcher = "scaletune" if (layout, method, packed) in USER_LAYOUTS else "batch"
    return run_once(name, launcher=launcher)


@pytest.mark.parametrize("layout, method, packed", MESH_CASES)
def test_layout_reproduces_the_single_process_run(layout, method, packed, run_once):
    run, proc = layout_run(run_once, layout, method, packed)
    ref = reference(run_once, method, packed)
    # FSDP sums the gradient norm in another order than one process (test_parity.py): GRAD_REL.
    assert_same_steps(run, ref, REL, f"{layout} {method} packed={packed} vs single process", grad_rel=GRAD_REL)
    assert [m["tokens"] for m in steps(run)] == [m["tokens"] for m in steps(ref)], "every token counted once"
    if packed:  # control: the rows really hold several examples (more tokens a step than unpacked rows)
        unpacked = reference(run_once, method, False)
        assert sum(m["tokens"] for m in steps(ref)) > 1.5 * sum(m["tokens"] for m in steps(unpacked))
    # The planner's bytes for this mesh (plan.json, from the model's shapes) equal what rank 0 holds
    # (with pipeline stages: the first stage's).
    planned = json.loads((run / "plan.json").read_text())["per_rank_bytes"]
    held = json.loads((run / "memory.json").read_text())["ranks"][0]
    assert {k: held[k] for k in STATES} == {k: planned[k] for k in STATES}, (held, planned)
    degrees = LAYOUTS[layout]
    world = degrees["num_processes"]
    assert f"world_size {world} = " in proc.stderr + proc.stdout  # pipeline first where there is one
    assert f"data_shard {world // 2}" in proc.stderr + proc.stdout
    assert "batch sizes count data-parallel ranks only" in proc.stderr + proc.stdout
    adapter = method == "lora"
    assert_same_logits(
        logits(run / "final", adapter=adapter), logits(ref / "final", adapter=adapter), f"{layout} final/"
    )


@pytest.fixture(scope="module")
def torchrun_tensor2(tiny_model_dir, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """`torchrun --nproc-per-node 2 -m scaletune train` with tensor 2 (as a cluster job starts it):
    full fine-tuning on unpacked rows, checkpoints at steps 4 and 8."""
    import yaml

    tmp = tmp_path_factory.mktemp("torchrun-tensor2")
    cfg = make_config(tiny_model_dir, tmp / "run", distributed={"strategy": "fsdp", "tensor_parallel": 2})
    cfg["distributed"].pop("num_processes")
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = run_torchrun("scaletune", "train", path, nproc=2, module=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / "run", proc


def test_tensor_two_under_torchrun(torchrun_tensor2, run_once):
    run, proc = torchrun_tensor2
    ref = reference(run_once, "full", False)
    assert_same_steps(run, ref, REL, "tensor 2 under torchrun", grad_rel=GRAD_REL)
    assert [m["tokens"] for m in steps(run)] == [m["tokens"] for m in steps(ref)]
    assert "world_size 2 = data_shard 1 x tensor 2" in proc.stderr + proc.stdout
    assert_same_logits(logits(run / "final"), logits(ref / "final"), "tensor 2 final/")


def test_tensor_two_checkpoint_resumes_with_tensor_one(torchrun_tensor2, run_once, tiny_model_dir, tmp_path):
    """The DCP checkpoint of step 4 written with tensor 2 resumes under fsdp at world size 1 (tensor
    1): steps 5-8 follow the single-process run within 1e-4 (norm within GRAD_REL)."""
    two, _ = torchrun_tensor2
    ref = reference(run_once, "full", False)
    one, proc = resume_run(
        tiny_model_dir, tmp_path, two / "checkpoints" / "step-4", {"strategy": "fsdp", "num_processes": 1}, "one"
    )
    assert "resharded step-4: written by 2 rank(s)" in proc.stderr
    assert_same_steps(one, ref, REL, "tensor 2 -> 1, steps 5-8", first=4, grad_rel=GRAD_REL)


@pytest.mark.parametrize("target", ["one", "pipeline2"])
def test_pipeline_two_checkpoint_resumes(target, run_once, tiny_model_dir, tmp_path):
    """The DCP checkpoint of step 4 written by 2 pipeline stages (each rank saved its own layers and
    optimizer state) resumes under fsdp at world size 1 (pipeline 1) and under pipeline 2 again:
    steps 5-8 follow the single-process run within 1e-4 (norm within GRAD_REL)."""
    two, _ = layout_run(run_once, "pipeline2", "full", False)
    ref = reference(run_once, "full", False)
    dist = {"strategy": "fsdp", **({"num_processes": 1} if target == "one" else LAYOUTS[target])}
    resumed, proc = resume_run(tiny_model_dir, tmp_path, two / "checkpoints" / "step-4", dist, target)
    # Another world size says it resharded; the same one that it resumed.
    said = "resharded step-4: written by 2 rank(s)" if target == "one" else "resumed from"
    assert said in proc.stderr
    assert_same_steps(resumed, ref, REL, f"pipeline 2 -> {target}, steps 5-8", first=4, grad_rel=GRAD_REL)


def test_pipeline_evaluation_matches_one_process(tiny_model_dir, tmp_path):
    """Evaluation under pipeline 2 (forwards of 2 micro-batches through both stages): 5 eval rows in
    micro-batches of 2 make 3 micro-batches, so the last group holds a filler that must score
    nothing. The eval loss after steps 1 and 2 equals the single-process run's within 1e-4."""
    evals = []
    for name, dist in (("one", {}), ("pipeline", {"strategy": "fsdp", **LAYOUTS["pipeline2"]})):
        cfg = make_config(
            tiny_model_dir,
            tmp_path / name,
            data={"eval": {"path": str(BUNDLED_ALPACA), "format": "alpaca", "max_samples": 5}},
            training={"max_steps": 2, "eval_every": 1, "save_every": 0},
            distributed=dist,
        )
        train(cfg, tmp_path, name=f"{name}.yaml")
        evals.append([m["eval_loss"] for m in metrics(tmp_path / name) if "eval_loss" in m])
    one, pipeline = evals
    assert len(one) == 2 and len(pipeline) == 2, evals
    assert all(abs(a - b) <= REL * abs(b) for a, b in zip(pipeline, one)), evals
