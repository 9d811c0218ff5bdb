"""Checks of the launch and of the packages and devices a run needs, each OK / WARN / FAIL with its
fix. Config rules are not repeated here: the checks that concern them show what
:func:`scaletune.resolve.rule_problems` finds on the resolved run.

Stale distributed variables. `DistributedEnv` calls a process with `RANK`/`WORLD_SIZE` but no
torchrun (`TORCHELASTIC_RUN_ID`) or deepspeed-launcher marker launcher `env` (accelerate, mpirun
wrappers and hand-set variables look like that). Such a process is a real rank only if it can
reach the rendezvous, so: `WORLD_SIZE > 1` without `MASTER_ADDR` or `MASTER_PORT` is fatal (a
stale `WORLD_SIZE` exported by another job, or a half-set environment: `init_process_group` would
fail or wait for peers that never come); inside a SLURM step whose task count disagrees with
`WORLD_SIZE` it is fatal too (variables left over from another job); `WORLD_SIZE` of 1 or
`MASTER_*` alone without a launcher is a warning (harmless here, surprising later).
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Literal

from scaletune.env import DistributedEnv
from scaletune.strategies.deepspeed_config import steps_with_cpu_adam

if TYPE_CHECKING:
    from scaletune.resolve import Problem, RunSpec

Status = Literal["OK", "WARN", "FAIL"]


@dataclass(frozen=True)
class Check:
    """One check's outcome. `fatal`: preflight stops the run (only with status FAIL)."""

    name: str
    status: Status
    message: str
    fix: str = ""
    fatal: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def ok(name: str, message: str) -> Check:
    return Check(name, "OK", message)


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_launcher_vars(env: DistributedEnv, environ: Mapping[str, str]) -> Check:
    name = "distributed variables"
    if env.launcher in ("torchrun", "deepspeed", "srun"):
        return ok(name, f"started by {env.launcher}: rank {env.rank} of {env.world_size}")
    fix = "unset RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT, or start the job with torchrun / scaletune launch"
    if env.launcher == "env":
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(v)]
        slurm_tasks = environ.get("SLURM_NTASKS")
        if env.world_size > 1 and missing:
            return Check(
                name,
                "FAIL",
                f"WORLD_SIZE={env.world_size} (RANK={environ.get('RANK', 'unset')}) is set but no launcher started "
                f"this process and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: a stale "
                "variable from another job or shell, and the run would wait for peers that never come",
                fix,
                fatal=True,
            )
        if env.world_size > 1 and slurm_tasks and "SLURM_STEP_ID" in environ and slurm_tasks.isdigit():
            if int(slurm_tasks) != env.world_size and int(slurm_tasks) != env.world_size // max(
                1, env.local_world_size
            ):
                return Check(
                    name,
                    "FAIL",
                    f"WORLD_SIZE={env.world_size} disagrees with this SLURM step's {slurm_tasks} task(s): "
                    "variables left over from another job",
                    fix + " (under srun let scaletune read SLURM_PROCID/SLURM_NTASKS)",
                    fatal=True,
                )
        if env.world_size > 1:
            return ok(
                name,
                f"RANK/WORLD_SIZE set by an external launcher: rank {env.rank} of {env.world_size}, "
                f"rendezvous {environ.get('MASTER_ADDR')}:{environ.get('MASTER_PORT')}",
            )
        return Check(
            name,
            "WARN",
            f"distributed variables ({', '.join(v for v in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE') if v in environ)}) are set "
            "without a launcher at world size 1: probably left over; device_map is ignored while they are set",
            fix,
        )
    stray = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v in environ]
    if stray:
        return Check(name, "WARN", f"{' and '.join(stray)} set without a launcher (harmless for one process)", fix)
    return ok(name, "no launcher: one process")


def _rule(spec: RunSpec | None, *groups: str) -> Problem | None:
    """The first problem the resolve rules find in these groups (one implementation of each rule:
    the doctor shows them, it does not repeat them)."""
    from scaletune.resolve import rule_problems

    if spec is None:
        return None
    return next((p for p in rule_problems(spec) if p.check in groups), None)


