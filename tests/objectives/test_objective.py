"""The table of facts per objective (`config.preference.OBJECTIVES`) against what each objective's
loss really does: the objectives `training.objective` accepts, the units its loss components are
averaged over, whether its loss reads the reference's log-probs, and the metric keys it writes."""

from __future__ import annotations

import typing

import pytest
import torch

from scaletune.config.preference import OBJECTIVES as FACTS
from scaletune.config.preference import Objective, PreferenceConfig
from scaletune.objectives.objective import OBJECTIVES
from scaletune.objectives.table import LOSSES, objective_for

# The online objective (grpo) is checked on fixed tensors against TRL (tests/objectives/test_rl_vs_trl.py)
# and its metric keys in a run (tests/distributed/test_grpo_parity.py); distill's units, metric keys
# and teacher in tests/objectives/test_distill_vs_trl.py.
PREFERENCE = [name for name in FACTS if name not in ("sft", "grpo", "distill")]


def test_the_table_names_exactly_the_objectives_the_config_accepts() -> None:
    assert tuple(FACTS) == typing.get_args(Objective)
    assert set(OBJECTIVES) == set(PREFERENCE)
    assert set(LOSSES) == set(FACTS) - {"sft"}
    assert objective_for("sft", PreferenceConfig()) is None


def _batch(name: str, m: int = 3) -> tuple[dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A hand-made micro-batch of m examples (2m rows when paired) with per-row log-probs, token
    counts and reference log-probs; 2 trained tokens per chosen row."""
    rows = 2 * m if FACTS[name].paired else m
    labels = torch.full((rows, 6), -100)
    labels[:, 3:5] = 7  # 2 targets after the shift (positions 3 and 4 predicted from 2 and 3)
    batch = {
        "input_ids": torch.ones(rows, 6, dtype=torch.long),
        "labels": labels,
        "desirable": torch.tensor([True, False, True][:m]),
        "kl": 0.25,
    }
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(rows, generator=g) * 10
    ref = -torch.rand(rows, generator=g) * 10
    return batch, logp, torch.full((rows,), 2.0), ref


@pytest.mark.parametrize("name", PREFERENCE)
def test_units_and_reference_are_what_the_loss_reads(name: str) -> None:
    facts, objective = FACTS[name], objective_for(name, PreferenceConfig(beta=0.3))
    batch, logp, tokens, ref = _batch(name)
    units = objective.units(batch)
    assert len(units) == len(facts.units)
    # a pair is 2 rows of the batch; ORPO's first unit is the chosen rows' trained tokens (3 x 2)
    expected = {"pairs": 3, "records": 3, "chosen target tokens": 6}
    assert units == tuple(expected[u] for u in facts.units)
    components, stats = objective.loss(logp, tokens, ref, batch)
    assert components.shape == (len(facts.units),)
    # The reference's log-probs change the loss exactly when the table says the objective has one
    # (one row's moved: a shift of every row cancels in DPO's difference of differences).
    other = ref.clone()
    other[0] += 1.5
    moved, _ = objective.loss(logp, tokens, other, batch)
    assert bool((moved != components).any()) == facts.reference, name
    if not facts.reference:
        objective.loss(logp, tokens, None, batch)  # never reads it
    else:
        with pytest.raises((TypeError, AttributeError)):
            objective.loss(logp, tokens, None, batch)


@pytest.mark.parametrize("name", PREFERENCE)
def test_metric_keys_are_the_tables(name: str) -> None:
    facts, objective = FACTS[name], objective_for(name, PreferenceConfig())
    batch, logp, tokens, ref = _batch(name)
    _, stats = objective.loss(logp, tokens, ref if facts.reference else logp, batch)
    keys = set(objective.metrics(stats.tolist()))
    # the KL pass's value is added by the trainer (`trainer.objectives.StageObjectives.metrics`)
    assert keys | ({"kl"} if objective.kl_pass else set()) == set(facts.metrics)
