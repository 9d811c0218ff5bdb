"""Deleting what the service keeps, when asked (`DELETE /api/jobs/ID`, `/api/data/NAME`,
`/api/jobs/ID/exports/NAME`; who may is the routes' rule: the owner or an admin): a job's rows (every
row that refers to it first, found by the foreign keys: tasks, events, metrics, ...; then the job's)
and its folders on this machine; a file of the data area; an export of a run.

A folder is removed only where its resolved path lies inside the service's run folders (the jobs
folder and the admin's write roots, `run_roots`), and never one that holds the data area, the
database, the working directory or another job's folder. A link is removed as a link: what it names
is never followed (`shutil.rmtree` itself removes links inside a folder without following them).
What is left is said, each with why (`Outcome.kept`): a folder outside the run folders, a link's
target, a Modal job's run on its volume, a SLURM job's record at the cluster. The retention of
finished jobs' checkpoints is `retention.py`'s."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from scaletune.errors import UserError
from scaletune.serve.edge.policy import data_area, inside
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs.datasets import META, area_file
from scaletune.serve.jobs.db import Base, Job, TaskRecord
from scaletune.serve.jobs.tasks import RUNNING as TASK_RUNNING

if TYPE_CHECKING:
    from scaletune.serve.jobs.service import JobService

EXPORT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # what an export task names its folder


class Missing(LookupError):
    """Nothing of that name to delete (the API answers 404 with the message)."""


@dataclass
class Outcome:
    """What one deletion did: `removed`, the paths removed on this machine; `kept`, what it left,
    each with why (and how to delete it by hand, where that is elsewhere)."""

    deleted: str
    removed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)

    def public(self) -> dict[str, object]:
        return {"deleted": self.deleted, "removed": self.removed, "kept": self.kept}

    def summary(self) -> str:
        """One line for the audit record."""
        line = "removed " + (", ".join(self.removed) or "no file")
        return line + ("; kept " + "; ".join(self.kept) if self.kept else "")


def real(path: str | Path) -> Path:
    return Path(os.path.realpath(path))


def run_roots(svc: JobService) -> list[Path]:
    """The service's run folders, resolved: the jobs folder and the admin's write roots."""
    return [real(svc.home), *(real(r) for r in svc.policy.write_roots)]


def protected(svc: JobService, job_id: str | None = None) -> list[Path]:
    """What no removal may take with it: the data area, the database file, the service's working
    directory and every folder of a job other than `job_id`, resolved."""
    keep = [real(data_area(svc.home)), real(svc.workdir)]
    if svc.db_file is not None:
        keep.append(real(svc.db_file))
    with svc.Session() as s:
        for job_dir, run_dir in s.execute(select(Job.job_dir, Job.run_dir).where(Job.id != (job_id or ""))):
            keep += [real(job_dir), real(run_dir)]
    return keep


def remove(path: Path, roots: list[Path], keep: list[Path], out: Outcome) -> None:
    """Remove `path` (a folder, a file or a link) when its resolved path lies inside one of `roots`
    (not a root itself) and holds nothing of `keep`; a link is unlinked (when it lies in a root),
    never followed. Adds to `out.removed`, or to `out.kept` with why."""
    if not os.path.lexists(path):
        return
    if path.is_symlink():
        if any(inside(real(path.parent), r) for r in roots):
            target = os.readlink(path)
            path.unlink()
            out.removed.append(f"{path} (a link: what it names, {target}, is kept)")
        else:
            out.kept.append(f"{path}: outside the service's run folders; not deleted")
        return
    target = real(path)
    if not any(target != r and inside(target, r) for r in roots):
        out.kept.append(f"{path}: outside the service's run folders (the jobs folder and the write roots); not deleted")
        return
    held = next((k for k in keep if inside(k, target)), None)
    if held is not None:
        out.kept.append(f"{path}: holds {held}, which is not this job's; not deleted")
        return
    errors: list[str] = []
    if target.is_dir():
        shutil.rmtree(target, onerror=lambda _fn, p, exc: errors.append(f"{p}: {exc[1]}"))
    else:
        try:
            target.unlink()
        except OSError as exc:
            errors.append(f"{target}: {exc}")
    if errors:
        out.kept.append(f"{path}: partly removed; left: " + "; ".join(errors[:5]))
    else:
        out.removed.append(str(path))


# -- a job ---------------------------------------------------------------------------------------
def running_task(s: Session, job_id: str) -> str | None:
    """The kind of a task running on the job (it reads or writes the run folder), or None."""
    running = select(TaskRecord.kind).where(TaskRecord.job_id == job_id, TaskRecord.state == TASK_RUNNING)
    return s.scalar(running.limit(1))


def why_not_now(svc: JobService, s: Session, job: Job) -> str | None:
    """Why `job` cannot be deleted now (None: it can): it has not ended (cancel it first), its
    process still runs, or a task of it runs."""
    if job.state not in S.TERMINAL:
        return (
            f"job {job.id} is {job.state}: only an ended job (stopped, succeeded, failed, cancelled) is deleted; "
            f"cancel it first (Cancel on its page, or POST /api/jobs/{job.id}/cancel), then delete it"
        )
    if job.target_id and job.exit_code is None and job.state in (S.CANCELLED, S.FAILED):
        if job.target == "local":  # asked now: a process on this machine
            if local_runs(svc, job):
                return (
                    f"job {job.id} is {job.state} but its process {job.target_id} still runs; "
                    "cancel it (or wait for it to end), then delete it"
                )
        elif job.state == S.CANCELLED:
            return (
                f"job {job.id} was cancelled and its {job.target} run {job.target_id} has not been seen to end "
                "yet; try again in a few seconds"
            )
    task = running_task(s, job.id)
    if task is not None:
        return f"job {job.id} has a task running ({task}); wait for it to end, then delete the job"
    return None


def local_runs(svc: JobService, job: Job) -> bool:
    """Whether the local job's process (its recorded PID and start mark) still runs."""
    try:
        return svc.dispatchers["local"].poll(job.target_id or "", svc.files(job)).state == "running"
    except (ValueError, OSError):  # not a PID: nothing of it runs here
        return False


