"""The training objective and the preference-training settings (`training.objective`,
`training.preference`), and THE table of facts about each objective (`OBJECTIVES`) that resolve,
data, the step, the metrics, the planner and evaluation read; the losses themselves are in
:mod:`scaletune.objectives`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from scaletune.config.strict import StrictModel

Objective = Literal["sft", "dpo", "ipo", "orpo", "kto", "simpo", "grpo", "distill"]
ReferenceMode = Literal["auto", "base", "precomputed", "model"]


@dataclass(frozen=True)
class ObjectiveFacts:
    """What the rest of a run needs to know about one training objective.

    Attributes:
        name: the `training.objective` value.
        formats: the `data.*.format` values it trains on (the first is the one a message suggests).
        batch_counts: what `micro_batch_size` and `global_batch_size` count for it, in words.
        units: what each component of its loss is averaged over, summed over the global batch
            before dividing (the step's denominators, one per component).
        reference: its loss compares with a frozen model's log-probs: the reference model
            (`training.preference.reference` is read) or distillation's teacher.
        paired: a micro-batch of m examples is one forward over 2m sequences (chosen, then rejected).
        metrics: the keys its metrics.jsonl lines add (``eval_`` prefixed on evaluation lines).
        source: where the loss comes from.
        headline: what its console step and eval lines show beside the loss (``eval_`` prefixed on
            evaluation lines): keys of `metrics`, or ``perplexity``, exp(loss), for a loss that is a
            mean token cross-entropy.
    """

    name: str
    formats: tuple[str, ...]
    batch_counts: str
    units: tuple[str, ...]
    reference: bool
    paired: bool
    metrics: tuple[str, ...]
    source: str
    headline: tuple[str, ...] = ()


_PAIR_METRICS = ("reward_accuracy", "reward_margin", "logp_chosen", "logp_rejected")
_PAIRS = "pairs (2 sequences each)"
_PAIR_HEADLINE = ("reward_accuracy", "reward_margin")

#: THE facts of every objective, in `Objective`'s order.
OBJECTIVES: dict[str, ObjectiveFacts] = {
    f.name: f
    for f in (
        ObjectiveFacts(
            "sft", ("alpaca", "messages", "text"), "sequences", ("target tokens",), False, False, (),
            "next-token cross-entropy on the answer's tokens", ("perplexity",),
        ),
        ObjectiveFacts(
            "dpo", ("preference",), _PAIRS, ("pairs",), True, True, _PAIR_METRICS,
            "Rafailov et al. 2023, Direct Preference Optimization", _PAIR_HEADLINE,
        ),
        ObjectiveFacts(
            "ipo", ("preference",), _PAIRS, ("pairs",), True, True, _PAIR_METRICS,
            "Azar et al. 2023, A General Theoretical Paradigm to Understand Learning from Human Preferences", _PAIR_HEADLINE,
        ),
        ObjectiveFacts(
            "orpo", ("preference",), _PAIRS, ("chosen target tokens", "pairs"), False, True, _PAIR_METRICS,
            "Hong et al. 2024, ORPO: Monolithic Preference Optimization without Reference Model", _PAIR_HEADLINE,
        ),
        ObjectiveFacts(
            "kto", ("kto",), "records", ("records",), True, False,
            ("reward_margin", "logp_chosen", "logp_rejected", "kl"),
            "Ethayarajh et al. 2024, KTO: Model Alignment as Prospect Theoretic Optimization", ("reward_margin", "kl"),
        ),
        ObjectiveFacts(
            "simpo", ("preference",), _PAIRS, ("pairs",), False, True, _PAIR_METRICS,
            "Meng et al. 2024, SimPO: Simple Preference Optimization with a Reference-Free Reward", _PAIR_HEADLINE,
        ),
        ObjectiveFacts(
            "grpo", ("prompt",), "prompts (num_generations completions each)",
            ("completion tokens (dapo), completions (grpo), completions x max_new_tokens (dr_grpo)",), True, False,
            ("reward", "reward_std", "completion_length", "clip_fraction", "kl", "zero_variance_groups", "entropy",
             "logp_mismatch"),
            "Shao et al. 2024, DeepSeekMath (GRPO); Yu et al. 2025, DAPO; Liu et al. 2025, Dr. GRPO",
            ("reward", "reward_std"),
        ),
        ObjectiveFacts(
            "distill", ("alpaca", "messages", "text"), "sequences", ("target tokens",), True, False,
            ("student_nll", "teacher_nll"),
            "Agarwal et al. 2024, On-Policy Distillation of Language Models (generalized JSD; TRL's GKDTrainer)",
            ("student_nll", "teacher_nll"),
        ),
    )
}  # fmt: skip

#: Every key an objective's metrics.jsonl lines may add, in the table's order (the page's chart offers them).
METRIC_KEYS: tuple[str, ...] = tuple(dict.fromkeys(k for f in OBJECTIVES.values() for k in f.metrics))


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
