"""Updates of a job's record in an open session: a state change, a metrics line, a reported
event (posted by the run or read from its log), each with the event the API streams. Nothing here
polls, reads files or holds state: the watcher and the job service call these."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from scaletune.report import EventKind
from scaletune.serve import states as S
from scaletune.serve.db import Event, Job, Metric

# The job fields a state event carries.
_STATE_FIELDS = ("reason", "message", "phase", "stage")


def event(s: Session, job: Job, kind: str, data: dict) -> None:
    """One event of the job's stream (`kind`: state, metric, log, checkpoint)."""
    s.add(Event(job_id=job.id, kind=kind, data=data))


def set_state(s: Session, job: Job, state: str, **fields: Any) -> None:
    """The job's new state and fields (reason, message, phase, stage, ...), and its state event."""
    job.state = state
    for k, v in fields.items():
        setattr(job, k, v)
    event(s, job, "state", {"state": state, **{k: v for k, v in fields.items() if k in _STATE_FIELDS}})


def add_metric(s: Session, job: Job, record: dict) -> bool:
    """One metrics.jsonl record (posted or read); False when it has no int `step` or is known.

    (job, step, train|eval) is unique, so the post and the file's copy of a line meet once.
    """
    if not isinstance(record.get("step"), int):
        return False
    kind = "eval" if "eval_loss" in record else "train"
    exists = s.scalar(
        select(Metric.id).where(Metric.job_id == job.id, Metric.step == record["step"], Metric.kind == kind)
    )
    if exists:
        return False
    try:
        with s.begin_nested():
            s.add(Metric(job_id=job.id, step=record["step"], kind=kind, loss=record.get("loss"), data=record))
    except IntegrityError:
        return False
    job.step = max(job.step or 0, record["step"])
    if kind == "train":
        job.last_metrics = record
        job.stage = record.get("stage", job.stage)
        if job.state == S.STARTING:
            set_state(s, job, S.RUNNING, phase="training")
    event(s, job, "metric", record)
    return True


def apply_report(s: Session, job: Job, kind: str, data: dict) -> int:
    """One reported event (`report.EventKind`'s value, as posted or parsed from the log) applied to
    the record; 1 when it was new, 0 when known or of a kind the record does not keep."""
    try:
        kind = EventKind.named(kind)
    except ValueError:
        return 0  # a newer run's kind: the post is accepted, the record unchanged
    if kind is EventKind.METRIC:
        return int(add_metric(s, job, data))
    if kind is EventKind.PHASE:
        if job.phase == data.get("phase") and job.stage == data.get("stage", job.stage):
            return 0
        job.phase = data.get("phase")
        job.stage = data.get("stage", job.stage)
        if job.state == S.STARTING:
            job.state = S.RUNNING
        event(s, job, "state", {"state": job.state, "phase": job.phase, "stage": job.stage})
        return 1
    if kind is EventKind.CHECKPOINT:
        s.flush()
        known = s.scalars(select(Event.data).where(Event.job_id == job.id, Event.kind == "checkpoint"))
        if any(d.get("path") == data.get("path") for d in known):
            return 0  # posted by the run and read from its log: once
        event(s, job, "checkpoint", data)
        return 1
    return 0  # STOPPED: the job's end is settled from its exit (watch.Watcher.settle)