def elsewhere(svc: JobService, job: Job) -> list[str]:
    """What of the job lies outside this machine and is not deleted, with how to delete it."""
    if job.target == "modal":
        from scaletune.serve.jobs.dispatch.modal import volume_path

        try:
            where = volume_path(svc.files(job), job.run_dir)
            run = (
                f"its run folder on the Modal volume {where['volume']} at {where['path']} "
                f"(modal volume rm {where['volume']} {where['path']} -r)"
            )
        except UserError:  # resources that no longer read
            run = "its run folder on its Modal volume"
        app = f"scaletune-{job.id}"
        return [f"on Modal, not deleted: {run}, and its deployed app {app} (modal app stop {app})"]
    if job.target == "slurm" and job.target_id:
        return [f"on SLURM, not deleted: the cluster's own record of job {job.target_id} (sacct), which SLURM keeps"]
    return []


def delete_rows(s: Session, job_id: str) -> None:
    """Every row that refers to the job (each table with a foreign key to jobs: tasks, events,
    metrics, ...), then the job's own; the audit record is kept (it names job ids, no key)."""
    jobs = Job.__table__
    for table in reversed(Base.metadata.sorted_tables):
        for fk in table.foreign_keys:
            if fk.column.table is jobs:
                s.execute(delete(table).where(fk.parent == job_id))
    s.execute(delete(jobs).where(jobs.c.id == job_id))