def _fail(p: Problem) -> Check:
    return Check(p.check, "FAIL", p.message, p.fix, fatal=True)


def check_processes_vs_gpus(env: DistributedEnv, spec: RunSpec | None, environ: Mapping[str, str]) -> Check:
    name = "processes per GPU"
    visible = environ.get("CUDA_VISIBLE_DEVICES", "unset")
    if env.cuda_available:
        if env.launched and env.local_world_size > env.cuda_device_count:
            return Check(
                name,
                "FAIL",
                f"{env.local_world_size} processes on this node but {env.cuda_device_count} visible GPU(s) "
                f"(CUDA_VISIBLE_DEVICES={visible}): ranks would share a GPU (NCCL 'Duplicate GPU detected')",
                f"start at most {env.cuda_device_count} processes per node (--nproc_per_node {env.cuda_device_count})",
                fatal=True,
            )
        bad = _rule(spec, name)
        if bad is not None:
            return _fail(bad)
        return ok(
            name, f"{env.local_world_size if env.launched else 1} process(es), {env.cuda_device_count} GPU(s) visible"
        )
    return ok(name, f"no GPU: {env.local_world_size} CPU process(es) on this node (gloo)")


def check_cpu_threads(
    env: DistributedEnv, spec: RunSpec | None, environ: Mapping[str, str], *, load: float | None = None
) -> Check:
    """A CPU run's threads against the cores it may use (:class:`scaletune.env.CpuBudget`): WARN when
    the ranks' threads outnumber the cores (`OMP_NUM_THREADS` set too high for the ranks) or when
    other processes already keep the cores busy (1-minute load average, `load` or
    `os.getloadavg`, at or above the cores): threads that find no free core spin against each other
    and a CPU run crawls."""
    from scaletune.env import cpu_budget

    name = "CPU threads"
    if env.cuda_available:
        return ok(name, "the ranks compute on GPUs")
    ranks = env.local_world_size if env.launched else (spec.world_size if spec is not None else 1)
    budget = cpu_budget(ranks, environ)
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # no load average on this platform
            load = 0.0
    problems, fixes = [], []
    if budget.oversubscribed:
        problems.append(
            f"{budget.ranks} rank(s) x OMP_NUM_THREADS {budget.threads} = {budget.ranks * budget.threads} "
            f"threads on {budget.cores} cores"
        )
        fixes.append(
            f"unset OMP_NUM_THREADS (scaletune gives each rank cores // ranks threads) or set it to "
            f"{max(1, budget.cores // budget.ranks)}"
        )
    if load >= budget.cores:
        problems.append(f"load average {load:.1f} on {budget.cores} cores: other processes are using them")
        fixes.append("train when the machine is idle, or with fewer ranks or threads (OMP_NUM_THREADS)")
    if problems:
        return Check(name, "WARN", "; ".join(problems) + "; a CPU run will be slow", fix="; ".join(fixes))
    return ok(name, budget.describe())


def check_device_map(env: DistributedEnv, spec: RunSpec | None) -> Check:
    name = "device_map"
    device_map = spec.config.model.device_map if spec is not None else None
    if device_map is None:
        return ok(name, "no device_map")
    if env.launched:
        return Check(
            name,
            "WARN",
            f"model.device_map={device_map} under a launcher ({env.launcher}): it is set aside, each rank loads "
            "its replica or shard on its own device",
            "drop model.device_map when training with several processes",
        )
    return ok(name, f"device_map {device_map} in one process")


