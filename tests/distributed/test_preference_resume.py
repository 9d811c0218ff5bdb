"""SFT then DPO in one run (issue 24): two stages, one step count, resumable anywhere. The DPO stage's
reference is the model SFT left (`reference: precomputed`, scored when the stage begins); a run
resumed from a checkpoint inside the DPO stage reads that table and continues within 1e-5 of the
uninterrupted run, on 2 ranks and resharded onto 1; without the table it refuses to resume (exit 2) rather than score a moved model.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import ALPACA_5000, assert_same_steps, make_config, metrics, steps, train

pytestmark = pytest.mark.distributed


def _config(tiny_model_dir, out, pairs, **training):
    stages = [
        {"name": "sft", "training": {"objective": "sft", "max_steps": 2}},
        {
            "name": "dpo",
            "training": {"objective": "dpo", "max_steps": 4, "learning_rate": 1e-3},
            "data": {"train": {"path": str(pairs), "format": "preference"}},
        },
    ]
    return make_config(
        tiny_model_dir,
        out,
        stages=stages,
        training={"save_every": 4, "warmup_steps": 0, **training},
        distributed={"strategy": "ddp", "num_processes": 2},
    )


def test_sft_then_dpo_resumes_inside_the_dpo_stage(tiny_model_dir, tmp_path):
    records = json.loads(ALPACA_5000.read_text())[200:232]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(
        "\n".join(
            json.dumps({"prompt": r["instruction"], "chosen": r["output"], "rejected": records[(i + 5) % 32]["output"]})
            for i, r in enumerate(records)
        )
        + "\n"
    )
    full = tmp_path / "full"
    train(_config(tiny_model_dir, full, pairs), tmp_path, name="full.yaml")
    lines = steps(full)
    assert [(m["step"], m["stage"]) for m in lines] == [
        (1, "sft"),
        (2, "sft"),
        (3, "dpo"),
        (4, "dpo"),
        (5, "dpo"),
        (6, "dpo"),
    ]
    assert "reward_accuracy" not in lines[1] and "reward_accuracy" in lines[2]
    # The DPO stage's reference is the model after SFT: its first step has zero margin (loss log 2).
    assert lines[2]["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert (full / "reference" / "stage-1.safetensors").is_file()

    ckpt = full / "checkpoints" / "step-4"
    resumed = tmp_path / "resumed"
    train(_config(tiny_model_dir, resumed, pairs, resume=str(ckpt)), tmp_path, name="resumed.yaml")
    assert [m["step"] for m in steps(resumed)] == [5, 6]
    assert_same_steps(resumed, full, 1e-5, "steps 5-6 resumed inside the DPO stage", first=4)
    for key in ("reward_accuracy", "reward_margin", "logp_chosen"):
        assert [m[key] for m in steps(resumed)] == pytest.approx([m[key] for m in lines[4:]], rel=1e-5, abs=1e-6)

    # Resharded: the same checkpoint continues on one process (2 -> 1 ranks) as the 2-rank run did.
    single = tmp_path / "single"
    cfg = _config(tiny_model_dir, single, pairs, resume=str(ckpt))
    cfg["distributed"] = {"strategy": "single", "num_processes": 1}
    train(cfg, tmp_path, name="single.yaml")
    assert_same_steps(single, full, 1e-4, "steps 5-6 resumed on one process", first=4)

    # Without the table the stage cannot be rescored from the moved model: a clear refusal, exit 2.
    shutil.rmtree(full / "reference")
    again = tmp_path / "again"
    # One process: under torchrun the ranks exit 2 but torchrun itself reports 1 (ChildFailedError).
    cfg = _config(tiny_model_dir, again, pairs, resume=str(ckpt))
    cfg["distributed"] = {"strategy": "single", "num_processes": 1}
    proc = train(cfg, tmp_path, name="again.yaml", expect_ok=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "stage-1.safetensors is missing" in proc.stderr and "cannot be recomputed" in proc.stderr
    assert not (again / "metrics.jsonl").exists() or not [m for m in metrics(again) if m.get("step", 0) > 4]