def delete_job(svc: JobService, job_id: str) -> Outcome:
    """Delete the ended job `job_id`: its rows (under the service's lock, so nothing starts or
    resumes it meanwhile), then its job folder and its run folder on this machine.

    Raises:
        JobNotFound: no such job.
        UserError: it cannot be deleted now (`why_not_now`: the API answers 409).
    """
    from scaletune.serve.jobs.service import JobNotFound

    with svc.lock, svc.Session() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(job_id)
        why = why_not_now(svc, s, job)
        if why:
            raise UserError(why, title=f"job {job_id} cannot be deleted now")
        out = Outcome(f"job {job_id}", kept=elsewhere(svc, job))
        job_dir, run_dir, target = Path(job.job_dir), Path(job.run_dir), job.target
        delete_rows(s, job_id)
        s.commit()
    svc.drop_secrets(job_id)
    svc.posted.pop(job_id, None)
    keep = protected(svc, job_id)
    job_real, run_real = real(job_dir), real(run_dir)
    remove(job_dir, [real(svc.home)], keep, out)
    if run_dir == job_dir or run_dir.is_relative_to(job_dir):  # removed with its job folder
        if not inside(run_real, job_real):
            out.kept.append(
                f"{run_dir}: reached through a link out of the job folder: the link removed, {run_real} kept"
            )
    elif target != "modal":  # a Modal job's run folder is on the volume (said in `kept`)
        remove(run_dir, run_roots(svc), keep, out)
    return out


# -- a data file, an export ----------------------------------------------------------------------
def active_jobs_naming(svc: JobService, path: Path) -> list[str]:
    """The jobs not yet ended whose config or overrides name `path` (they may still read it)."""
    names = {str(path), str(real(path))}
    with svc.Session() as s:
        rows = s.execute(
            select(Job.id, Job.state, Job.config_yaml, Job.overrides).where(Job.state.not_in(sorted(S.TERMINAL)))
        )
        return [
            f"{job_id} ({state})"
            for job_id, state, text, overrides in rows
            if any(n in (text or "") or any(n in str(o) for o in overrides or ()) for n in names)
        ]


def delete_data(svc: JobService, name: str) -> Outcome:
    """Delete the data area's file `name` (and its record beside it).

    Raises:
        Missing: no such file.
        UserError: a job that has not ended names it (the API answers 409).
    """
    try:
        path = area_file(svc.home, name)
    except UserError:
        raise Missing(f"no data file {name!r} in the data area (GET /api/data lists them)") from None
    naming = active_jobs_naming(svc, path)
    if naming:
        raise UserError(
            f"data file {name}: named by job {', '.join(naming)}, which has not ended; delete it once they have "
            "(or cancel them)",
            title=f"data file {name} is in use",
        )
    out = Outcome(f"data file {name}")
    area = real(data_area(svc.home))
    remove(path, [area], [], out)
    path.with_name(META.format(path.name)).unlink(missing_ok=True)
    return out


def delete_export(svc: JobService, job: Job, name: str) -> Outcome:
    """Delete the export `exports/NAME` of `job`'s run folder, and mark the export task that made it
    `deleted` (the page then no longer offers it).

    Raises:
        Missing: no such export.
        UserError: the run is not on this machine or outside the run folders, or a task of the job
            runs (the API answers 409).
    """
    if job.target == "modal":
        raise UserError(
            f"job {job.id}: its exports are on its Modal volume, not on this machine", title="not on this machine"
        )
    exports = Path(job.run_dir) / "exports"
    path = exports / name
    if not EXPORT_NAME.fullmatch(name) or not os.path.lexists(path) or exports.is_symlink():
        raise Missing(f"job {job.id} has no export {name!r} (GET /api/jobs/{job.id}/models lists them)")
    if not any(inside(real(exports), r) for r in run_roots(svc)):
        raise UserError(f"{exports}: outside the service's run folders; not deleted", title="not deleted")
    with svc.Session() as s:
        task = running_task(s, job.id)
    if task is not None:
        raise UserError(
            f"job {job.id} has a task running ({task}); wait for it to end, then delete the export",
            title="a task is running",
        )
    out = Outcome(f"export exports/{name} of job {job.id}")
    remove(path, [real(exports)], [], out)
    rel = f"exports/{name}"
    with svc.lock, svc.Session() as s:
        for row in s.scalars(select(TaskRecord).where(TaskRecord.job_id == job.id, TaskRecord.kind == "export")):
            if isinstance(row.result, dict) and row.result.get("path") == rel:
                row.result = {"path": rel, "deleted": True}  # a new dict: a JSON column is saved on assignment
        s.commit()
    return out
