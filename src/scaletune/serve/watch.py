"""The watcher's work, one tick at a time: start queued jobs within the concurrency limit, poll
the active ones, read the lines their runs append (`metrics.jsonl`, the log's phase and
checkpoint lines) and settle how each ended. Also the re-attach after a service restart."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import select

from scaletune.errors import UserError
from scaletune.serve import states as S
from scaletune.serve.db import Event, Job

if TYPE_CHECKING:
    from scaletune.serve.jobs import JobService

_REPORT = re.compile(r"^\[scaletune\] (phase|saved checkpoint|stopped on request): (.*)$")


def apply_report(svc: JobService, s: Any, job: Job, kind: str, data: dict) -> int:
    """One reported event (from the run's post or its log) applied to the record; 1 when new."""
    if kind == "metric":
        return int(svc.add_metric(s, job, data))
    if kind == "phase":
        if job.phase == data.get("phase") and job.stage == data.get("stage", job.stage):
            return 0
        job.phase = data.get("phase")
        job.stage = data.get("stage", job.stage)
        if job.state == S.STARTING:
            job.state = S.RUNNING
        svc.event(s, job, "state", {"state": job.state, "phase": job.phase, "stage": job.stage})
        return 1
    if kind == "checkpoint":
        s.flush()
        known = s.scalars(select(Event.data).where(Event.job_id == job.id, Event.kind == "checkpoint"))
        if any(d.get("path") == data.get("path") for d in known):
            return 0  # posted by the run and read from its log: once
        svc.event(s, job, "checkpoint", data)
        return 1
    return 0


_FIELD = re.compile(r"(\w+)=(.*?)(?= \w+=|$)")


def _log_fields(rest: str) -> dict:
    """`phase=loading data stage=main` (Trainer.report's line) as a mapping."""
    return dict(_FIELD.findall(rest))


def read_outputs(svc: JobService, s: Any, job: Job) -> None:
    """The fallback path: what the run wrote to its files (shared file system: local, SLURM)."""
    from scaletune.serve.jobs import json_lines

    for record in json_lines(svc.read_new(job, "metrics.jsonl")):
        svc.add_metric(s, job, record)
    for name in ("train.log", *(p.name for p in Path(job.job_dir).glob("slurm-*.out"))):
        for line in svc.read_new(job, name).splitlines():
            text = line.split("]: ", 1)[-1] if line.startswith("[rank") else line
            if text.startswith(("[scaletune]", "error:", "Traceback", "scaletune:")):
                svc.event(s, job, "log", {"line": line})  # scaletune's own lines; the rest via /logs
            m = _REPORT.match(text)
            if not m:
                continue
            fields = _log_fields(m.group(2))
            if m.group(1) == "phase":
                apply_report(svc, s, job, "phase", fields)
            elif m.group(1) == "saved checkpoint":
                apply_report(
                    svc, s, job, "checkpoint", {"step": int(fields.get("step", 0)), "path": fields.get("path")}
                )


def settle(svc: JobService, s: Any, job: Job, code: int | None) -> None:
    """The final state of a job whose process / SLURM job / Modal call ended."""
    job.exit_code = code
    if job.state == S.CANCELLED:
        return
    final = (Path(job.run_dir) / "final").is_dir()
    if code == 0 and final:
        svc.set_state(s, job, S.SUCCEEDED, phase=None)
    elif job.stop_requested and (code == 0 or job.target == "modal"):  # Modal's stop is a cancel
        svc.set_state(s, job, S.STOPPED, phase=None)
    else:
        tail = svc.dispatchers[job.target].logs(svc.files(job))[-4000:]
        reason = S.failure_reason(code, tail)
        lines = [ln for ln in tail.splitlines() if ln.strip()]
        svc.set_state(s, job, S.FAILED, reason=reason, message=lines[-1][:500] if lines else None, phase=None)


def start_queued(svc: JobService, s: Any) -> None:
    running: dict[str, int] = {}
    for job in s.scalars(select(Job).where(Job.state.in_(list(S.ACTIVE)))):
        running[job.target] = running.get(job.target, 0) + 1
    for job in s.scalars(select(Job).where(Job.state == S.QUEUED).order_by(Job.created)):
        if job.target_id:  # submitted, waiting in the target's own queue
            continue
        d = svc.dispatchers[job.target]
        if d.max_concurrent is not None and running.get(job.target, 0) >= d.max_concurrent:
            continue
        svc.new_token(job)
        try:
            job.target_id = d.submit(svc.files(job))
        except (UserError, OSError, ImportError) as exc:
            svc.set_state(s, job, S.FAILED, reason=S.SUBMIT, message=str(exc)[:2000])
            continue
        for name in ("metrics.jsonl", "train.log"):
            svc._tails.pop((job.id, name), None)
        running[job.target] = running.get(job.target, 0) + 1
        svc.set_state(s, job, S.STARTING if job.target == "local" else S.QUEUED, phase=None)
        s.commit()


def poll_active(svc: JobService, s: Any) -> None:
    jobs = s.scalars(
        select(Job).where(Job.state.in_([*S.ACTIVE, S.QUEUED, S.CANCELLED]), Job.target_id.is_not(None))
    ).all()
    for job in jobs:
        if job.state == S.CANCELLED and job.exit_code is not None:
            continue
        status = svc.dispatchers[job.target].poll(job.target_id, svc.files(job))
        read_outputs(svc, s, job)
        if job.state == S.CANCELLED:
            if status.state in ("exited", "lost"):
                job.exit_code = status.exit_code if status.exit_code is not None else -1
            continue
        if status.state == "queued":
            continue
        if status.state == "running":
            if job.state == S.QUEUED:
                svc.set_state(s, job, S.RUNNING, phase=job.phase)
            continue
        settle(svc, s, job, status.exit_code)


def tick(svc: JobService) -> None:
    with svc.lock, svc.Session() as s:
        start_queued(svc, s)
        poll_active(svc, s)
        s.commit()


def reattach_all(svc: JobService) -> None:
    """After a restart: every job the previous service left active is looked up at its target;
    one no longer known there is settled from what it left (exit code file, `final/`) or `lost`."""
    with svc.lock, svc.Session() as s:
        for job in s.scalars(select(Job).where(Job.state.in_([*S.ACTIVE, S.QUEUED]), Job.target_id.is_not(None))):
            files = svc.files(job)
            status = svc.dispatchers[job.target].poll(job.target_id, files)
            svc.event(
                s, job, "log", {"line": f"[scaletune serve] re-attached: {job.target} {job.target_id} {status.state}"}
            )
            if status.state == "exited":
                read_outputs(svc, s, job)
                settle(svc, s, job, status.exit_code)
            elif status.state == "lost":
                svc.set_state(s, job, S.FAILED, reason=S.LOST, message=f"{job.target} {job.target_id} is gone")
        s.commit()
