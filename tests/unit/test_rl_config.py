"""`training.rl` (config/rl.py) and the resolve rules of objective grpo, in process: what `auto`
decides for the reference, and the fix a prompt file trained as SFT is pointed to."""

from __future__ import annotations

import pytest

from scaletune.errors import UserError
from scaletune.resolve import resolve
from tests.helpers import LORA, make_config, make_env

REWARDS = [{"function": "scaletune.rewards:exact_answer"}]


def _grpo(tmp_path, **sections):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "Is the sky blue?", "answer": "yes"}\n' * 8)
    return make_config(
        tmp_path / "model",
        tmp_path / "run",
        {"data": {"train": {"path": str(prompts), "format": "prompt"}}},
        {"training": {"objective": "grpo", "rl": {"rewards": REWARDS, "beta": 0.1}}},
        **sections,
        as_config=True,
    )


@pytest.mark.parametrize("lora, decided", [(True, "base"), (False, "model")])
def test_reference_auto_is_the_lora_base_else_a_frozen_copy(tmp_path, lora, decided):
    cfg = _grpo(tmp_path, model=LORA if lora else {})
    (stage,) = resolve(cfg, make_env(), check=False).stages
    assert stage.training.rl.reference == decided


def test_a_prompt_file_trained_as_sft_is_pointed_to_grpo(tmp_path):
    cfg = _grpo(tmp_path, training={"objective": "sft"})
    with pytest.raises(UserError) as err:
        resolve(cfg, make_env())
    assert "data.train.format is prompt, but training.objective sft trains on alpaca or messages or text data" in str(
        err.value
    )
    assert "set training.objective: grpo (online RL)" in str(err.value)


def test_on_policy_distillation_reads_prompts_and_counts_its_completions(tmp_path):
    """`training.distill` on policy: prompts as GRPO's (answers refused by the format rule, which a
    prompt file passes), an engine replay needs its file, and a micro-batch unit is a prompt with
    its num_generations completions (`plan.reference_model.sequences_per_example`)."""
    from scaletune.errors import ConfigError
    from scaletune.plan.reference_model import sequences_per_example

    on_policy = {
        "objective": "distill",
        "rl": None,
        "distill": {"teacher": str(tmp_path), "mode": "on_policy", "num_generations": 3},
    }
    cfg = _grpo(tmp_path, training=on_policy)
    spec = resolve(cfg, make_env(), check=False)
    assert sequences_per_example(spec) == 3
    offline = _grpo(tmp_path, training={**on_policy, "distill": {"teacher": str(tmp_path)}})
    with pytest.raises(UserError) as err:
        resolve(offline, make_env())
    assert "data.train.format is prompt, but training.objective distill trains on alpaca or messages or text" in str(
        err.value
    )
    with pytest.raises(ConfigError, match="engine replay reads its completions from training.distill.replay"):
        _grpo(tmp_path, training={**on_policy, "distill": {"mode": "on_policy", "engine": "replay"}})
