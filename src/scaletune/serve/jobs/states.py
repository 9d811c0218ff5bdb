"""Job states, phases and failure reasons (the vocabulary of the API and the page)."""

from __future__ import annotations

# `checking`: submitted and recorded, its config being checked as `scaletune train` checks it (the
# preflight: model, data, environment); then queued, or failed with reason `bad input`.
CHECKING, QUEUED, STARTING, RUNNING, STOPPING = "checking", "queued", "starting", "running", "stopping"
STOPPED, SUCCEEDED, FAILED, CANCELLED = "stopped", "succeeded", "failed", "cancelled"

STATES = (CHECKING, QUEUED, STARTING, RUNNING, STOPPING, STOPPED, SUCCEEDED, FAILED, CANCELLED)
ACTIVE = frozenset({STARTING, RUNNING, STOPPING})  # a process / SLURM job / Modal call exists
TERMINAL = frozenset({STOPPED, SUCCEEDED, FAILED, CANCELLED})
RESUMABLE = frozenset({STOPPED, FAILED, CANCELLED})

# Reasons of a failed job.
BAD_INPUT = "bad input"  # the run refused its config or data (exit 2)
OUT_OF_MEMORY = "out of memory"
DIVERGED = "diverged"
LOST = "lost"  # the process / SLURM job vanished without an exit status
ERROR = "error"  # anything else (exit 1 with a traceback)
SUBMIT = "submit failed"  # the target refused the job (sbatch error, no Modal credentials)
# Not a failure: a `starting` job whose target may have taken it (its answer to the submit was
# lost): asked again until it says (then queued, or failed `submit failed` or `lost`).
SUBMIT_UNKNOWN = "submit unknown"


# A running job's phases: `scaletune.report.PHASES` (the run reports them).


def failure_reason(exit_code: int | None, log_tail: str) -> str:
    """The reason of a failed run from its exit code and the end of its log.

    Exit code 2 is scaletune's bad input (DESIGN.md); the rest is read from the messages the
    trainer and torch print (`DivergenceError`, `OutOfMemoryError`).
    """
    if exit_code is None:
        return LOST
    if exit_code == 2:
        return BAD_INPUT
    if "training diverged" in log_tail or "DivergenceError" in log_tail:
        return DIVERGED
    if "OutOfMemoryError" in log_tail or "out of memory" in log_tail.lower():
        return OUT_OF_MEMORY
    if exit_code in (-9, 137) and "Killed" in log_tail:
        return OUT_OF_MEMORY
    return ERROR
