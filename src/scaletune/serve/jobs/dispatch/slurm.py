"""`slurm`: the job as an sbatch script from `launch.slurm.render_sbatch`, submitted with `sbatch`,
watched with `squeue` (then `scontrol show job`, then `sacct`), ended with `scancel`.

The job's report URL and token reach it through sbatch's environment (`--export=ALL`, its
default), never through the script.
"""

from __future__ import annotations

import re
import subprocess
import sys

from scaletune.errors import UserError
from scaletune.launch.slurm import SlurmOptions, ranks_per_node, render_sbatch, validate
from scaletune.launch.slurm import submit as sbatch_submit
from scaletune.report import STOP_ENV
from scaletune.serve.jobs.dispatch.base import Dispatcher, JobFiles, Status, checked_options, job_environment

QUEUED = {"PENDING", "CONFIGURING", "REQUEUED", "RESIZING", "SUSPENDED"}
RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}
RESOURCE_KEYS = {"nodes", "gpus_per_node", "procs_per_node", "partition", "account", "time", "mem"}


def options(job: JobFiles, python: str = sys.executable) -> SlurmOptions:
    """The sbatch options of a job from its `resources` (nodes, gpus_per_node, procs_per_node,
    partition, account, time, mem).

    Raises:
        UserError: unknown resource keys (every one named).
    """
    r = job.resources
    unknown = sorted(set(r) - RESOURCE_KEYS)
    if unknown:
        raise UserError([f"resources.{k}: unknown for target slurm; known: {sorted(RESOURCE_KEYS)}" for k in unknown])
    gpus = int(r.get("gpus_per_node", 0))
    return SlurmOptions(
        config=str(job.config_path),
        overrides=tuple(job.overrides),
        nodes=int(r.get("nodes", 1)),
        gpus_per_node=gpus,
        procs_per_node=int(r.get("procs_per_node", 1)) if not gpus else r.get("procs_per_node"),
        partition=r.get("partition"),
        account=r.get("account"),
        time=r.get("time"),
        mem=r.get("mem"),
        job_name=f"scaletune-{job.job_id}",
        output=str(job.job_dir / "slurm-%j.out"),
        workdir=str(job.workdir),
        python=python,
    )


def shape(job: JobFiles) -> tuple[int, int, int]:
    """(nodes, GPUs per node, world size) of the job as its sbatch script starts it: one torchrun
    per node with `ranks_per_node` ranks, as `render_sbatch` counts them.

    Raises:
        UserError: the resources `options` and the sbatch script refuse (every problem).
    """
    # `options` leaves procs_per_node as given: it is checked here too.
    opts = checked_options(job, options, ("nodes", "gpus_per_node", "procs_per_node"))
    validate(opts)
    return opts.nodes, opts.gpus_per_node or 0, ranks_per_node(opts) * opts.nodes


def _run(argv: list[str]) -> str:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


class SlurmDispatcher(Dispatcher):
    name = "slurm"
    slow = True  # sbatch / squeue / scancel, or Modal over the network

    def script(self, job: JobFiles) -> str:
        return render_sbatch(options(job))

    def submit(self, job: JobFiles) -> str:
        (job.job_dir / "exit-code").unlink(missing_ok=True)
        job.stop_file.unlink(missing_ok=True)
        path = job.job_dir / "job.sbatch"
        path.write_text(self.script(job))
        return sbatch_submit(str(path), environ=job_environment(job, **{STOP_ENV: str(job.stop_file)}))

    def poll(self, target_id: str, job: JobFiles) -> Status:
        state = _run(["squeue", "-h", "-j", target_id, "-o", "%T"]).strip()
        if state in QUEUED:
            return Status("queued")
        if state in RUNNING:
            return Status("running")
        fields = dict(re.findall(r"(\w+)=(\S*)", _run(["scontrol", "show", "job", "-o", target_id])))
        state, code = fields.get("JobState"), fields.get("ExitCode")
        if not state:
            line = _run(["sacct", "-n", "-X", "-P", "-j", target_id, "-o", "State,ExitCode"]).strip()
            if "|" in line:
                state, code = line.split("|", 1)
                state = state.split()[0]
        if state in QUEUED:
            return Status("queued")
        if state in RUNNING:
            return Status("running")
        if state is None:
            return Status("lost")
        number = int(code.split(":")[0]) if code and code.split(":")[0].isdigit() else None
        if state == "COMPLETED":
            return Status("exited", 0)
        return Status("exited", number if number else 1)

    def adopt(self, job: JobFiles) -> str | None:
        """The SLURM job of this name, if the last service submitted it before it stopped."""
        ids = _run(["squeue", "-h", "-n", f"scaletune-{job.job_id}", "-o", "%i"]).split()
        return ids[0] if ids else None

    def cancel(self, target_id: str, job: JobFiles) -> None:
        _run(["scancel", target_id])
