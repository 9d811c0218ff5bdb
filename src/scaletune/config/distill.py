"""Knowledge distillation settings (`training.distill`, objective `distill`): the teacher and the
divergence the student is trained to minimise against it, token by token. The loss is in
`objectives.distill`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from scaletune.config.strict import StrictModel

DistillLoss = Literal["forward_kl", "reverse_kl", "jsd"]


class DistillConfig(StrictModel):
    """Offline distillation (docs/distill.md): on the stage's SFT data (alpaca, messages or text),
    at every trained token the student's next-token distribution is pulled towards the teacher's.
    Read only when `objective` is `distill`. Batch sizes count sequences, as SFT's."""

    teacher: str | None = None
    """The teacher: a model folder, a preset or a Hub name, with the student's tokenizer (the same
    vocabulary, checked before training). Held frozen beside the student as `reference: model` holds
    its reference: whole under single/ddp, sharded under fsdp and ZeRO-3."""
    loss: DistillLoss = "forward_kl"
    """The divergence per token, over the whole vocabulary, as TRL 1.16's `GKDTrainer.generalized_jsd_loss`
    (Agarwal et al. 2024, On-Policy Distillation of Language Models, eq. 1): forward_kl is
    KL(teacher || student) (its beta 0), reverse_kl KL(student || teacher) (beta 1), jsd the
    generalized Jensen-Shannon divergence at `beta`."""
    beta: float = Field(0.5, gt=0, lt=1)
    """Read by loss jsd only: beta * KL(teacher || M) + (1 - beta) * KL(student || M), M = beta * teacher +
    (1 - beta) * student."""
    temperature: float = Field(1.0, gt=0)
    """Both models' logits are divided by it before the softmax (TRL's; the loss is not rescaled by
    its square)."""

    @property
    def reference(self) -> str:
        """Where the frozen model comes from, in `training.preference.reference`'s words: the
        teacher is always a model of its own (`trainer.objectives.StageObjectives.after_wrap`)."""
        return "model"

    @property
    def mixture_beta(self) -> float:
        """TRL's `beta` argument: 0 for forward_kl, 1 for reverse_kl, `beta` for jsd."""
        return {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": self.beta}[self.loss]
