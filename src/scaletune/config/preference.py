"""The training objective and the preference-training settings (`training.objective`,
`training.preference`); the losses themselves are in :mod:`scaletune.objectives`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from scaletune.config.strict import StrictModel

Objective = Literal["sft", "dpo", "ipo", "orpo", "kto", "simpo"]
#: The objectives that train on preference data (`data.train.format: preference`, KTO: `kto`).
PreferenceObjective = Literal["dpo", "ipo", "orpo", "kto", "simpo"]
ReferenceMode = Literal["auto", "base", "precomputed", "model"]


class PreferenceConfig(StrictModel):
    """Preference training (DPO, IPO, ORPO, KTO, SimPO): the loss's temperature and where the
    reference model's log-probabilities come from. Read only when `objective` is not `sft`."""

    beta: float = Field(0.1, gt=0)
    """The loss's inverse temperature: DPO's, IPO's tau, KTO's and SimPO's beta; ORPO's lambda (the
    weight of the odds-ratio term against the chosen answers' NLL)."""
    reference: ReferenceMode = "auto"
    """Where the reference log-probs come from (DPO, IPO, KTO; ORPO and SimPO have no reference).
    base: the same model with its LoRA adapters disabled, no second copy (LoRA only); precomputed: one
    pass at the start of the stage computes them for every pair with the model as it is then, cached
    beside the tokenised data, no reference resident while training; model: a frozen copy of
    `model.name_or_path` (without adapters), sharded like the policy; auto: base under LoRA, else
    precomputed."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """DPO and SimPO: the probability that a pair's preference is flipped (conservative DPO, Mitchell
    2023); 0: plain DPO."""
    gamma: float = Field(0.5, ge=0)
    """SimPO: the target reward margin (gamma in Meng et al. 2024; TRL's `simpo_gamma`)."""
    desirable_weight: float = Field(1.0, gt=0)
    """KTO: the weight of desirable (label true) examples' losses (lambda_D)."""
    undesirable_weight: float = Field(1.0, gt=0)
    """KTO: the weight of undesirable (label false) examples' losses (lambda_U)."""
