"""Curriculum: two stages on two data sets in one run, one step count, a checkpoint per stage end,
a schedule restarted per stage, and resume in the middle of stage 2; a schedule continued over both
stages, and resume from the end of stage 1."""

from __future__ import annotations

import json

import pytest

from tests.helpers import ALPACA_5000, LORA, assert_close, losses, make_config, metrics, train


@pytest.fixture()
def text_data(tmp_path):
    records = json.loads(ALPACA_5000.read_text())[1000:1100]
    path = tmp_path / "stage2.jsonl"
    path.write_text("".join(json.dumps({"text": f"{r['instruction']}\n{r['output']}"}) + "\n" for r in records))
    return path


def curriculum(tiny_model_dir, out, text_data, **training):
    cfg = make_config(
        tiny_model_dir, out, training={"max_steps": 3, "warmup_steps": 0, "save_every": 4, "keep_last": 3, **training}
    )
    cfg["stages"] = [
        {"name": "instructions"},
        {
            "name": "plain-text",
            "data": {"train": {"path": str(text_data), "format": "text"}, "max_seq_length": 64},
            "training": {"max_steps": 3, "learning_rate": 1.0e-3},
        },
    ]
    return cfg


def test_two_stages_then_resume_mid_stage_two(tiny_model_dir, tmp_path, text_data):
    run = tmp_path / "run"
    train(curriculum(tiny_model_dir, run, text_data), tmp_path)
    rows = [m for m in metrics(run) if "loss" in m]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5, 6]
    assert [m["stage"] for m in rows] == ["instructions"] * 3 + ["plain-text"] * 3
    lrs = [m["lr"] for m in rows]
    # Cosine per stage: 2e-3 falling over stage 1, restarting at stage 2's own peak 1e-3.
    assert lrs[0] == pytest.approx(2e-3) and lrs[2] < lrs[1] < lrs[0]
    assert lrs[3] == pytest.approx(1e-3) and lrs[5] < lrs[4] < lrs[3]
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step-3", "step-4", "step-6"]
    stage_end = json.loads((ckpts / "step-3" / "progress.json").read_text())
    assert stage_end["stage_name"] == "instructions" and stage_end["stage_complete"] is True
    mid = json.loads((ckpts / "step-4" / "progress.json").read_text())
    assert mid["stage_name"] == "plain-text" and mid["stage_step"] == 1 and not mid["stage_complete"]
    assert (ckpts / "latest").read_text().strip() == "step-6"

    resumed = tmp_path / "resumed"
    train(curriculum(tiny_model_dir, resumed, text_data, resume=str(ckpts / "step-4")), tmp_path, name="resumed.yaml")
    again = [m for m in metrics(resumed) if "loss" in m]
    assert [m["step"] for m in again] == [5, 6] and {m["stage"] for m in again} == {"plain-text"}
    assert_close(losses(resumed), losses(run)[4:], 1e-5, "resumed mid stage 2")
    assert [m["lr"] for m in again] == pytest.approx(lrs[4:])


def test_continue_schedule_spans_both_stages_and_resumes_from_the_stage_end(tiny_model_dir, tmp_path, text_data):
    """`continue_schedule: true`: one cosine over both stages' 6 steps, peaking at stage 1's lr.
    Resumed from stage 1's end checkpoint, stage 2 equals the uninterrupted run: its schedule goes on
    (not restarted at 0) and LoRA's dropout masks are drawn from the checkpoint's RNG."""
    cfg = curriculum(tiny_model_dir, tmp_path / "run", text_data, save_every=0)
    cfg["model"]["lora"] = {**LORA["lora"], "dropout": 0.3}  # dropout: the RNG matters after a resume
    cfg["stages"][1]["continue_schedule"] = True
    proc = train(cfg, tmp_path, expect_ok=False)  # stage 2 sets its own learning_rate: a contradiction
    assert proc.returncode == 2 and "stages[1] continues the running schedule" in proc.stderr
    del cfg["stages"][1]["training"]["learning_rate"]
    train(cfg, tmp_path)
    import math

    run = [m for m in metrics(tmp_path / "run") if "loss" in m]
    lrs = [m["lr"] for m in run]
    assert lrs == pytest.approx([2e-3 * 0.5 * (1 + math.cos(math.pi * s / 6)) for s in range(6)])
    stage_end = tmp_path / "run" / "checkpoints" / "step-3"
    assert json.loads((stage_end / "progress.json").read_text())["stage_complete"] is True

    cfg["output_dir"] = str(tmp_path / "resumed")
    cfg["training"]["resume"] = str(stage_end)
    proc = train(cfg, tmp_path, name="resumed.yaml")
    assert "resumed at the end of stage instructions (step 3): stage plain-text starts, its schedule continued" in (
        proc.stdout + proc.stderr
    )
    again = [m for m in metrics(tmp_path / "resumed") if "loss" in m]
    assert [m["step"] for m in again] == [4, 5, 6]
    assert [m["lr"] for m in again] == pytest.approx(lrs[3:], rel=1e-6)  # today's code: 0, warmup again
    # step 4's loss is computed before its update: only the dropout masks (the RNG) can move it
    assert_close([m["loss"] for m in again], [m["loss"] for m in run[3:]], 1e-5, "loss after a stage-end resume")
    assert_close(
        [m["grad_norm"] for m in again], [m["grad_norm"] for m in run[3:]], 1e-4, "grad norm after a stage-end resume"
    )
