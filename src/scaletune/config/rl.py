"""Online reinforcement learning settings (`training.rl`, objective `grpo`): the group of completions
per prompt, how they are sampled, the clipped policy loss, the KL to the reference model, the reward
functions and the generation engine. The loss is in `objectives.rl`, generation in `rollout`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from scaletune.config.strict import StrictModel

RLLoss = Literal["dapo", "grpo", "dr_grpo"]
RLReference = Literal["auto", "base", "model"]
RLEngine = Literal["hf", "replay"]


class RewardSpec(StrictModel):
    """One reward function and its weight in the total reward."""

    function: str
    """`package.module:name` or `path/to/file.py:name`: called as
    `fn(prompts=[str], completions=[str], **fields, **kwargs) -> list[float]`, one float per completion
    (TRL's convention; docs/rl.md). Built-ins: `scaletune.rewards:exact_answer`, `regex_match`,
    `length_penalty`. Anything else is your code: the service runs it only where an admin allows."""
    weight: float = 1.0
    """Its weight in the total reward: total = sum of weight * value over the functions."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Fixed keyword arguments (e.g. `pattern` for `regex_match`); a name may not be a data field."""


class RLConfig(StrictModel):
    """GRPO and its variants (docs/rl.md). Batch sizes count prompts: a global batch of P prompts
    trains on P * num_generations completions. Read only when `objective` is `grpo`."""

    num_generations: int = Field(8, ge=2)
    """Completions sampled per prompt (the group G whose rewards give each other's baseline)."""
    max_new_tokens: int = Field(256, ge=1)
    """Longest completion, in tokens; one that reaches it without the end-of-sequence token is cut
    there (and trained as it is)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trained log-probabilities are those of the distribution sampled
    from, softmax(logits / temperature), as TRL's GRPOTrainer computes them."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; 1.0 samples from the whole vocabulary. Below 1 the trained (and the
    reference's) log-probabilities are renormalised on the kept tokens, the distribution the
    completions were sampled from (TRL's are over the whole vocabulary)."""
    loss: RLLoss = "dapo"
    """How per-token losses are averaged over the global batch. dapo: over all completion tokens (Yu et
    al. 2025, DAPO); grpo: over each completion's tokens, then over completions (Shao et al. 2024,
    DeepSeekMath); dr_grpo: the sum over completions * max_new_tokens, advantages not divided by the
    group's std (Liu et al. 2025, Understanding R1-Zero-Like Training). As TRL 1.16's GRPOTrainer."""
    clip: tuple[float, float] = (0.2, 0.28)
    """(low, high): the policy ratio is clipped to [1 - low, 1 + high] (DAPO's clip-higher)."""
    beta: float = Field(0.0, ge=0)
    """Weight of the per-token KL to the reference model (the k3 estimator, Schulman 2020, weighted
    by the policy ratio as TRL 1.16 does by default); 0: no reference is computed."""
    reference: RLReference = "auto"
    """The reference model when beta > 0. base: the model with its LoRA adapters disabled (no copy);
    model: a frozen copy of `model.name_or_path`, sharded like the policy; auto: base under LoRA,
    else model."""
    rewards: list[RewardSpec] = Field(default_factory=list)
    """The reward functions; at least one."""
    steps_per_generation: int = Field(1, ge=1)
    """Optimizer steps trained on one generation: the prompts of this many consecutive steps are
    sampled at once, by the policy before the first of them, and the later steps train off-policy on
    them, their ratio taken to the log-probs the trainer computed (no grad) right after sampling
    (TRL's `steps_per_generation` with `old_per_token_logps`, counted in optimizer steps). Checkpoints
    and a stop requested by `scaletune serve` come only after a generation's last step, so a resume
    never needs completions an earlier policy sampled; a `save_every` falling inside a generation
    saves at its end."""
    engine: RLEngine = "hf"
    """What generates the completions. hf: the trained model's own `generate` (nothing to copy);
    replay: completions read from `replay`, a rollouts.jsonl of an earlier run (offline RL, and
    exact reproductions). (vLLM, DESIGN.md's third engine, is not built yet.)"""
    replay: str | None = None
    """engine replay: the rollouts.jsonl to read (a run directory's, or a file of the same shape)."""
    max_logp_mismatch: float = Field(0.1, gt=0)
    """The log-prob agreement bound, in nats a token: on every step metrics.jsonl logs (`log_every`),
    the mean |trainer - engine| log-probability of the step's completion tokens (`logp_mismatch`
    there) above it stops the run: an engine that samples from the trained weights (hf) is
    then not sampling from them. fp32 on the CPU measures about 1e-6; bf16 more. A replay's
    mismatch (an earlier policy's log-probs, where its file has them) is logged, not bounded."""

    @field_validator("clip")
    @classmethod
    def _clip(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not (0 <= low < 1 and high >= 0):
            raise ValueError("clip is [low, high] with 0 <= low < 1 and high >= 0 (ratios kept in [1-low, 1+high])")
        return value

    @model_validator(mode="after")
    def _engine(self) -> RLConfig:
        check_replay(self.engine, self.replay, "training.rl")
        return self


def check_replay(engine: str, replay: str | None, key: str) -> None:
    """An engine and its `replay` file agree (`training.rl`'s, on-policy `training.distill`'s).

    Raises:
        ValueError: engine replay without a file, or a file for another engine.
    """
    if engine == "replay" and not replay:
        raise ValueError(f"engine replay reads its completions from {key}.replay: give a rollouts.jsonl")
    if replay and engine != "replay":
        raise ValueError(f"{key}.replay is read only by engine replay, not {engine}: remove it")
