"""The one preflight of `scaletune train`: :func:`prepare` resolves a run with every check before
anything is written; :func:`check_data` tokenises the data once before ranks start;
:func:`predicted_memory` is the planner's entry written as `plan.json`.

:func:`prepare` is the one place a run is resolved for training: the config (schema and rules,
with `strategy: auto` decided by the planner), the model's facts, the checkpoint to resume, the
environment (the doctor's fatal checks), the data sources and the run directory are all checked
before anything is written, and every problem is reported in one error (exit 2).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from scaletune.config import Config, LoadedConfig
from scaletune.env import DistributedEnv, print0
from scaletune.errors import Problem, UserError, texts
from scaletune.resolve import RunSpec, decide, resolve


def _model_positions(cfg: Config, problems: list[str], *, config_valid: bool = True) -> int | None:
    if cfg.model.factory is not None:
        return None  # a factory's module has no config.json; its preflight is factorycheck's
    if not config_valid:
        # A config that does not validate stops the run anyway: say whether the model is there and
        # how long its positions are from the file system alone. Loading its config and scanning its
        # weights need torch and transformers (4 s of CPU before a typo is answered); that is done
        # once the config is valid.
        from scaletune.models.introspection import max_positions
        from scaletune.models.loading import local_config_json, source_problem

        found = source_problem(cfg.model.name_or_path, "model.name_or_path", need_config=True)
        if found:
            problems.append(found)
            return None
        on_disk = local_config_json(cfg.model.name_or_path)
        return max_positions(on_disk) if on_disk is not None else None
    from scaletune.models.checks import model_facts

    positions, found = model_facts(cfg.model)
    problems += found
    return positions


def _mesh_model_problems(spec: RunSpec) -> list[Problem]:
    """The model's shape against the device mesh (heads, key-value heads, MLP width, windowed attention)."""
    from scaletune.models.loading import load_config
    from scaletune.resolve.mesh import model_mesh_problems

    if not spec.mesh.model_parallel or spec.custom_model:
        return []
    try:
        hf_config = load_config(spec.config.model)
    except Exception:  # noqa: BLE001 - model_facts has reported why the config cannot be read
        return []
    return model_mesh_problems(spec.mesh, hf_config)


def prepare(
    cfg: Config | LoadedConfig,
    env: DistributedEnv,
    environ: Mapping[str, str] | None = None,
    *,
    world_size: int | None = None,
    here: bool = True,
) -> RunSpec:
    """Resolve and check a run; nothing is written.

    Args:
        env: the environment the run is decided for: this process's, or the machine a launcher
            elsewhere starts it on (`plan.target_env`: a SLURM node, a Modal container).
        world_size: the job's ranks where that launcher decides them (default: `wanted_world_size`).
        here: False for a run another machine starts: this machine's checks (GPU, packages,
            launcher variables, disk, port) say nothing of that one's and are skipped.

    Raises:
        UserError: (exit 2) every problem of the config, model, checkpoint, environment, data and
            run directory, each once; for `model.factory` / `data.factory` runs and stage patterns
            also those of :func:`scaletune.plan.factory_check.factory_problems` (imports, types, the
            forward's output, patterns that match nothing).
    """
    from scaletune.data import validate_data
    from scaletune.plan import choose_auto, choose_checkpointing

    loaded = cfg if isinstance(cfg, LoadedConfig) else None
    base = loaded.best_effort if loaded is not None else cfg
    where = loaded.where if loaded is not None else (lambda key: None)
    problems: list[str] = []
    valid = loaded is None or not loaded.problems
    positions = _model_positions(base, problems, config_valid=valid) if base is not None else None
    spec = None
    # The config's own problems alone are headed as `launch`, `plan` and `config show` head them
    # ("invalid config"); with the model's, data's or machine's, "cannot start training".
    config_title = None
    try:
        spec = resolve(
            cfg,
            env,
            choose_auto=choose_auto,
            choose_checkpointing=choose_checkpointing,
            world_size=world_size,
            max_positions=positions,
        )
    except UserError as exc:
        config_title = exc.title if not problems else None
        problems = exc.problems + problems
    # The data are checked even when the config is not valid: one message, not one run each.
    probe = spec or (decide(base, env, world_size=world_size, max_positions=positions) if base is not None else None)
    for stage in probe.stages if probe is not None else ():
        try:
            validate_data(stage.data)
        except UserError as exc:
            config_title = None
            problems += [p for p in exc.problems if p not in problems]
    if spec is None:
        raise UserError(problems, title=config_title or "cannot start training")
    # Imported only for a valid config: the checkpoint package imports torch (a typo is answered without it).
    from scaletune.checkpoint import resolve_resume
    from scaletune.plan.factory_check import factory_problems
    from scaletune.run.rundir import run_dir_problems

    try:
        spec = dataclasses.replace(spec, resume_from=resolve_resume(spec.config, spec.run_dir))
    except UserError as exc:
        problems += exc.problems
    problems += _check_environment(spec, environ) if here else []
    problems += _check_engine_config(spec)
    problems += texts(factory_problems(spec))
    problems += [p.text(where(p.key)) for p in _mesh_model_problems(spec)]
    if env.is_main:  # rank 0 alone decides: it may already have created the directory
        problems += [p.text(where(p.key)) for p in run_dir_problems(spec)]
    if problems:
        raise UserError(problems, title="cannot start training")
    _print_decisions(spec)
    return spec


