"""How long finished jobs keep their checkpoints (the admin's `keep_checkpoints_days`, `PUT
/api/admin/policy`), and the service's periodic sweep that applies it (with the tasks' own sweep).

A job that ended `succeeded`, `failed` or `cancelled` and whose record has not changed for N days
loses its `checkpoints/step-*` folders that nothing wrote to for N days either; `final/`, `exports/`,
`eval/`, the metrics and the log stay. A `stopped` job keeps its checkpoints (it was stopped to be
resumed), as does every job that has not ended, a cancelled one whose process has not been seen to
end, a job with a task running, and a Modal job (its checkpoints are on its volume). Only folders
inside the service's run folders are touched (`removal.run_roots`, resolved; a link is removed as a
link). Each folder is first renamed out of the way (`.deleting-step-N-...`) under the service's lock,
so a resume never picks it, and removed after; the job's stream gets a `checkpoint` event with
`removed` (the page drops it) and the audit a `checkpoint.delete` row by `retention`. Several
services on one database sweep alike: one rename wins."""

from __future__ import annotations

import datetime as dt
import logging
import re
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import select

from scaletune.serve.edge.policy import inside
from scaletune.serve.edge.teams import record
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs.db import Job
from scaletune.serve.jobs.removal import real, run_roots, running_task
from scaletune.serve.jobs.watch import sync_checkpoints

if TYPE_CHECKING:
    from scaletune.serve.jobs.service import JobService
    from scaletune.serve.jobs.tasks import Tasks

FINISHED = (S.SUCCEEDED, S.FAILED, S.CANCELLED)
SWEEP_EVERY_S = 600.0  # the periodic sweep's interval (and once at the service's start)
DAY_S = 86400.0
STEP = re.compile(r"step-\d+")
ACTOR = "retention"  # the audit rows' actor: the service's own sweep, not a token
log = logging.getLogger(__name__)


def last_written(path: Path) -> float:
    """When `path` (a checkpoint folder) or a file directly in it was last written (mtime, links not
    followed)."""
    times = [path.lstat().st_mtime]
    if path.is_dir() and not path.is_symlink():
        times += [p.lstat().st_mtime for p in path.iterdir()]
    return max(times)


def sweep(svc: JobService, now: float | None = None) -> list[str]:
    """Delete the checkpoints `keep_checkpoints_days` no longer keeps (module docstring), as of
    `now` (seconds since the epoch; default: the clock's). Returns the folders removed."""
    days = svc.policy.keep_checkpoints_days
    if days <= 0:
        return []
    cutoff = (time.time() if now is None else now) - days * DAY_S
    ended_before = dt.datetime.fromtimestamp(cutoff, dt.UTC).replace(tzinfo=None)
    with svc.Session() as s:
        old = select(Job.id).where(Job.state.in_(FINISHED), Job.updated < ended_before, Job.target != "modal")
        ids = list(s.scalars(old))
    removed: list[str] = []
    for job_id in ids:
        removed += sweep_job(svc, job_id, cutoff, days)
    return removed


def sweep_job(svc: JobService, job_id: str, cutoff: float, days: int) -> list[str]:
    """One finished job's checkpoints last written before `cutoff`, renamed aside under the lock
    (the job checked again there), then removed and recorded."""
    ended_before = dt.datetime.fromtimestamp(cutoff, dt.UTC).replace(tzinfo=None)
    with svc.lock, svc.Session() as s:
        job = s.get(Job, job_id)
        if job is None or job.state not in FINISHED or job.updated >= ended_before or job.target == "modal":
            return []
        if (job.state == S.CANCELLED and job.target_id and job.exit_code is None) or running_task(s, job_id):
            return []  # its process may still end, or a task reads the checkpoints
        run_dir = Path(job.run_dir)
        folder = run_dir / "checkpoints"
        where = real(folder)
        if (
            folder.is_symlink()
            or not folder.is_dir()
            or not any(where != r and inside(where, r) for r in run_roots(svc))
        ):
            return []
        aside: list[tuple[Path, Path | None]] = []
        for p in sorted(folder.iterdir()):
            if not STEP.fullmatch(p.name) or last_written(p) >= cutoff:
                continue
            if p.is_symlink():
                p.unlink()  # the link only: what it names is not the run's
                aside.append((p, None))
            elif p.is_dir():
                moved = p.with_name(f".deleting-{p.name}-{secrets.token_hex(4)}")
                try:
                    p.rename(moved)
                except OSError:  # another service on the database took it first
                    continue
                aside.append((p, moved))
        if aside:
            sync_checkpoints(s, job)  # a `removed` event for each: the page drops them
            s.commit()
    for p, moved in aside:
        errors = removed_tree(moved) if moved is not None else []
        detail = f"{p.relative_to(run_dir)}: the job ended over {days} days ago (keep_checkpoints_days)"
        record(svc.Session, ACTOR, "checkpoint.delete", job_id, detail + (f"; left: {errors[0]}" if errors else ""))
    return [str(p) for p, _ in aside]


def removed_tree(folder: Path) -> list[str]:
    """Remove `folder` (links inside removed, not followed); what could not be removed, and why."""
    errors: list[str] = []
    shutil.rmtree(folder, onerror=lambda _fn, path, exc: errors.append(f"{path}: {exc[1]}"))
    return errors


class Sweeper:
    """The service's periodic sweep, in a thread of its own: at start and every `every_s`
    (SWEEP_EVERY_S), the tasks whose service stopped (`Tasks.sweep`) and the checkpoints retention
    (:func:`sweep`). A sweep that fails is logged; the next one runs."""

    def __init__(self, svc: JobService, tasks: Tasks, every_s: float | None = None) -> None:
        self.svc, self.tasks = svc, tasks
        self.every_s = SWEEP_EVERY_S if every_s is None else every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="scaletune-serve-sweep", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.once()
            self._stop.wait(self.every_s)

    def once(self) -> None:
        for name, fn in (("tasks", self.tasks.sweep), ("retention", lambda: sweep(self.svc))):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - the sweep outlives one bad pass
                log.warning(
                    "sweep (%s): %s: %s", name, type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG)
                )
