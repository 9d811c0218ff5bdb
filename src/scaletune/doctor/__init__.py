"""The doctor: environment checks with fixes, the environment report and the communication test."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from scaletune.doctor.checks import (
    Check,
    Status,
    check_batch,
    check_checkpointing,
    check_cpu_threads,
    check_deepspeed_ops,
    check_device_map,
    check_launcher_vars,
    check_liger,
    check_mesh,
    check_mlflow,
    check_processes_vs_gpus,
    check_quantization,
    check_wandb,
)
from scaletune.doctor.checks import (
    installed_version as installed_version,
)
from scaletune.doctor.comm import comm_test, render_comm
from scaletune.doctor.report import render, report
from scaletune.doctor.system import DEFAULT_PORT, check_disk, check_nccl_env, check_port, port_free
from scaletune.env import DISTRIBUTED_VARS, DistributedEnv
from scaletune.errors import UserError

if TYPE_CHECKING:
    from scaletune.resolve import Problem, RunSpec

__all__ = [
    "DEFAULT_PORT",
    "Check",
    "Status",
    "check_batch",
    "check_checkpointing",
    "check_cpu_threads",
    "check_deepspeed_ops",
    "check_device_map",
    "check_disk",
    "check_launcher_vars",
    "check_liger",
    "check_mesh",
    "check_mlflow",
    "check_nccl_env",
    "check_port",
    "check_processes_vs_gpus",
    "check_quantization",
    "check_wandb",
    "checks",
    "comm_test",
    "environment_problems",
    "port_free",
    "preflight",
    "render",
    "render_comm",
    "report",
]

_SHOWN = {
    "processes per GPU",
    "quantization strategy",
    "quantization storage dtype",
    "batch arithmetic",
    "device mesh",
}


def _environment_checks(spec: RunSpec | None, env: DistributedEnv, e: Mapping[str, str]) -> list[Check]:
    """The checks of this machine and launch (no config rule among them)."""
    return [
        check_launcher_vars(env, e),
        check_device_map(env, spec),
        check_quantization(env, spec)[0],
        check_liger(env, spec),
        check_checkpointing(env, spec),
        check_deepspeed_ops(spec),
        check_wandb(spec),
        check_mlflow(spec),
        *check_nccl_env(env, e),
        check_disk(spec),
        check_port(env, e),
    ]


def checks(
    spec: RunSpec | None, env: DistributedEnv | None = None, environ: Mapping[str, str] | None = None
) -> list[Check]:
    """Every check in a fixed order: the environment's, with the resolve rules on the run shown
    as checks too (docs/plan.md lists them). `env` defaults to the run's."""
    from scaletune.resolve import rule_problems

    e = os.environ if environ is None else environ
    env = env or (spec.env if spec is not None else DistributedEnv.from_environ(e, probe_cuda=False))
    out = [
        check_launcher_vars(env, e),
        check_processes_vs_gpus(env, spec, e),
        check_cpu_threads(env, spec, e),
        check_device_map(env, spec),
        *check_quantization(env, spec),
        check_liger(env, spec),
        check_checkpointing(env, spec),
        check_batch(spec),
        *check_mesh(spec),
        check_deepspeed_ops(spec),
        check_wandb(spec),
        check_mlflow(spec),
        *check_nccl_env(env, e),
        check_disk(spec),
        check_port(env, e),
    ]
    rules = rule_problems(spec) if spec is not None else []
    out += [Check(p.check, "FAIL", p.message, p.fix, fatal=True) for p in rules if p.check not in _SHOWN]
    return out


def read_environment(environ: Mapping[str, str] | None = None) -> tuple[DistributedEnv, Check | None]:
    """This process's launch environment, and a FAIL check when its variables are broken
    (`WORLD_SIZE=abc`, `RANK` outside the world, `MASTER_PORT=99999`): the doctor reports them
    instead of stopping on them, and looks at the rest as a plain process."""
    e = os.environ if environ is None else environ
    try:
        return DistributedEnv.from_environ(e), None
    except RuntimeError as exc:
        fix = "unset or correct RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE MASTER_ADDR MASTER_PORT"
        broken = Check("distributed variables", "FAIL", str(exc), fix, fatal=True)
        plain = {
            k: v for k, v in e.items() if k not in DISTRIBUTED_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))
        }
        return DistributedEnv.from_environ(plain), broken


def environment_problems(
    spec: RunSpec, environ: Mapping[str, str] | None = None, *, warn: list[Check] | None = None
) -> list[Problem]:
    """The fatal environment checks of a run as problems (train's preflight reports them with the
    config's); WARN checks are appended to `warn` when given."""
    from scaletune.resolve import Problem

    e = os.environ if environ is None else environ
    out = []
    for c in _environment_checks(spec, spec.env, e):
        if c.status == "FAIL" and c.fatal:
            out.append(Problem(c.name, None, c.message, c.fix))
        elif c.status == "WARN" and warn is not None:
            warn.append(c)
    return out


def preflight(spec: RunSpec, environ: Mapping[str, str] | None = None) -> list[Check]:
    """Run :func:`checks`; raise one UserError naming every fatal problem with its fix.

    Raises:
        UserError: (exit 2) one line per fatal check.
    """
    results = checks(spec, spec.env, environ)
    fatal = [c for c in results if c.fatal and c.status == "FAIL"]
    if fatal:
        raise UserError([f"{c.name}: {c.message}. Fix: {c.fix}" for c in fatal], title="preflight failed")
    return results
