"""A submission's check as the job's first phase: the job is recorded `checking` at once, its
config checked as `scaletune train` checks it (`validate.check`) in a thread, and the request waits
for the outcome at most as long as its client asked (`wait_s`).

Inside that wait the request answers as a synchronous check did: 422 with every problem (and
nothing kept: the record and the folder are removed), 201 `queued`, or 503 when every check slot
stayed busy. Past it, the request answers 202 `checking` with the job's id, and the check goes on:
the job becomes `queued`, or `failed` (reason `bad input`, the problems in its message and its log),
which `remote submit --wait`, `remote status` and the page show. A client whose preflight outlasts
its timeout so learns where its one job is (issue 40: a fixed 60 s timeout reported an unreachable
service while the job was created, and a second submit made another).

A service that stops during a check leaves the job `checking`; the next one to start checks it
again (`recheck_orphans`), as it finds a queued job queued. The re-check runs without the job's
submitted secrets (held in the stopped service's memory; with a key, sealed on its record, opened
when it starts); a job whose secrets this service cannot give it then waits for them (`vault.py`).
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select

from scaletune.errors import UserError
from scaletune.serve.edge.policy import user_reward_function, walk
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs.db import Event, Job, Metric
from scaletune.serve.jobs.dispatch.base import LOG_FILE
from scaletune.serve.jobs.records import set_state
from scaletune.serve.jobs.validate import ChecksBusy, check
from scaletune.serve.jobs.vault import needs_secrets

# `svc` below is the `service.JobService` that owns the job (typed Any: that module imports this one).
JobService = Any

log = logging.getLogger(__name__)
BUSY_RETRY_S = 2.0  # a background check that found every slot busy asks again after this long
MESSAGE_CHARS = 8000  # the problems kept in the job's message (the log holds them all)


class PendingCheck:
    """The hand-over between a check's thread and the request waiting for it: while the request
    waits (`answering`), the thread leaves the outcome here for it; after the request answered 202,
    the thread applies the outcome itself."""

    def __init__(self, answering: bool = True) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.answering = answering
        self.error: BaseException | None = None


def submit_checked(svc: JobService, job: Job, child: bool, secrets: dict[str, str], wait_s: float | None) -> dict:
    """Check the recorded `checking` job in a thread and answer for the request: the job's
    `{id, state}` (`queued`, or `checking` when `wait_s` passed first; None: wait for the end).

    Raises:
        UserError: the config's problems, found inside the wait (the job is removed).
        ChecksBusy: every check slot stayed busy (the job is removed).
    """
    pending = PendingCheck()
    thread = threading.Thread(
        target=_run, args=(svc, job, child, secrets, pending), name=f"check-{job.id}", daemon=True
    )
    thread.start()
    pending.done.wait(wait_s)
    with pending.lock:
        if not pending.done.is_set():
            pending.answering = False
            return {"id": job.id, "state": S.CHECKING}
    return _apply(svc, job.id, pending.error, secrets, answering=True)


def recheck_orphans(svc: JobService) -> list[str]:
    """Check again the jobs a stopped service left `checking`; returns their ids."""
    with svc.Session() as s:
        orphans = list(s.scalars(select(Job).where(Job.state == S.CHECKING)))
    from scaletune.serve.jobs.submission import read

    for job in orphans:
        try:
            child = in_child(read(job.config_yaml, list(job.overrides), svc.policy.max_depth).data)
        except UserError as exc:  # the stored text no longer reads (a policy's depth lowered since)
            _apply(svc, job.id, exc, {}, answering=False)
            continue
        args = (svc, job, child, {}, PendingCheck(answering=False))
        threading.Thread(target=_run, args=args, name=f"recheck-{job.id}", daemon=True).start()
    return [j.id for j in orphans]


def _run(svc: JobService, job: Job, child: bool, secrets: dict[str, str], pending: PendingCheck) -> None:
    """Check `job` (in a child process where `child`), retrying while every slot is busy and
    nobody waits, then hand the outcome over (`PendingCheck`)."""
    while True:
        try:
            check(svc.files(job), svc.dispatchers[job.target], in_child=child)
            error: BaseException | None = None
        except ChecksBusy as exc:
            with pending.lock:
                if not pending.answering:  # nobody waits: wait for a slot rather than fail the job
                    retry = True
                else:
                    retry, error = False, exc
            if retry:
                threading.Event().wait(BUSY_RETRY_S)
                continue
        except UserError as exc:
            error = exc
        except Exception as exc:  # noqa: BLE001 - a check that crashed fails its job, never leaves it checking
            log.exception("the check of job %s failed", job.id)
            error = exc
        break
    with pending.lock:
        if pending.answering:
            pending.error = error
            pending.done.set()
            return
    _apply(svc, job.id, error, secrets, answering=False)


def _apply(svc: JobService, job_id: str, error: BaseException | None, secrets: dict, *, answering: bool) -> dict:
    """The check's outcome on the job's record: queued; or, while the request still answers, the
    job removed and the error raised; else failed with its problems."""
    if error is None:
        if secrets:
            svc.hold_secrets(job_id, secrets)
        with svc.lock, svc.Session() as s:
            job = s.get(Job, job_id)
            state = job.state if job is not None else S.CANCELLED
            if job is not None and job.state == S.CHECKING:  # not stopped or cancelled meanwhile
                # A re-checked orphan whose secrets are gone waits for them (`vault.py`).
                if (why := svc.vault.missing(job, hold=False)) is not None:
                    needs_secrets(s, job, why)
                else:
                    set_state(s, job, S.QUEUED)
                state = job.state
            s.commit()
        svc.kick()
        return {"id": job_id, "state": state}
    if answering:
        forget(svc, job_id)
        raise error
    problems = error.problems if isinstance(error, UserError) else [f"the config's check failed: {error}"]
    title = error.title if isinstance(error, UserError) else "check failed"
    with svc.lock, svc.Session() as s:
        job = s.get(Job, job_id)
        if job is None or job.state != S.CHECKING:
            return {"id": job_id, "state": job.state if job is not None else S.CANCELLED}
        with (Path(job.job_dir) / LOG_FILE).open("a") as f:  # what `remote submit --wait` prints of it
            f.write(f"error: {title}\n" + "".join(f"  - {p}\n" for p in problems))
        reason = S.BAD_INPUT if isinstance(error, UserError) else S.ERROR
        set_state(s, job, S.FAILED, reason=reason, message="\n".join(problems)[:MESSAGE_CHARS])
        s.commit()
    return {"id": job_id, "state": S.FAILED}


def forget(svc: JobService, job_id: str) -> None:
    """Remove a job that never got past its check: its record, events and folder (nothing ran)."""
    svc.drop_secrets(job_id)
    with svc.lock, svc.Session() as s:
        job = s.get(Job, job_id)
        folder = Path(job.job_dir) if job is not None else None
        s.execute(delete(Event).where(Event.job_id == job_id))
        s.execute(delete(Metric).where(Metric.job_id == job_id))
        s.execute(delete(Job).where(Job.id == job_id))
        s.commit()
    if folder is not None:
        remove_job_folder(folder)


def in_child(data: dict) -> bool:
    """Whether a (policy-allowed) config is checked in a child process with the job's environment,
    never in the service: one that names code the check would import (a factory, a reward function
    other than the built-ins, remote code), or a model or tokenizer named by a hub id
    (`models.loading.names_hub_id`; a planner preset's name is read from scaletune's own table): its
    check downloads, and a download made in the service would
    go out with the service's credentials (its HF_TOKEN, the token `hf auth login` stored) and into
    the cache every job reads (issue 34, cases 2 and 3)."""
    from scaletune.models import PRESETS
    from scaletune.models.loading import names_hub_id

    for path, v in walk(data):
        if (path and path[-1] in ("factory", "trust_remote_code") and v) or user_reward_function(path, v):
            return True
        if path and path[-1] in ("name_or_path", "tokenizer") and isinstance(v, str) and v:
            if v not in PRESETS and names_hub_id(v):
                return True
    return False


def remove_job_folder(job_dir: Path) -> None:
    """A job folder the service made for a check (its config, nothing the run wrote)."""
    if not job_dir.is_dir() or any(job_dir.glob("*.log")):
        return
    for p in job_dir.iterdir():
        # The check's own Hugging Face home (a hub id's config fetched to judge it) is a folder.
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    job_dir.rmdir()
