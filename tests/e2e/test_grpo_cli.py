"""`scaletune train` with objective grpo refuses what cannot train, every problem of a phase in one
call, exit 2, before any step (issue 36): the config's rules (no reward function, a base reference
without LoRA, the hf engine under a sharding strategy, a replay file given to another engine) in one
call; the reward functions that cannot score (one raises, one returns the wrong length, one whose
signature does not take the data's fields) in one call after the data are read, each named with its
key. An engine whose log-probs the trainer does not reproduce stops the run, naming the bound. The
prompts are real Alpaca instructions (tests/distributed/test_grpo_parity.py's)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import ALPACA_5000, make_config, train

BAD = Path(__file__).resolve().parents[1] / "unit" / "rewards" / "bad_rewards.py"


def _prompts(tmp_path: Path) -> Path:
    records = [r for r in json.loads(ALPACA_5000.read_text()) if not r["input"]][:8]
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": r["instruction"], "answer": r["output"].split()[0]}) + "\n" for r in records)
    )
    return path


def _grpo(model_dir: Path, tmp_path: Path, rl: dict, **sections) -> dict:
    return make_config(
        model_dir,
        tmp_path / "run",
        data={"train": {"path": str(_prompts(tmp_path)), "format": "prompt"}},
        training={"objective": "grpo", "global_batch_size": 4, "micro_batch_size": 2, "max_steps": 1, "rl": rl},
        **sections,
    )


def test_config_rules_are_refused_together(tiny_model_dir, tmp_path):
    cfg = _grpo(
        tiny_model_dir,
        tmp_path,
        {"rewards": [], "beta": 0.1, "reference": "base", "engine": "hf"},
        distributed={"strategy": "fsdp", "num_processes": 2, "tensor_parallel": 2},
    )
    proc = train(cfg, tmp_path, expect_ok=False)
    err = proc.stderr
    assert proc.returncode == 2, err[-2000:]
    assert "training.rl.rewards is empty" in err
    assert "training.rl.reference base is the model with its LoRA adapters disabled, but model.lora is not set" in err
    assert "training.rl.engine hf generates with the trained module on each rank, which world_size 2" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_replay_file_for_another_engine_is_a_schema_error(tiny_model_dir, tmp_path):
    cfg = _grpo(
        tiny_model_dir,
        tmp_path,
        {"engine": "hf", "replay": "x.jsonl", "rewards": [{"function": "scaletune.rewards:exact_answer"}]},
    )
    proc = train(cfg, tmp_path, expect_ok=False)
    assert proc.returncode == 2
    assert "training.rl.replay is read only by engine replay, not hf" in proc.stderr


def test_reward_functions_that_cannot_score_are_named_before_training(tiny_model_dir, tmp_path):
    rewards = [
        {"function": "scaletune.rewards:exact_answer"},
        {"function": f"{BAD}:raises"},
        {"function": f"{BAD}:wrong_length", "weight": 0.5},
    ]
    proc = train(_grpo(tiny_model_dir, tmp_path, {"rewards": rewards}), tmp_path, expect_ok=False)
    err = proc.stderr
    assert proc.returncode == 2, err[-2000:]
    assert "training.rl.rewards[1].function" in err and "raises" in err
    assert "training.rl.rewards[2].function" in err and "wrong_length" in err
    assert "training.rl.rewards[0]" not in err  # the built-in scores
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_config_new_on_a_prompt_file_writes_a_grpo_run_that_passes_check(tiny_model_dir, tmp_path):
    """`config new` tells prompt records by their keys and starts them with GRPO rewarded by
    `exact_answer`; `train --check` then runs every check (the data tokenised, the reward called on
    the first prompt) and passes."""
    import yaml

    from tests.helpers import run_cli

    _prompts(tmp_path)
    said = run_cli(["config", "new", "prompts.jsonl", "-o", "p.yaml", "--model", str(tiny_model_dir)], cwd=tmp_path)
    assert said.returncode == 0 and "of format prompt" in said.stdout, said.stdout + said.stderr
    cfg = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert cfg["training"]["objective"] == "grpo"
    assert cfg["training"]["rl"]["rewards"] == [{"function": "scaletune.rewards:exact_answer"}]
    check = run_cli(["train", "p.yaml", "--check"], cwd=tmp_path)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-3000:]


def test_log_probs_the_engine_did_not_sample_at_stop_the_run_after_its_line(tiny_model_dir, tmp_path):
    """The log-prob agreement check: with bfloat16 weight copies (`mixed_precision: bf16_params`,
    FSDP2's unit on a one-rank mesh whose hooks run around `generate` too) the hf engine samples
    through its KV cache and the trainer recomputes the whole rows; bf16's rounding makes them
    differ, which metrics.jsonl logs as `logp_mismatch` (the fp32 runs of test_grpo_parity agree
    within 1e-5). Bounded at 1e-6 (`max_logp_mismatch`), the run stops after step 1's line, naming
    the bound, with no checkpoint."""
    rl = {
        "rewards": [{"function": "scaletune.rewards:exact_answer"}],
        "num_generations": 2,
        "max_new_tokens": 4,
        "max_logp_mismatch": 1e-6,
    }
    cfg = _grpo(tiny_model_dir, tmp_path, rl, model={"dtype": "bfloat16", "mixed_precision": "bf16_params"})
    cfg["training"]["max_steps"] = 2
    proc = train(cfg, tmp_path, expect_ok=False)
    err = proc.stderr
    assert proc.returncode != 0, err[-2000:]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in lines if "loss" in m]
    assert [m["step"] for m in logged] == [1]
    mismatch = logged[0]["logp_mismatch"]
    assert 1e-6 < mismatch < 1.0 and logged[0]["entropy"] > 0
    assert f"by {mismatch:.3g} nats a token on average, beyond training.rl.max_logp_mismatch (1e-06)" in err
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())
