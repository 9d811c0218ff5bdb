"""A submitted config checked as `scaletune train` checks it (`run.prepare`: schema, rules, model,
data, environment, run directory; every problem at once, the CLI's messages) for the machine that
runs it (a SLURM or Modal job at its target's world size, without this host's GPU checks), and the
dry run: the resolved plan and the exact command, sbatch script or Modal app.

A config that names code (a factory or remote code, where the admin allowed it) is checked in a
child process (`python -m scaletune.serve.jobs.validate`): nothing submitted is imported into the
service's own process."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import threading
from pathlib import Path

from scaletune.errors import UserError
from scaletune.resolve import RunSpec
from scaletune.serve.jobs.dispatch import Dispatcher, JobFiles
from scaletune.serve.jobs.dispatch.base import job_environment

CHILD_TIMEOUT_S = 600
# Child checks at once, service-wide, and how long a request waits for one. Each child imports torch
# and transformers (about 0.4 GB and 5 CPU-s); every config naming a hub id is checked in one, so a
# submit token's burst of dry runs would otherwise start a process per request thread.
CHECK_SLOTS = threading.BoundedSemaphore(4)
CHECK_WAIT_S = 30


class ChecksBusy(Exception):
    """Every child-check slot stayed busy for `CHECK_WAIT_S`: answered 503 with Retry-After."""


REMOTE = ("slurm", "modal")  # targets whose jobs run on other machines


def check(job: JobFiles, dispatcher: Dispatcher, *, in_child: bool = False, dry_run: bool = False) -> dict | None:
    """Prepare the job's run (relative paths are read from the service's working directory, as
    the CLI reads them from the user's); with `dry_run`, return its plan.

    Raises:
        UserError: every problem, with `config:line` (the submitted text's line) and key.
    """
    if in_child:
        return _in_child(job, dispatcher.name, dry_run)
    try:
        spec = prepare(job, dispatcher)
    except UserError as exc:
        # The job folder's config.yaml is the service's copy (a dry run's is deleted at once): its
        # problems name the submitted text, `config:LINE: key: ...`, as the request sent it.
        raise type(exc)([p.replace(str(job.config_path), "config") for p in exc.problems], title=exc.title) from None
    return plan(spec, job, dispatcher) if dry_run else None


def prepare(job: JobFiles, dispatcher: Dispatcher) -> RunSpec:
    """The run as `scaletune train` prepares it on the machine that runs it: for `local` this
    process's environment; for SLURM and Modal, whose jobs start on other machines, the target's
    shape (world size and GPUs per node, as its sbatch script or Modal app starts the ranks) with
    the devices `scaletune plan --gpus` assumes (`plan.target_env`), and none of this machine's
    checks (its GPU, packages, launcher variables): a QLoRA job for Modal is not refused because
    the web host has no GPU, and a SLURM job's batch arithmetic is judged at its world size.

    Raises:
        UserError: every problem; the resources' alone when they have any (the world size the
            config is judged at comes from them).
    """
    from scaletune.config import read_config
    from scaletune.env import DistributedEnv
    from scaletune.run import prepare as prepare_run

    assert job.workdir == Path.cwd(), "jobs run from the service's working directory"
    cfg = read_config(job.config_path, list(job.overrides))
    if dispatcher.name not in REMOTE:
        return prepare_run(cfg, DistributedEnv.from_environ())
    from scaletune.plan import target_env
    from scaletune.serve.jobs.dispatch import modal, slurm

    try:
        nodes, gpus_per_node, world = (slurm if dispatcher.name == "slurm" else modal).shape(job)
    except UserError:  # a ValueError too: its problems as they are
        raise
    except (TypeError, ValueError) as exc:  # a value of the wrong kind, e.g. "partition": 3
        raise UserError(f"resources: {exc} (target {dispatcher.name})", title="invalid job") from None
    env = target_env(gpus_per_node, None, nodes)[0]
    return prepare_run(cfg, env, world_size=world, here=False)


def plan(spec: RunSpec, job: JobFiles, dispatcher: Dispatcher) -> dict:
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
        from scaletune.serve.jobs.dispatch.modal import app_source

        out["modal_app"] = app_source(job)
    return out


def _in_child(job: JobFiles, target: str, dry_run: bool) -> dict | None:
    request = {
        "job_id": job.job_id,
        "job_dir": str(job.job_dir),
        "overrides": list(job.overrides),
        "resources": job.resources,
        "target": target,
        "dry_run": dry_run,
    }
    env = job_environment(job)  # the service's own secrets stay out of the check, as out of the job
    if not CHECK_SLOTS.acquire(timeout=CHECK_WAIT_S):
        raise ChecksBusy(
            "every config-check slot is busy (other configs are being checked); try again in a few seconds"
        )
    try:
        done = subprocess.run(
            [sys.executable, "-m", "scaletune.serve.jobs.validate"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            cwd=job.workdir,
            env=env,
            timeout=CHILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        raise UserError(f"the config's check took over {CHILD_TIMEOUT_S} s: refused", title="invalid config") from None
    finally:
        CHECK_SLOTS.release()
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (done.stderr or "").strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        raise UserError(f"the config's check failed: {tail[0][:500]}", title="invalid config") from None
    if answer.get("problems"):
        raise UserError(answer["problems"], title=answer.get("title") or "invalid config")
    return answer.get("plan")


def _child_main() -> None:
    from scaletune.serve.jobs.dispatch import make_dispatchers

    req = json.loads(sys.stdin.read())
    job_dir = Path(req["job_dir"])
    job = JobFiles(
        job_id=req["job_id"],
        job_dir=job_dir,
        config_path=job_dir / "config.yaml",
        overrides=tuple(req["overrides"]),
        resources=req["resources"],
        workdir=Path.cwd(),
    )
    try:
        out = {"plan": check(job, make_dispatchers()[req["target"]], dry_run=req["dry_run"])}
    except UserError as exc:
        out = {"problems": exc.problems, "title": exc.title}
    sys.stdout.write("\n" + json.dumps(out, default=str) + "\n")


if __name__ == "__main__":
    _child_main()


__all__ = ["ChecksBusy", "UserError", "check", "plan", "prepare"]
