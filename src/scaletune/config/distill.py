"""Knowledge distillation settings (`training.distill`, objective `distill`): the teacher, the
divergence the student is trained to minimise against it token by token, and where the tokens come
from (the data's answers, or the student's own completions). The loss is in `objectives.distill`,
generation in `rollout`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from scaletune.config.rl import RLEngine, check_replay
from scaletune.config.strict import StrictModel

DistillLoss = Literal["forward_kl", "reverse_kl", "jsd"]
DistillMode = Literal["offline", "on_policy"]


class DistillConfig(StrictModel):
    """Distillation (docs/distill.md): at every trained token the student's next-token distribution
    is pulled towards the teacher's. `offline`: on the stage's SFT data (alpaca, messages or text),
    batch sizes counting sequences, as SFT's. `on_policy`: on completions the student samples for
    the stage's prompt data (`format: prompt`), as GKD (Agarwal et al. 2024) with its lambda 1;
    batch sizes count prompts, each bringing `num_generations` completions. Read only when
    `objective` is `distill`."""

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
    its square); on_policy samples the student's completions at it too, as TRL's GKDTrainer does."""
    mode: DistillMode = "offline"
    """offline: the data's own answers are the tokens compared; on_policy: the student's completions
    of the data's prompts, sampled at every step (and at every evaluation) by `engine`."""
    num_generations: int = Field(1, ge=1)
    """on_policy: completions sampled per prompt."""
    max_new_tokens: int = Field(128, ge=1)
    """on_policy: longest completion, in tokens (one that reaches it without the end-of-sequence
    token is cut there and trained as it is)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """on_policy: nucleus sampling; 1.0 samples from the whole vocabulary."""
    engine: RLEngine = "hf"
    """on_policy: what samples the completions, as `training.rl.engine`: hf, the student's own
    `generate`; replay, the completions of an earlier run's rollouts.jsonl (`replay`)."""
    replay: str | None = None
    """on_policy with engine replay: the rollouts.jsonl to read."""

    @model_validator(mode="after")
    def _engine(self) -> DistillConfig:
        check_replay(self.engine, self.replay, "training.distill")
        return self

    @property
    def reference(self) -> str:
        """Where the frozen model comes from, in `training.preference.reference`'s words: the
        teacher is always a model of its own (`trainer.objectives.StageObjectives.after_wrap`)."""
        return "model"

    @property
    def mixture_beta(self) -> float:
        """TRL's `beta` argument: 0 for forward_kl, 1 for reverse_kl, `beta` for jsd."""
        return {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": self.beta}[self.loss]
