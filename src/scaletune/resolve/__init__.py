"""Resolution: config + environment -> one frozen RunSpec (everything decided about a run) and every
cross-field rule, run once on the final values.

Deciding (:func:`decide`) never fails on bad input: it fills in the strategy (`auto` from an
:class:`AutoChoice`, the planner's), the ZeRO stage and offload, the precision, the world size, the
batch arithmetic, the stages with their data and training merged onto the top level, and the
resume source. :func:`rule_problems` then checks the decided run; :func:`resolve` does both and
raises one :class:`~scaletune.errors.ConfigError` naming every problem. Everything below (models,
data, strategies, the loop, the doctor, the planner's report, the launch builders) reads the
`RunSpec`, never raw config dicts or re-typed defaults.

No torch import here: the environment's facts (GPU memory, bf16 support) come in the
:class:`~scaletune.env.DistributedEnv`, the model's (its position limit) as an argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from scaletune.config import Config, DataConfig, LoadedConfig, TrainingConfig
from scaletune.env import DistributedEnv
from scaletune.errors import ConfigError
from scaletune.resolve.mesh import MESH_STRATEGY, mesh_for
from scaletune.resolve.precision import mixed_precision_problems, precision_for
from scaletune.resolve.rules import (
    PACKING_SAFE_ATTENTION,
    liger_problem,
    packing_problems,
    positions_problem,
    quantization_problem,
    rule_problems,
)
from scaletune.resolve.spec import (
    FLOAT_DTYPES,
    AutoChoice,
    BatchArithmetic,
    CheckpointingChoice,
    Mesh,
    Precision,
    Problem,
    RunSpec,
    Stage,
    StrategyName,
    batch_arithmetic,
    batch_problem,
)

__all__ = [
    "FLOAT_DTYPES",
    "PACKING_SAFE_ATTENTION",
    "AutoChoice",
    "BatchArithmetic",
    "CheckpointingChoice",
    "ChooseAuto",
    "ChooseCheckpointing",
    "Precision",
    "Problem",
    "RunSpec",
    "Stage",
    "StrategyName",
    "Mesh",
    "batch_arithmetic",
    "batch_problem",
    "decide",
    "liger_problem",
    "mixed_precision_problems",
    "packing_problems",
    "positions_problem",
    "precision_for",
    "quantization_problem",
    "resolve",
    "resolve_stages",
    "rule_problems",
    "steps_for",
    "wanted_world_size",
]


def wanted_world_size(cfg: Config, env: DistributedEnv) -> int:
    """Ranks of the job: the launcher's world size, or for a plain process the processes it will
    start (`num_processes`, or for `auto` one per visible GPU, so four visible GPUs never train on
    one)."""
    if env.launched:
        return env.world_size
    n = cfg.distributed.num_processes
    return max(1, env.cuda_device_count) if n == "auto" else n


def resolve_stages(cfg: Config) -> list[Stage]:
    """The stages of a run, each stage's `data` and `training` keys merged onto the top level's
    (a key a stage gives replaces the top level's; a stage that sets `epochs` and not `max_steps`
    runs by epochs). An empty `stages` list is one implicit stage named `main`."""
    if not cfg.stages:
        return [Stage(0, "main", cfg.data, _decided_reference(cfg.training, cfg), False)]
    out = []
    for i, s in enumerate(cfg.stages):
        overrides = s.training.model_dump(exclude_none=True) if s.training else {}
        # Validated, not model_copy: a nested section a stage gives (preference) becomes its model.
        training = TrainingConfig.model_validate({**cfg.training.model_dump(), **overrides})
        if "max_steps" not in overrides and "epochs" in overrides:
            training = training.model_copy(update={"max_steps": None})
        data = cfg.data
        if s.data is not None:
            given = s.data.model_dump(exclude_none=True)
            if {"train", "dummy", "factory"} & given.keys():
                # A stage's own source replaces the top level's, of any kind.
                for key in ("train", "dummy", "factory"):
                    given.setdefault(key, None)
                given.setdefault("factory_kwargs", {})
            if "eval" in given or "eval_fraction" in given:
                given.setdefault("eval", None)
                given.setdefault("eval_fraction", None)
            data = DataConfig.model_validate({**cfg.data.model_dump(), **given})
        trainable = tuple(s.trainable) if s.trainable is not None else None
        frozen = tuple(s.frozen) if s.frozen is not None else None
        out.append(Stage(i, s.name, data, _decided_reference(training, cfg), s.continue_schedule, trainable, frozen))
    return out


def _decided_reference(training: TrainingConfig, cfg: Config) -> TrainingConfig:
    """`preference.reference: auto` decided: `base` (adapters disabled, no second copy) under LoRA,
    else `precomputed` (one pass before the stage, nothing resident); `rl.reference: auto` (grpo):
    `base` under LoRA, else `model` (an online policy's log-probs cannot be computed ahead)."""
    if training.objective == "grpo" and training.rl.reference == "auto":
        rl = training.rl.model_copy(update={"reference": "base" if cfg.model.lora is not None else "model"})
        training = training.model_copy(update={"rl": rl})
    pref = training.preference
    if pref.reference != "auto":
        return training
    decided = "base" if cfg.model.lora is not None else "precomputed"
    return training.model_copy(update={"preference": pref.model_copy(update={"reference": decided})})


def decide(
    cfg: Config,
    env: DistributedEnv,
    *,
    world_size: int | None = None,
    auto: AutoChoice | None = None,
    checkpointing: CheckpointingChoice | None = None,
    max_positions: int | None = None,
    resume_from: Path | None = None,
) -> RunSpec:
    """Decide everything about a run, without judging it (:func:`rule_problems` does).

    Args:
        world_size: ranks to plan for (default :func:`wanted_world_size`).
        auto: the planner's answer for `strategy: auto` (default :meth:`AutoChoice.default`).
        checkpointing: the planner's answer for `model.gradient_checkpointing: auto` (default
            :meth:`CheckpointingChoice.unplanned`: on).
        max_positions: the model's position limit, where the caller read it.
        resume_from: the checkpoint `training.resume` points at, where the caller found it.
    """
    w = world_size if world_size is not None else wanted_world_size(cfg, env)
    d = cfg.distributed
    strategy, zero, off_opt, off_par, reason = (
        d.strategy,
        d.zero_stage,
        d.offload_optimizer,
        d.offload_params,
        "configured",
    )
    mesh = mesh_for(d, w)
    if strategy == "auto" and mesh.model_parallel:
        strategy, reason = MESH_STRATEGY, f"{mesh.describe()}: the mesh's data dimension is FSDP2 sharding"
    elif strategy == "auto":
        choice = auto or AutoChoice.default(w)
        strategy, reason = choice.strategy, choice.reason
        zero = choice.zero_stage or zero
        off_opt, off_par = choice.offload_optimizer or off_opt, choice.offload_params or off_par
    training = cfg.training
    if env.restart_count > 0 and training.resume is None:
        # torchrun restarted the job after a failure: continue from the latest checkpoint.
        training = training.model_copy(update={"resume": "auto"})
    dist = d.model_copy(
        update={"strategy": strategy, "zero_stage": zero, "offload_optimizer": off_opt, "offload_params": off_par}
    )
    model, ckpt_reason = cfg.model, "configured"
    if model.gradient_checkpointing == "auto":
        ckpt = checkpointing or CheckpointingChoice.unplanned()
        model, ckpt_reason = model.model_copy(update={"gradient_checkpointing": ckpt.enabled}), ckpt.reason
    resolved = cfg.model_copy(update={"distributed": dist, "training": training, "model": model})
    stages = tuple(resolve_stages(resolved))
    batch = batch_arithmetic(training, mesh.data_shard, stages[0].data.max_seq_length, mesh)
    return RunSpec(
        config=resolved,
        env=env,
        world_size=w,
        strategy=strategy,
        zero_stage=zero,
        offload_optimizer=off_opt,
        offload_params=off_par,
        requested=d.strategy,
        reason=reason,
        precision=precision_for(resolved, env, strategy),
        batch=batch,
        stages=stages,
        resume_from=resume_from,
        max_positions=max_positions,
        mesh=mesh,
        checkpointing_reason=ckpt_reason,
    )


ChooseAuto = Callable[[RunSpec], AutoChoice]
ChooseCheckpointing = Callable[[RunSpec], CheckpointingChoice]


def resolve(
    cfg: Config | LoadedConfig,
    env: DistributedEnv,
    *,
    choose_auto: ChooseAuto | None = None,
    choose_checkpointing: ChooseCheckpointing | None = None,
    world_size: int | None = None,
    max_positions: int | None = None,
    resume_from: Path | None = None,
    check: bool = True,
) -> RunSpec:
    """Decide the run and check every rule; raise one error naming every problem.

    Args:
        cfg: a config, or what :func:`scaletune.config.read_config` read (its schema problems are
            reported with the rules' problems, each with its file:line).
        choose_auto: the planner (:func:`scaletune.plan.choose_auto`), asked with the run decided
            as `AutoChoice.default` when `strategy` is `auto`.
        choose_checkpointing: the planner (:func:`scaletune.plan.choose_checkpointing`), asked with
            the run decided (its strategy chosen) when `model.gradient_checkpointing` is `auto`.
        world_size, max_positions, resume_from: see :func:`decide`.
        check: False skips the rules (the doctor shows them as checks); schema problems still raise.

    Raises:
        ConfigError: every schema and rule problem.
    """
    loaded = cfg if isinstance(cfg, LoadedConfig) else None
    base = loaded.best_effort if loaded is not None else cfg
    problems = list(loaded.problems) if loaded is not None else []
    if base is None:
        raise ConfigError(problems, title="invalid config")
    assert isinstance(base, Config)
    kwargs = {"world_size": world_size, "max_positions": max_positions, "resume_from": resume_from}
    # `gradient_checkpointing: auto` is on while the strategy is chosen (the fastest that fits with
    # it), then turned off where that strategy fits without it.
    spec = decide(base, env, **kwargs)
    auto = None
    if base.distributed.strategy == "auto" and choose_auto is not None and not problems:
        auto = choose_auto(spec)
        spec = decide(base, env, auto=auto, **kwargs)
    if base.model.gradient_checkpointing == "auto" and choose_checkpointing is not None and not problems:
        spec = decide(base, env, auto=auto, checkpointing=choose_checkpointing(spec), **kwargs)
    for p in rule_problems(spec) if check else []:
        problems.append(p.text(loaded.where(p.key) if loaded is not None else None))
    if problems:
        raise ConfigError(problems, title="invalid config")
    return spec


def steps_for(num_global_batches_per_epoch: int, training: TrainingConfig) -> int:
    """Optimizer steps of a stage: `max_steps` if set, else `ceil(epochs x batches per epoch)`."""
    if training.max_steps is not None:
        return training.max_steps
    return max(1, math.ceil(training.epochs * num_global_batches_per_epoch))
