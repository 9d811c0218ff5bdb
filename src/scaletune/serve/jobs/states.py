"""Job states, phases and failure reasons (the vocabulary of the API and the page)."""

from __future__ import annotations

# `checking`: submitted and recorded, its config being checked as `scaletune train` checks it (the
# preflight: model, data, environment); then queued, or failed with reason `bad input`.
CHECKING, QUEUED, STARTING, RUNNING, STOPPING = "checking", "queued", "starting", "running", "stopping"
STOPPED, SUCCEEDED, FAILED, CANCELLED = "stopped", "succeeded", "failed", "cancelled"
# A job submitted with secrets that this service cannot give it (a restart without the secrets key,
# or with another key; `vault.py`): never started without them; queued again once they are given
# again (PUT /api/jobs/ID/secrets), or cancelled.
NEEDS_SECRETS = "needs_secrets"

STATES = (CHECKING, QUEUED, NEEDS_SECRETS, STARTING, RUNNING, STOPPING, STOPPED, SUCCEEDED, FAILED, CANCELLED)
ACTIVE = frozenset({STARTING, RUNNING, STOPPING})  # a process / SLURM job / Modal call exists
TERMINAL = frozenset({STOPPED, SUCCEEDED, FAILED, CANCELLED})
RESUMABLE = frozenset({STOPPED, FAILED, CANCELLED})
# The ends after which a job's stored secrets are deleted (a stopped job keeps them for its resume).
SECRETS_DROPPED = frozenset({SUCCEEDED, FAILED, CANCELLED})

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
# Why a job needs its secrets again (state NEEDS_SECRETS).
NO_SECRETS_KEY = "no secrets key"  # stored encrypted, and this service has no key to open them
WRONG_SECRETS_KEY = "wrong secrets key"  # the key given does not open them (it changed)
SECRETS_NOT_KEPT = "secrets not kept"  # held in memory only (no key at submission) by a service that stopped


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
