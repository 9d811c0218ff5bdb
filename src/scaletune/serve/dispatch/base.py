"""The interface every dispatcher implements, and what a job hands it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import psutil

STOP_FILE = "stop-request"  # in the job folder; the trainer checks it at each step boundary
EXIT_FILE = "exit-code"  # written by the wrapper when the run's process ends
LOG_FILE = "train.log"


@dataclass(frozen=True)
class JobFiles:
    """A job as a dispatcher sees it.

    `env` holds the job's report URL and token: given to the process environment only (never
    written into the job folder, a script or a log).
    """

    job_id: str
    job_dir: Path
    config_path: Path  # the YAML written into job_dir
    overrides: tuple[str, ...]
    resources: dict
    workdir: Path  # where relative paths of the config are read from
    env: dict[str, str] = field(default_factory=dict)

    @property
    def stop_file(self) -> Path:
        return self.job_dir / STOP_FILE


@dataclass(frozen=True)
class Status:
    """`queued` (waiting at the target), `running`, `exited` (with its code, None when unknown)
    or `lost` (no trace of it any more)."""

    state: Literal["queued", "running", "exited", "lost"]
    exit_code: int | None = None


class Dispatcher:
    """submit, poll, stop, cancel, logs, reattach. `target_id` is what the job record keeps: a
    PID, a SLURM job id, a Modal call id."""

    name = "base"
    max_concurrent: int | None = None  # jobs running at once; None: the target queues them itself

    def submit(self, job: JobFiles) -> str:
        """Start the job; returns its target id. Raises UserError when the target refuses it."""
        raise NotImplementedError

    def poll(self, target_id: str, job: JobFiles) -> Status:
        raise NotImplementedError

    def stop(self, target_id: str, job: JobFiles) -> None:
        """Ask for a checkpoint at the next step boundary and a clean end (the stop file)."""
        job.stop_file.write_text("stop\n")

    def cancel(self, target_id: str, job: JobFiles) -> None:
        """End the job now."""
        raise NotImplementedError

    def logs(self, job: JobFiles, rank: int | None = None) -> str:
        """The job's output (ranks share one log here; `rank` filters torchrun's `[rank]:` prefixes)."""
        text = "".join(p.read_text(errors="replace") for p in sorted(job.job_dir.glob("*.log")))
        text += "".join(p.read_text(errors="replace") for p in sorted(job.job_dir.glob("slurm-*.out")))
        if rank is None:
            return text
        keep = [ln for ln in text.splitlines(True) if ln.startswith(f"[rank{rank}]") or not ln.startswith("[rank")]
        return "".join(keep)

    def reattach(self, target_id: str, job: JobFiles) -> bool:
        """After a service restart: whether the job is still known to the target (then polled)."""
        return self.poll(target_id, job).state != "lost"


def exit_code(job: JobFiles) -> int | None:
    p = job.job_dir / EXIT_FILE
    try:
        return int(p.read_text().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid: int, marker: str) -> bool:
    """Whether `pid` runs and is ours (its command line names `marker`, against PID reuse)."""
    try:
        return any(marker in arg for arg in psutil.Process(pid).cmdline())
    except psutil.Error:
        return False