def check_quantization(env: DistributedEnv, spec: RunSpec | None) -> list[Check]:
    """A CUDA GPU and bitsandbytes (this machine), then what the resolve rules say of the strategy."""
    q = spec.config.model.quantization if spec is not None else None
    if spec is None or q is None:
        return [ok("quantization", "no quantization")]
    out = []
    if not env.cuda_available:
        out.append(
            Check(
                "quantization",
                "FAIL",
                f"model.quantization ({q.bits}-bit bitsandbytes) needs a CUDA GPU and none is visible",
                "drop model.quantization (LoRA on unquantized weights) or run on a GPU machine",
                fatal=True,
            )
        )
    elif installed_version("bitsandbytes") is None:
        out.append(
            Check(
                "quantization",
                "FAIL",
                "model.quantization needs bitsandbytes, which is not installed",
                "pip install 'scaletune[gpu]'",
                fatal=True,
            )
        )
    else:
        out.append(ok("quantization", f"{q.bits}-bit on GPU with bitsandbytes {installed_version('bitsandbytes')}"))
    bad = _rule(spec, "quantization strategy", "quantization storage dtype")
    out.append(
        _fail(bad) if bad else ok("quantization strategy", f"{q.bits}-bit weights with strategy {spec.strategy_label}")
    )
    return out


def check_liger(env: DistributedEnv, spec: RunSpec | None) -> Check:
    """`model.liger` needs a CUDA GPU (Liger's kernels are Triton GPU kernels) and liger-kernel;
    checked without importing it. Its clash with ZeRO-3 is a resolve rule."""
    name = "liger"
    if spec is None or not spec.config.model.liger:
        return ok(name, "model.liger off")
    if not env.cuda_available:
        return Check(
            name,
            "FAIL",
            "model.liger (Liger's Triton kernels) needs a CUDA GPU and none is visible",
            "set model.liger: false (the built-in chunked loss runs on any device) or run on a GPU machine",
            fatal=True,
        )
    if installed_version("liger-kernel") is None:
        return Check(
            name,
            "FAIL",
            "model.liger needs liger-kernel, which is not installed",
            "pip install 'scaletune[liger]'",
            fatal=True,
        )
    return ok(name, f"Liger kernels on GPU with liger-kernel {installed_version('liger-kernel')}")


def check_wandb(spec: RunSpec | None) -> Check:
    """`logging.wandb` needs the wandb package (checked without importing it)."""
    name = "wandb"
    if spec is None or spec.config.logging.wandb is None:
        return ok(name, "logging.wandb off")
    if installed_version("wandb") is None:
        return Check(
            name,
            "FAIL",
            "logging.wandb needs the wandb package, which is not installed",
            "pip install 'scaletune[wandb]'",
            fatal=True,
        )
    return ok(name, f"wandb {installed_version('wandb')}, project {spec.config.logging.wandb.project}")


def check_mlflow(spec: RunSpec | None) -> Check:
    """`logging.mlflow` needs an importable `mlflow` (mlflow-skinny or mlflow; found, not imported)."""
    import importlib.util

    name = "mlflow"
    if spec is None or spec.config.logging.mlflow is None:
        return ok(name, "logging.mlflow off")
    try:
        found = importlib.util.find_spec("mlflow") is not None
    except (ImportError, ValueError):  # a broken or half-imported package
        found = False
    if not found:
        return Check(
            name,
            "FAIL",
            "logging.mlflow needs the mlflow package, which is not installed",
            "pip install 'scaletune[mlflow]'",
            fatal=True,
        )
    version = installed_version("mlflow-skinny") or installed_version("mlflow") or "(version unknown)"
    return ok(name, f"mlflow {version}")


def check_checkpointing(env: DistributedEnv, spec: RunSpec | None) -> Check:
    """DDP + LoRA + reentrant checkpointing fails with 'Expected to mark a variable ready only once'.
    Guards scaletune's own default: the checkpointing it enables must stay non-reentrant."""
    import inspect

    from scaletune import models

    name = "checkpointing under ddp"
    m = spec.config.model if spec is not None else None
    if spec is None or m is None or m.lora is None or not m.gradient_checkpointing:
        return ok(name, "not LoRA with gradient checkpointing")
    if spec.strategy != "ddp":
        return ok(name, f"strategy {spec.strategy}")
    default = inspect.signature(models.enable_gradient_checkpointing).parameters["use_reentrant"].default
    if default is not False:
        return Check(
            name,
            "FAIL",
            "LoRA with gradient checkpointing under DDP with reentrant checkpointing: backward fails with "
            "'Expected to mark a variable ready only once'",
            "use non-reentrant checkpointing (use_reentrant=False)",
            fatal=True,
        )
    return ok(name, "LoRA + checkpointing under ddp uses non-reentrant checkpointing")


