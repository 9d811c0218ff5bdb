"""A run's stages made concrete: each stage's data built (rank 0 tokenizes first), its step count and
learning-rate horizon known before the first step, and its loaders positioned where a resumed run
continues."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from scaletune.config.preference import OBJECTIVES
from scaletune.env import print0
from scaletune.errors import Problem, UserError, problems_of
from scaletune.resolve import BatchArithmetic, RunSpec, Stage, steps_for

if TYPE_CHECKING:
    from scaletune.checkpoint import Progress
    from scaletune.strategies.protocol import LoopStrategy


@dataclass
class StagePlan:
    """A stage with its data built and its step counts known."""

    stage: Stage
    batch: BatchArithmetic
    bundle: Any  # data.DataBundle
    steps_per_epoch: int
    total: int  # optimizer steps of this stage
    schedule_steps: int  # steps the learning-rate schedule spans (longer when later stages continue it)
    schedule_origin: int  # index of the stage whose schedule this one runs on (itself unless continuing)


def _build_stage_data(stage: Stage, tokenizer: Any, seed: int, processor: Any = None) -> Any:
    """The stage's data: `data.build_custom_data` for a stage with a `data.factory`, else
    `data.build_datasets` (through a vision-language model's `processor` where there is one)."""
    from scaletune.data import build_custom_data, build_datasets

    if stage.data.factory is not None:
        return build_custom_data(stage.data, tokenizer, seed=seed)
    return build_datasets(stage.data, tokenizer, seed=seed, processor=processor)


def build_turn(env: Any) -> tuple[int, int]:
    """(this rank's turn, the number of turns) in building a stage's data (`env`: a DistributedEnv).

    Turn 0: global rank 0 alone (tokenizing into the datasets cache, or a data factory downloading
    or caching what it reads). On several nodes, turn 1: each other node's first rank (local rank
    0), because the cache is node-local by default (~/.cache): without it every rank of a second
    node would tokenize into the same cache files at once. Last turn: every other rank, reading
    what its node's first rank left.
    """
    nodes = env.world_size > env.local_world_size
    if env.is_main:
        return 0, 3 if nodes else 2
    if nodes:
        return (1 if env.local_rank == 0 else 2), 3
    return 1, 2


def _build_data(stage: Stage, tokenizer: Any, spec: RunSpec, strategy: LoopStrategy, processor: Any = None) -> Any:
    """Build the stage's data in the turns of :func:`build_turn`, every rank waiting between turns
    (with a vision-language model's `processor`: `data.build_datasets`' vision rows)."""
    bundle = None
    mine, turns = build_turn(spec.env)
    for turn in range(turns):
        if turn == mine:
            bundle = _build_stage_data(stage, tokenizer, spec.config.seed, processor)
        if turn < turns - 1:
            strategy.barrier()
    return bundle


def _unit(stage: Stage) -> str:
    """What a stage's batch sizes count: sequences, or (preference objectives) pairs, KTO's records,
    prompts (grpo, on-policy distillation)."""
    t = stage.training
    return OBJECTIVES["grpo" if t.sampling is not None else t.objective].batch_counts


def _too_small(stage: Stage, rows: int, batch: BatchArithmetic) -> str | None:
    if rows >= batch.global_batch_size:
        return None
    return (
        f"stage {stage.name}: {rows} training {_unit(stage)} are fewer than one global batch "
        f"({batch.global_batch_size}); add data or lower training.global_batch_size"
    )


def vision_problems(spec: RunSpec) -> list[Problem]:
    """What a vision-language model's run cannot do yet (issue 37's first slice), each named: packed
    rows (a pack would need every record's image tensors), a model-parallel mesh (tensor, context or
    pipeline degrees: the plans are the language model's), an objective other than sft."""
    check = "vision-language model"
    problems = []
    if spec.mesh is not None and spec.mesh.model_parallel:
        problems.append(
            Problem(
                check,
                "distributed",
                "distributed: a vision-language model trains on data-parallel engines only (ddp, fsdp, "
                "deepspeed): set the tensor, context and pipeline degrees to 1",
            )
        )
    for stage in spec.stages:
        at = f"stages.{stage.index}." if spec.config.stages else ""
        if stage.data.packing:
            problems.append(
                Problem(
                    check,
                    f"{at}data.packing",
                    f"{at}data.packing: a vision-language model's records are not packed (not built): set it false",
                )
            )
        if stage.training.objective != "sft":
            problems.append(
                Problem(
                    check,
                    f"{at}training.objective",
                    f"{at}training.objective {stage.training.objective!r}: a vision-language model trains with sft only here",
                )
            )
    return problems


def data_problems(spec: RunSpec, tokenizer: Any, processor: Any = None) -> list[Problem]:
    """Build every stage's data in this process (filling the cache the ranks then read; a
    `data.factory` is called as the ranks will call it, with `tokenizer`; a vision-language model's
    through its `processor`) and say what stops training: for a parent that starts the ranks, so
    bad data ends in one message and exit 2 rather than in every rank."""
    problems: list[Problem] = vision_problems(spec) if processor is not None else []
    if problems:
        return problems
    for stage in spec.stages:
        try:
            bundle = _build_stage_data(stage, tokenizer, spec.config.seed, processor)
        except UserError as exc:
            problems += [p for p in problems_of(exc, "data") if p not in problems]
            continue
        small = _too_small(stage, len(bundle.train), spec.batch_for(stage))
        problems += [Problem("data", None, small)] if small else []
        if stage.training.objective == "grpo":
            problems += reward_problems(spec, stage, bundle, tokenizer)
        if stage.training.objective == "distill":
            problems += teacher_problems(spec, stage, tokenizer)
    return problems


def teacher_problems(spec: RunSpec, stage: Stage, tokenizer: Any) -> list[Problem]:
    """A distill stage's teacher has the student's tokenizer (the same vocabulary, token for token)
    and head size: their distributions are compared over the same token ids."""
    from scaletune.models import load_config, load_tokenizer

    teacher = stage.training.distill.teacher
    if not teacher:
        return []  # resolve.rules says so
    key = "training.distill.teacher" if not spec.config.stages else f"stages.{stage.index}.training.distill.teacher"
    m = spec.config.model
    teacher_cfg = m.model_copy(update={"name_or_path": teacher, "tokenizer": None, "lora": None, "quantization": None})
    try:
        theirs = load_tokenizer(teacher_cfg).get_vocab()
        sizes = {name: load_config(c).vocab_size for name, c in (("teacher", teacher_cfg), ("student", m))}
    except UserError as exc:
        return [Problem("objective", key, f"{key} {teacher}: {p.message}") for p in problems_of(exc, "objective")]
    ours = tokenizer.get_vocab()
    if theirs != ours:
        differ = sorted(set(theirs.items()) ^ set(ours.items()), key=lambda kv: kv[1])[:3]
        return [
            Problem(
                "objective",
                key,
                f"{key} {teacher} has another tokenizer than the model trained ({len(theirs):,} tokens against "
                f"{len(ours):,}; differing entries: {', '.join(repr(k) for k, _ in differ)}): distillation compares "
                "their predictions token id by token id",
                "pick a teacher of the same model family (the same tokenizer)",
            )
        ]
    if sizes["teacher"] != sizes["student"]:
        return [
            Problem(
                "objective",
                key,
                f"{key} {teacher} predicts over {sizes['teacher']:,} token ids, the model trained over "
                f"{sizes['student']:,} (config vocab_size): their distributions cannot be compared",
                "pick a teacher whose vocab_size equals the model's",
            )
        ]
    return []


def reward_problems(spec: RunSpec, stage: Stage, bundle: Any, tokenizer: Any) -> list[Problem]:
    """A grpo stage's reward functions imported and called once on its first prompt (with that
    record's fields), so a function that cannot score ends in exit 2 before training
    (`rewards.scoring.check_rewards`)."""
    import json

    from scaletune.rewards.scoring import check_rewards, load_rewards

    prefix = "training.rl.rewards" if not spec.config.stages else f"stages.{stage.index}.training.rl.rewards"
    specs = [(r.function, r.weight, r.kwargs) for r in stage.training.rl.rewards]
    try:
        rewards = load_rewards(specs, prefix=prefix)
    except UserError as exc:
        return problems_of(exc, "objective")
    first = bundle.train[0]
    prompt = tokenizer.decode(first["prompt_ids"])
    return check_rewards(rewards, prompt, json.loads(first["fields"]), prefix=prefix, prompt_index=first["index"])


def plan_stages(spec: RunSpec, tokenizer: Any, strategy: LoopStrategy, processor: Any = None) -> list[StagePlan]:
    """Build every stage's data before the model loads (bad data fails early) and count its steps
    (a vision-language model's data through its `processor`).

    Raises:
        UserError: a stage with fewer sequences than one global batch.
    """
    from scaletune.data.build import describe_stats

    bad = vision_problems(spec) if processor is not None else []
    if bad:
        raise UserError(bad, title="cannot start training")
    plans: list[StagePlan] = []
    for stage in spec.stages:
        batch = spec.batch_for(stage)
        bundle = _build_data(stage, tokenizer, spec, strategy, processor)
        small = _too_small(stage, len(bundle.train), batch)
        if small:
            raise UserError(small, title="cannot start training")
        if stage.training.objective == "grpo":  # before the model loads (a parent checked them too)
            bad = reward_problems(spec, stage, bundle, tokenizer)
            if bad:
                raise UserError(bad, title="invalid reward functions")
        if stage.training.objective == "distill":
            bad = teacher_problems(spec, stage, tokenizer)
            if bad:
                raise UserError(bad, title="cannot start training")
        steps_per_epoch = len(bundle.train) // batch.global_batch_size
        total = steps_for(steps_per_epoch, stage.training)
        origin = plans[-1].schedule_origin if (stage.continue_schedule and plans) else stage.index
        plans.append(StagePlan(stage, batch, bundle, steps_per_epoch, total, total, origin))
        print0(
            f"[scaletune] stage {stage.name}: {len(bundle.train)} {_unit(stage)}, {steps_per_epoch} steps per epoch, "
            f"{total} optimizer steps; {describe_stats(bundle.stats)}"
        )
    # A stage that continues the schedule extends the horizon of the stage that started it.
    for p in plans:
        if p.schedule_origin != p.stage.index:
            plans[p.schedule_origin].schedule_steps += p.total
    for p in plans:
        p.schedule_steps = plans[p.schedule_origin].schedule_steps
    return plans


def stage_collator(plan: StagePlan, tokenizer: Any) -> Any:
    """A data factory's collator; preference pairs (and KTO records): `PreferenceCollator`; else the text `Collator`."""
    from scaletune.data import Collator
    from scaletune.data.preference import PreferenceCollator

    if plan.bundle.collator is not None:
        return plan.bundle.collator
    source = plan.stage.data.train
    if source is not None and source.format == "prompt":
        from scaletune.data.prompts import PromptCollator

        return PromptCollator(tokenizer.pad_token_id)
    if source is not None and source.format in ("preference", "kto"):
        return PreferenceCollator(tokenizer.pad_token_id, source.format)
    return Collator(tokenizer.pad_token_id)


def stage_loaders(plan: StagePlan, spec: RunSpec, tokenizer: Any, start: Progress | None) -> tuple[Iterator, Any]:
    """(global batches from the stage's start or from `start`'s position, the eval loader or None)."""
    from scaletune.data import global_batches, make_eval_loader, make_loader

    collator = stage_collator(plan, tokenizer)
    stage, env = plan.stage, spec.env
    loader, sampler = make_loader(
        plan.bundle.train, collator, plan.batch, env, spec.config.seed, stage.data.num_workers
    )
    eval_loader = (
        make_eval_loader(plan.bundle.eval, collator, plan.batch, env) if plan.bundle.eval is not None else None
    )
    first_epoch, first_step = (start.epoch, start.step_in_epoch) if start is not None else (0, 0)
    return global_batches(loader, sampler, plan.batch, plan.steps_per_epoch, first_epoch, first_step), eval_loader