def _check_engine_config(spec: RunSpec) -> list[str]:
    """DeepSpeed: the engine's config generated once, so a disagreeing user JSON is reported here."""
    if spec.strategy != "deepspeed":
        return []
    from scaletune.strategies.deepspeed_config import engine_config

    try:
        engine_config(spec)
    except UserError as exc:
        return exc.problems
    return []


def _check_environment(spec: RunSpec, environ: Mapping[str, str] | None) -> list[str]:
    """This machine's problems for the run (the doctor's fatal checks); its warnings printed."""
    from scaletune.doctor import environment_problems

    warnings: list = []
    problems = [p.text() for p in environment_problems(spec, environ, warn=warnings)]
    for w in warnings:
        print0(f"[scaletune] warning: {w.name}: {w.message}" + (f" (fix: {w.fix})" if w.fix else ""))
    return problems


def _print_decisions(spec: RunSpec) -> None:
    """What `auto` became, and why: the strategy and gradient checkpointing."""
    print0(f"[scaletune] distributed.strategy {spec.requested} -> {spec.strategy_label}: {spec.reason}")
    if spec.checkpointing_reason != "configured":
        on = "on" if spec.config.model.gradient_checkpointing else "off"
        print0(f"[scaletune] model.gradient_checkpointing auto -> {on}: {spec.checkpointing_reason}")


def predicted_memory(spec: RunSpec) -> dict | None:
    """The planner's entry for the run's strategy (written as plan.json), or None for a layout the
    planner does not model."""
    from scaletune.plan import plan

    try:
        p = plan(spec)
        entry = p.for_run(spec).to_json()
        if p.shape is not None and p.shape.stage is not None:
            entry["stage"] = p.shape.stage  # the stage planned for: the one training the most
        if p.rollout is not None:  # online RL's generation: the engine colocated with training fits or not
            entry["rollout"] = {**p.rollout.to_json(), "colocate_fits": entry["fits"]}
        return entry
    except (KeyError, UserError, ValueError) as exc:
        print0(f"[scaletune] no memory plan for this run: {exc}")
        return None


def data_tokenizer(spec: RunSpec):
    """The tokenizer or processor the ranks build the data with (`trainer.Trainer.load_model_and_data`):
    for `model.factory`, the one its factory returns (built here on the meta device), else
    `model.tokenizer`'s, else None; for a Hugging Face model, `model.tokenizer` or the model's own.

    Raises:
        UserError: the model factory's problems (import, arguments, type).
    """
    if spec.custom_model:
        from scaletune.plan.factory_check import meta_loss

        return meta_loss(spec)[1]
    from scaletune.models import load_tokenizer

    return load_tokenizer(spec.config.model)


def check_data(spec: RunSpec) -> None:
    """Build every stage's data here (tokenise, pack, cache; or call its `data.factory`) and raise
    what stops training.

    Raises:
        UserError: a data problem found only by building the data (every response truncated away, a
            chat template that fails, a data factory's result refused, fewer sequences than one
            global batch).
    """
    from scaletune.trainer.stages import data_problems

    processor = None
    if not spec.custom_model:
        from scaletune.models.loading import model_processor

        processor = model_processor(spec.config.model)
    problems = data_problems(spec, data_tokenizer(spec), processor)
    if problems:
        raise UserError(problems, title="cannot start training")
