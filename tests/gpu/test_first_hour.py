"""What the GPU tier had never touched (issue 38's first GPU hour): a step without host syncs, bf16
parameter copies against autocast, one DPO and one GRPO run, and a resume from a GPU checkpoint on
the GPU and on the CPU. Each compares with a control, never with its own output:

- syncs: torch's own `set_sync_debug_mode` inside every training step after the first;
- `bf16_params`: the same run under autocast (bf16's rounding apart);
- DPO: the loss before any update is ln 2 and the reward margin 0 (policy = reference);
- GRPO: the `replay` engine fed the `hf` run's own completions gives the same losses;
- resume: the run that was not interrupted.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import ALPACA_5000, REPO_ROOT, assert_close, make_config, metrics, steps, train

BF16 = {"dtype": "bfloat16"}
PAIRS = REPO_ROOT / "examples" / "data" / "alpaca_pairs.jsonl"


def test_unpacked_steps_do_not_synchronize(tiny_llama_dir, tmp_path, monkeypatch):
    """Unpacked right-padded rows in bf16 on one GPU: from the second step on (the first creates
    Adam's state), `train_step` runs under `torch.cuda.set_sync_debug_mode("warn")` and no
    synchronizing CUDA call is made, transformers' packed-rows check included (`causal_sdpa`); the
    control is a `.item()` inside the same mode, which warns."""
    from scaletune.env import DistributedEnv
    from scaletune.resolve import resolve
    from scaletune.run.rundir import opened
    from scaletune.trainer import loop

    cfg = make_config(
        tiny_llama_dir,
        tmp_path / "run",
        as_config=True,
        model=BF16,
        training={"max_steps": 5, "log_every": 5, "save_every": 0, "warmup_steps": 0},
    )
    trainer = loop.Trainer(resolve(cfg, DistributedEnv.from_environ()), open_run_dir=opened)
    assert trainer.strategy.device.type == "cuda"
    syncs: list[tuple[int, str]] = []
    real_step = loop.train_step

    def watched_step(*args, **kwargs):
        if trainer.position.step < 1:
            return real_step(*args, **kwargs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                result = real_step(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # torch warns from C++ at the Python line that called into it: that line is the sync's place.
        syncs.extend(
            (trainer.position.step, f"{w.filename}:{w.lineno}")
            for w in caught
            if "called a synchronizing CUDA operation" in str(w.message)
        )
        return result

    monkeypatch.setattr(loop, "train_step", watched_step)
    trainer.fit()
    assert [m["step"] for m in steps(tmp_path / "run")] == [5]
    # Before `models.attention.causal_sdpa`, transformers' `find_packed_sequence_indices` synced once
    # per forward here (`(packed_sequence_mask[:, -1] == 0).all()`, seen on an H200 with 5.17, line
    # 755): a model that makes its own position_ids still asked whether they were packed.
    assert syncs == [], syncs

    with warnings.catch_warnings(record=True) as control:  # the mode is live here: a read warns
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            torch.ones(1, device="cuda").item()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert any("called a synchronizing CUDA operation" in str(w.message) for w in control)


def test_bf16_params_match_autocast(tiny_llama_dir, tmp_path):
    runs = {}
    for mode in ("autocast", "bf16_params"):
        cfg = make_config(
            tiny_llama_dir, tmp_path / mode / "run", model={**BF16, "mixed_precision": mode}, training={"save_every": 0}
        )
        (tmp_path / mode).mkdir()
        train(cfg, tmp_path / mode)
        runs[mode] = [m for m in metrics(tmp_path / mode / "run") if "loss" in m]
    loss = {k: [m["loss"] for m in v] for k, v in runs.items()}
    assert loss["autocast"][-1] < loss["autocast"][0] - 0.3
    assert_close(loss["bf16_params"], loss["autocast"], 3e-2, "bf16_params vs autocast (bf16)")


def test_dpo_starts_at_ln2_and_trains(tiny_llama_dir, tmp_path):
    """LoRA DPO against the base (bf16): before the first update policy = reference, so the loss is
    ln 2 and the reward margin 0 exactly up to bf16's rounding of two equal forward passes."""
    cfg = make_config(
        tiny_llama_dir,
        tmp_path / "run",
        model={**BF16, "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "auto"}},
        data={"train": {"path": str(PAIRS), "format": "preference", "max_samples": 64}, "max_seq_length": 128},
        training={
            "objective": "dpo",
            "preference": {"beta": 0.1, "reference": "base"},
            "max_steps": 6,
            "save_every": 0,
            "learning_rate": 5e-3,
        },
    )
    train(cfg, tmp_path)
    rows = [m for m in metrics(tmp_path / "run") if "loss" in m]
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-3), rows[0]
    assert abs(rows[0]["reward_margin"]) < 1e-3, rows[0]
    assert rows[-1]["reward_margin"] > rows[0]["reward_margin"], rows


def _prompt_file(folder: Path) -> Path:
    records = [r for r in json.loads(ALPACA_5000.read_text()) if not r["input"] and len(r["instruction"]) < 90]
    path = folder / "prompts.jsonl"
    rows = [{"prompt": r["instruction"], "answer": r["output"].split()[0]} for r in records[:8]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_grpo_samples_on_the_gpu_and_replay_reproduces_it(tiny_llama_dir, tmp_path):
    """The `hf` engine generates on the GPU (bf16 autocast, 4 completions per prompt); one process
    replaying its rollouts.jsonl computes the same losses (the control: the same completions
    through the same loss, bf16's rounding apart)."""
    rl = {
        "num_generations": 4,
        "max_new_tokens": 8,
        "beta": 0.04,
        "rewards": [
            {"function": "scaletune.rewards:exact_answer"},
            {"function": "scaletune.rewards:length_penalty", "weight": 0.5, "kwargs": {"max_chars": 40}},
        ],
    }
    prompts = _prompt_file(tmp_path)
    runs = {}
    for name, extra in (
        ("hf", {}),
        ("replay", {"engine": "replay", "replay": str(tmp_path / "hf/run/rollouts.jsonl")}),
    ):
        cfg = make_config(
            tiny_llama_dir,
            tmp_path / name / "run",
            model=BF16,
            data={"train": {"path": str(prompts), "format": "prompt"}},
            training={
                "objective": "grpo",
                "global_batch_size": 4,
                "micro_batch_size": 1,
                "max_steps": 2,
                "save_every": 0,
                "rl": {**rl, **extra},
            },
        )
        (tmp_path / name).mkdir()
        train(cfg, tmp_path / name)
        runs[name] = [m for m in metrics(tmp_path / name / "run") if "loss" in m]
    rollouts = [json.loads(line) for line in (tmp_path / "hf/run/rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 4 * 4 and all(r["completion"] is not None for r in rollouts)
    assert all(math.isfinite(m["loss"]) and "reward" in m for m in runs["hf"]), runs["hf"]
    assert_close([m["loss"] for m in runs["replay"]], [m["loss"] for m in runs["hf"]], 2e-2, "GRPO replay vs hf")


def test_a_gpu_checkpoint_resumes_on_the_gpu_and_on_the_cpu(tiny_model_dir, tmp_path):
    """fp32 (TF32 off: `model.dtype: float32` asks for IEEE fp32): 6 steps with a checkpoint at step
    3, resumed from it on the GPU and, with no GPU visible, on the CPU; steps 4-6 as the run that was
    not interrupted."""
    cfg = make_config(tiny_model_dir, tmp_path / "full", training={"max_steps": 6, "save_every": 3})
    train(cfg, tmp_path)
    want = [m for m in metrics(tmp_path / "full") if "loss" in m][3:]
    checkpoint = tmp_path / "full" / "checkpoints" / "step-3"
    assert checkpoint.is_dir()
    for where, env in (("gpu", {}), ("cpu", {"CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"})):
        again = {**cfg, "output_dir": str(tmp_path / where), "training": {**cfg["training"], "resume": str(checkpoint)}}
        train(again, tmp_path, name=f"{where}.yaml", env=env)
        got = [m for m in metrics(tmp_path / where) if "loss" in m]
        assert [m["step"] for m in got] == [4, 5, 6]
        assert_close([m["loss"] for m in got], [m["loss"] for m in want], 1e-4, f"loss after resume on the {where}")
        assert_close(
            [m["grad_norm"] for m in got],
            [m["grad_norm"] for m in want],
            1e-3,
            f"grad norm after resume on the {where}",
        )
