"""What `scaletune eval --format preference` compares a model with, from the run's real config:
the reference (a LoRA run's base with the adapter disabled, a full fine-tune's starting model,
`--reference`, none for a model without a run) and beta (`--beta`, the run's last preference
stage's, the top level's, 0.1) and that stage's own data keys; SimPO and ORPO runs refuse a
reference. The rewards themselves are checked against real runs in
tests/e2e/test_eval_preference.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from scaletune.errors import UserError
from scaletune.inference.evaluate import preference_plan
from scaletune.inference.loading import Target
from tests.helpers import make_config

PAIRS = {"train": {"path": "pairs.jsonl", "format": "preference"}}


def run_config(objective="dpo", beta=None, lora=False, **extra):
    training = {"objective": objective, **({"preference": {"beta": beta}} if beta is not None else {})}
    model = {"lora": {"r": 4, "alpha": 8}} if lora else {}
    return make_config("base-model", "out", model=model, data=PAIRS, training=training, as_config=True, **extra)


def target(cfg=None, adapter=False) -> Target:
    return Target(Path("run/final"), "run", adapter, cfg)


def test_lora_run_is_compared_with_its_base_full_run_with_its_starting_model():
    plan = preference_plan(target(run_config(beta=0.3, lora=True), adapter=True), None, None)
    assert (plan.objective, plan.beta, plan.reference, plan.rewards) == ("dpo", 0.3, "adapter", "reference")
    plan = preference_plan(target(run_config()), None, None)
    assert (plan.beta, plan.reference, plan.rewards) == (0.1, "base-model", "reference")
    assert "reference: base-model" in plan.describe()
    plan = preference_plan(target(run_config(beta=0.3)), "other", 0.5)
    assert (plan.beta, plan.reference) == (0.5, "other")


def test_model_without_a_run_is_reference_free_unless_given_one():
    plan = preference_plan(Target(Path("model"), "model", False, None), None, None)
    assert (plan.objective, plan.beta, plan.reference, plan.rewards) == ("dpo", 0.1, None, None)
    assert plan.describe().startswith("reference-free")
    plan = preference_plan(Target(Path("model"), "model", False, None), "base", 0.2)
    assert (plan.beta, plan.reference, plan.rewards) == (0.2, "base", "reference")


@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_reference_free_objectives_refuse_a_reference(objective):
    plan = preference_plan(target(run_config(objective, beta=2.0)), None, None)
    assert (plan.objective, plan.beta, plan.reference, plan.rewards) == (objective, 2.0, None, "length")
    with pytest.raises(UserError) as err:
        preference_plan(target(run_config(objective)), "base-model", None)
    assert f"this run trained {objective}" in err.value.problems[0]


def test_sft_then_dpo_takes_the_last_preference_stage():
    stages = [
        {"name": "sft", "data": {"train": {"path": "sft.json", "format": "alpaca"}}, "training": {"max_steps": 2}},
        {"name": "dpo", "training": {"objective": "dpo", "preference": {"beta": 0.4}, "max_steps": 2}},
    ]
    top = {"data": PAIRS, "training": {"preference": {"beta": 0.2}}}
    plan = preference_plan(target(make_config("base-model", "out", top, stages=stages, as_config=True)), None, None)
    assert (plan.objective, plan.beta, plan.max_seq_length, plan.chat_template) == ("dpo", 0.4, None, None)
    stages[1]["data"] = {"max_seq_length": 48, "chat_template": "{{ messages }}"}  # the stage's own data keys
    plan = preference_plan(target(make_config("base-model", "out", top, stages=stages, as_config=True)), None, None)
    assert (plan.max_seq_length, plan.chat_template) == (48, "{{ messages }}")
    stages[1]["training"].pop("preference")  # not given in the stage: the top level's
    plan = preference_plan(target(make_config("base-model", "out", top, stages=stages, as_config=True)), None, None)
    assert (plan.objective, plan.beta) == ("dpo", 0.2)