def check_batch(spec: RunSpec | None) -> Check:
    name = "batch arithmetic"
    if spec is None:
        return ok(name, "no config")
    bad = _rule(spec, name)
    return _fail(bad) if bad else ok(name, spec.batch.describe())


def check_deepspeed_ops(spec: RunSpec | None, builders: list[str] | None = None) -> Check:
    """DeepSpeed imports, and the ops this run needs can be built here (`OpBuilder.is_compatible()`)."""
    name = "deepspeed ops"
    if builders is None:
        if spec is None or spec.strategy != "deepspeed":
            return ok(name, "DeepSpeed not used")
        builders = ["CPUAdamBuilder"] if steps_with_cpu_adam(spec) else []
    try:
        import deepspeed  # noqa: F401 - importable, not only installed (a broken build fails here)
    except ImportError:
        return Check(
            name,
            "FAIL",
            "distributed.strategy deepspeed needs DeepSpeed: pip install 'scaletune[deepspeed]' "
            "(or choose ddp or fsdp)",
            fatal=True,
        )
    if not builders:
        return ok(name, f"deepspeed {installed_version('deepspeed')}; no custom op needed")
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        bad = []
        for b in builders:
            builder = acc.create_op_builder(b)
            if builder is None or not builder.is_compatible(verbose=False):
                bad.append(b)
    except Exception as exc:  # noqa: BLE001 - any failure here means the op cannot be built
        return Check(
            name,
            "FAIL",
            f"DeepSpeed ops cannot be checked: {type(exc).__name__}: {exc}",
            "reinstall deepspeed matching this torch/CUDA (`ds_report`)",
            fatal=True,
        )
    if bad:
        return Check(
            name,
            "FAIL",
            f"DeepSpeed op(s) {', '.join(bad)} cannot be built on this machine ({acc.device_name()})",
            "run `ds_report` and install the missing toolchain (a C++ compiler, libaio-dev, the CUDA toolkit), or drop the offload",
            fatal=True,
        )
    return ok(name, f"{', '.join(builders)} compatible ({acc.device_name()})")


def check_mesh(spec: RunSpec | None) -> list[Check]:
    """The device mesh: the config's rules on the degrees (`resolve.mesh.mesh_problems`, through
    the resolve rules) and the model's (`resolve.mesh.model_mesh_problems`: heads, key-value heads
    and MLP width against the degrees, windowed attention), read from the model's config."""
    name = "device mesh"
    if spec is None or not spec.mesh.model_parallel:
        return [ok(name, "no tensor, context or pipeline parallelism")]
    from scaletune.resolve import rule_problems

    out = [_fail(p) for p in rule_problems(spec) if p.check == name]
    if spec.custom_model:
        out.append(Check(name, "WARN", "a factory's module has no tensor or context layout", "use degrees of 1"))
        return out
    from scaletune.models import load_config
    from scaletune.resolve.mesh import model_mesh_problems

    try:
        hf_config = load_config(spec.config.model)
    except Exception as exc:  # noqa: BLE001 - an unreachable config is reported, the run's start checks again
        out.append(
            Check(
                name,
                "WARN",
                f"the model's config cannot be read here ({type(exc).__name__}): its heads and MLP width are not checked "
                "against the degrees",
                "run the doctor where the model is reachable",
            )
        )
        return out
    out += [_fail(p) for p in model_mesh_problems(spec.mesh, hf_config)]
    return out or [ok(name, f"{spec.mesh.describe()}; the model's heads and MLP width split evenly")]
