"""A submitted config checked as `scaletune train` checks it (`run.prepare`: schema, rules, model,
data, environment, run directory; every problem at once, the CLI's messages), and the dry run:
the resolved plan and the exact command, sbatch script or Modal app."""

from __future__ import annotations

import shlex
from pathlib import Path

from scaletune.errors import UserError
from scaletune.resolve import RunSpec
from scaletune.serve.dispatch import Dispatcher, JobFiles


def check(config_path: Path, overrides: list[str], workdir: Path) -> RunSpec:
    """Prepare the run; relative paths are read from the service's working directory, as the
    CLI reads them from the user's.

    Raises:
        UserError: every problem, with file:line and key.
    """
    from scaletune.config import read_config
    from scaletune.env import DistributedEnv
    from scaletune.run import prepare

    assert workdir == Path.cwd(), "jobs run from the service's working directory"
    return prepare(read_config(config_path, overrides), DistributedEnv.from_environ())


def dry_run(spec: RunSpec, job: JobFiles, dispatcher: Dispatcher) -> dict:
    """The resolved plan (strategy, memory per rank) and what would be submitted."""
    from scaletune.run import predicted_memory

    out: dict = {
        "strategy": spec.strategy_label,
        "reason": spec.reason,
        "world_size": spec.world_size,
        "batch": spec.batch.describe(),
        "run_dir": str(spec.run_dir),
        "memory_per_rank": predicted_memory(spec),
    }
    if dispatcher.name == "local":
        out["command"] = shlex.join(dispatcher.argv(job)[4:])  # type: ignore[attr-defined]
    elif dispatcher.name == "slurm":
        out["sbatch_script"] = dispatcher.script(job)  # type: ignore[attr-defined]
    else:
        from scaletune.serve.dispatch.modal import app_source

        out["modal_app"] = app_source(job)
    return out


__all__ = ["UserError", "check", "dry_run"]
