"""The stages' training objectives, owned in one place: the loss module a run with a preference
stage wraps (`objectives.module.PreferenceLoss`), each stage's objective set on it when the stage
starts, its reference (precomputed tables attached to the stage's data, or the frozen model of
`reference: model` made resident once), the batch kind the step reads, and the metrics it adds."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from scaletune.objectives.objective import Objective
from scaletune.objectives.table import objective_for

if TYPE_CHECKING:
    from scaletune.resolve import RunSpec
    from scaletune.trainer.batches import BatchKind
    from scaletune.trainer.stages import StagePlan

__all__ = ["StageObjectives"]


class StageObjectives:
    """Per stage: SFT (None) or an `objectives.Objective`; `any`: a stage trains a preference or
    online loss. `steps_done` reads the loop's position (optimizer steps taken), which an online
    stage's rollouts are numbered by."""

    def __init__(self, spec: RunSpec, steps_done: Callable[[], int] = lambda: 0) -> None:
        self.spec = spec
        self.steps_done = steps_done
        self.by_stage: dict[int, Objective | None] = {
            st.index: objective_for(st.training.objective, _settings(st.training)) for st in spec.stages
        }
        #: The current online stage's rollout (`rollout.Rollout`), whose reward metrics a step adds.
        self.rollout: Any = None
        self.any = any(o is not None for o in self.by_stage.values())
        self.current: Objective | None = None
        self.current_index = 0
        self.strategy: Any = None
        #: KTO's reference point of the last KL pass (a step's, or an evaluation's), for the metrics.
        self.kl: float | None = None

    def loss_module(self, loss: Any) -> Any:
        """The SFT loss module (`models.loss.CausalLMLoss`) as a `PreferenceLoss` with its settings."""
        from scaletune.objectives.module import PreferenceLoss

        return PreferenceLoss(
            loss.causal_lm,
            chunk=loss.chunk,
            activation_offload=loss.activation_offload,
            liger=loss.liger,
            partitioned_head=loss.partitioned_head,
        )

    def after_wrap(self, strategy: Any, source: Any) -> None:
        """`reference: model` in any stage, or a distillation teacher: the frozen model loaded and
        made resident like the policy (one per run: `resolve.rules` refuses two different ones)."""
        self.strategy = strategy
        wanted = [
            o for o in self.by_stage.values() if o is not None and o.uses_reference and o.settings.reference == "model"
        ]
        if wanted:
            teacher = next((o.settings.teacher for o in wanted if o.distills), None)
            strategy.module.set_reference(source.load_reference(strategy, teacher))  # loaded and made resident

    def enter(self, plan: StagePlan, strategy: Any, tokenizer: Any, resumed: bool, default: BatchKind) -> BatchKind:
        """Set the stage's objective on the loss module; `reference: precomputed`: attach the
        reference tables to the stage's data (computed now unless cached). Returns the batch kind."""
        from scaletune.trainer.batches import preference_kind

        objective = self.current = self.by_stage[plan.stage.index]
        self.current_index = plan.stage.index
        self.strategy = strategy
        if not self.any:
            return default
        strategy.module.start_stage(objective)
        self.kl = None
        self.rollout = None
        if objective is None:
            return default
        if objective.per_token:
            return self._online(objective, strategy, tokenizer)
        if objective.distills:
            from scaletune.trainer.batches import distill_kind

            on_policy = objective.settings.mode == "on_policy"
            return distill_kind(objective, self._rollout(objective, strategy, tokenizer, []) if on_policy else None)
        if objective.uses_reference and objective.settings.reference == "precomputed":
            from scaletune.objectives.precomputed import reference_tables
            from scaletune.trainer.stages import stage_collator

            reference_tables(strategy, self.spec, plan, stage_collator(plan, tokenizer), resumed=resumed)
        return preference_kind(objective, self.kl_pass)

    def _online(self, objective: Objective, strategy: Any, tokenizer: Any) -> BatchKind:
        """An online stage: its reward functions and rollout, whose `before_step` generates and
        scores each step's completions."""
        from scaletune.rewards.scoring import load_rewards
        from scaletune.trainer.batches import online_kind

        prefix = f"{self._key('rl')}.rewards"
        rewards = load_rewards([(r.function, r.weight, r.kwargs) for r in objective.settings.rewards], prefix=prefix)
        return online_kind(objective, self._rollout(objective, strategy, tokenizer, rewards))

    def _rollout(
        self, objective: Objective, strategy: Any, tokenizer: Any, rewards: list
    ) -> Callable[[Any, list], Any]:
        """The stage's engine and rollout (`rollout.Rollout`, kept for its metrics; rank 0 writes
        rollouts.jsonl): its `before_step`, which turns each micro-batch's prompts into completion rows."""
        from scaletune.rollout.engines import make_engine
        from scaletune.rollout.rollout import ROLLOUTS, Rollout

        settings = objective.settings
        log = self.spec.run_dir / ROLLOUTS if self.spec.env.is_main else None
        section = "distill" if objective.distills else "rl"
        engine = make_engine(settings, strategy, tokenizer, key=self._key(section))
        self.rollout = Rollout(settings, engine, rewards, tokenizer, self.steps_done, log)
        return self.rollout.before_step

    def _key(self, section: str) -> str:
        """`training.SECTION`, or the current stage's `stages.N.training.SECTION`."""
        where = f"stages.{self.current_index}." if self.spec.config.stages else ""
        return f"{where}training.{section}"

    def kl_pass(self, strategy: Any, batches: list) -> None:
        """KTO's KL pass (`trainer.batches.kto_kl_pass`), its value kept for the metrics."""
        from scaletune.trainer.batches import kto_kl_pass

        self.kl = kto_kl_pass(strategy, batches)

    def generations(self, batches: Iterator, remaining: Callable[[], int]) -> Iterator:
        """The stage's global batches ``(epoch, i, micro_batches)``. An online stage that trains
        `steps_per_generation` > 1 steps on one generation has the next such steps' prompts (at most
        `remaining()`, the stage's steps left) taken from `batches` and sampled at once before the
        first of them is trained (`rollout.Rollout.generate`); any other stage's pass through."""
        rollout = self.rollout
        if rollout is None or rollout.per_generation == 1:
            yield from batches
            return
        batches = iter(batches)
        while remaining() > 0:
            group = list(itertools.islice(batches, min(rollout.per_generation, remaining())))
            if not group:
                return
            rollout.generate(self.strategy, [micro for _, _, micro in group])
            yield from group

    def generation_start(self, step: int) -> int | None:
        """Where the generation the last step (`step`) trained on was sampled, in optimizer steps,
        once that step was its last; None inside a generation, where no checkpoint is written (its
        later steps need the completions and old log-probs of a policy a resumed run no longer
        has). A stage that does not generate ahead: ``step - 1``, each step its own."""
        rollout = self.rollout
        if rollout is None or rollout.per_generation == 1:
            return step - 1
        return None if rollout.queued else rollout.generated_at

    def check_engine(self, metrics: dict[str, float], step: int) -> None:
        """The log-prob agreement check of an online stage whose engine samples from the trained
        weights: `metrics` (the step's, from :meth:`metrics`) with a `logp_mismatch` above
        `training.rl.max_logp_mismatch` stops the run. Every rank holds the same all-reduced value,
        so every rank raises.

        Raises:
            LogProbMismatchError: beyond the bound.
        """
        from scaletune.rollout.engines import LogProbMismatchError

        bound = getattr(getattr(self.current, "settings", None), "max_logp_mismatch", None)
        got = metrics.get("logp_mismatch")
        if self.rollout is None or not self.rollout.engine.samples_policy or bound is None or got is None:
            return
        if got > bound:
            engine = self.rollout.engine.name
            raise LogProbMismatchError(
                f"step {step}: the {engine} engine's log-probabilities of the sampled tokens differ from the "
                f"trainer's by {got:.3g} nats a token on average, beyond {self._key('rl')}.max_logp_mismatch "
                f"({bound}): the engine is not sampling from the weights being trained (stale or differently "
                "loaded weights, or another precision). Raise the bound only if the difference is precision."
            )

    def rollout_memory(self) -> dict[str, int]:
        """What the current stage's engine held on this rank (memory.json's `kv_cache`), or nothing
        where no stage samples."""
        return {} if self.rollout is None else {"kv_cache": int(self.rollout.engine.kv_cache_bytes)}

    def metrics(self, stats: Any) -> dict[str, float]:
        """The current objective's metrics from global stats sums (empty for SFT)."""
        if stats is None or self.current is None:
            return {}
        out = self.current.metrics(stats.tolist())
        if self.current.kl_pass and self.kl is not None:
            out["kl"] = self.kl
        if self.rollout is not None:
            out = {**self.rollout.last, **out}
        return out


def _settings(training: Any) -> Any:
    """A stage's objective's settings section: `rl` for grpo, `distill` for distill, else `preference`."""
    return {"grpo": training.rl, "distill": training.distill}.get(training.objective, training.preference)
