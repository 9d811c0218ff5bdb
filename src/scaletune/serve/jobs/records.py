"""Updates of a job's record in an open session: a state change, a metrics line, a reported
event (posted by the run or read from its log), each with the event the API streams; and, read from
the records, where a queued job stands and about when it starts (`queue_eta`). Nothing here polls,
reads files or holds state: the watcher, the job service and the API call these."""

from __future__ import annotations

import datetime as dt
import heapq
import math
import statistics
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from scaletune.config import error_messages
from scaletune.report import EventKind
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs.db import Event, Job, Metric

# The job fields a state event carries.
_STATE_FIELDS = ("reason", "message", "phase", "stage")

# -- what a run may report: bounded, typed (a post and a log line alike) -------------------------
MAX_INT = 2**53  # steps and counts: exact in JSON's doubles, far inside SQLite's 64 bits
Count = Annotated[StrictInt, Field(ge=0, le=MAX_INT)]


def _bounded(value: Any, depth: int = 0) -> Any:
    """`value` if it is small JSON: numbers inside +-2**53 (or floats), strings up to 4,000
    characters, lists and mappings of up to 256 such values, 3 levels deep."""
    if value is None or isinstance(value, bool | float):
        return value
    if isinstance(value, int):
        if abs(value) > MAX_INT:
            raise ValueError(f"the integer {str(value)[:20]}... is out of range")
        return value
    if isinstance(value, str):
        if len(value) > 4000:
            raise ValueError("a string of over 4,000 characters")
        return value
    if depth < 3 and isinstance(value, list | dict) and len(value) <= 256:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for k, v in items:
            _bounded(str(k) if isinstance(value, dict) else k, depth + 1)
            _bounded(v, depth + 1)
        return value
    raise ValueError(f"a value of type {type(value).__name__} this report cannot hold")


class _Data(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _small(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError("the event data must be a mapping")
        return _bounded(data)


class MetricData(_Data):
    step: Count
    loss: float | None = None


class PhaseData(_Data):
    phase: str = Field(max_length=64)
    stage: str | None = Field(None, max_length=200)
    step: Count | None = None


class CheckpointData(_Data):
    step: Count
    path: str = Field(max_length=4096)


class StoppedData(_Data):
    step: Count | None = None


_MODELS: dict[EventKind, type[_Data]] = {
    EventKind.METRIC: MetricData,
    EventKind.PHASE: PhaseData,
    EventKind.CHECKPOINT: CheckpointData,
    EventKind.STOPPED: StoppedData,
}


def validated(kind: str, data: Any) -> dict:
    """A reported event's data checked for its kind (an unknown kind: bounded only).

    Raises:
        ValueError: the data does not fit (out-of-range integers, wrong types, huge values).
    """
    try:
        model = _MODELS[EventKind.named(kind)]
    except ValueError:
        model = _Data
    try:
        model.model_validate(data)
    except ValidationError as exc:
        raise ValueError("; ".join(error_messages(exc, kind))) from None
    return data  # as reported (the file's copy of a metrics line compares equal)


def event(s: Session, job: Job, kind: str, data: dict) -> None:
    """One event of the job's stream (`kind`: state, metric, log, checkpoint)."""
    s.add(Event(job_id=job.id, kind=kind, data=data))


def set_state(s: Session, job: Job, state: str, **fields: Any) -> None:
    """The job's new state and fields (reason, message, phase, stage, ...), and its state event.
    A job that ended (not stopped) loses its stored secrets."""
    job.state = state
    if state in S.SECRETS_DROPPED:
        job.sealed_secrets = None
    if state in S.TERMINAL:
        job.token_hash = ""  # the run's report token ends with the job
        fields.setdefault("phase", None)  # an ended job does nothing: no phase (a cancel sets none)
    for k, v in fields.items():
        setattr(job, k, v)
    event(s, job, "state", {"state": state, **{k: v for k, v in fields.items() if k in _STATE_FIELDS}})


def json_safe(value: Any) -> Any:
    """`value` with each non-finite float spelled as JavaScript's `Number()` reads it back
    ("NaN", "Infinity", "-Infinity"): strict JSON (a Postgres JSON column, the API's responses,
    the page's JSON.parse) has no NaN, and a diverged run's last line has one."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


#: The divergence rule of a run whose loss stays finite (docs/serve.md): with at least
#: DIVERGE_MIN_LINES train losses logged, the mean of the last DIVERGE_LAST is above DIVERGE_OVER_FIRST
#: times the first logged loss and DIVERGE_OVER_BEST times the lowest: training ended worse than it
#: began and well above its best, which one noisy batch or a flat run does not do.
DIVERGE_MIN_LINES, DIVERGE_LAST, DIVERGE_OVER_FIRST, DIVERGE_OVER_BEST = 4, 3, 1.1, 1.5


def loss_flag(s: Session, job: Job, record: dict) -> str | None:
    """The job's flag after the train line `record` (already added): "non-finite ..." once a loss
    or gradient norm was NaN or infinite (kept: the run had it), else "diverged ..." while the
    rule above holds, else None. Three indexed queries, on each train line only."""
    if job.flag and job.flag.startswith("non-finite"):
        return job.flag
    bad = [k for k in ("loss", "grad_norm") if isinstance(record.get(k), str)]  # json_safe's spelling
    if bad and not record.get("skipped"):  # a skipped fp16 step has an infinite norm by design
        return f"non-finite {bad[0]} ({record[bad[0]]}) at step {record['step']}"
    train = (Metric.job_id == job.id, Metric.kind == "train", Metric.loss.is_not(None))
    n = s.scalar(select(func.count()).where(*train))
    if not n or n < DIVERGE_MIN_LINES:
        return None
    first = s.scalar(select(Metric.loss).where(*train).order_by(Metric.step).limit(1))
    best = s.scalar(select(func.min(Metric.loss)).where(*train))
    last = list(s.scalars(select(Metric.loss).where(*train).order_by(Metric.step.desc()).limit(DIVERGE_LAST)))
    recent = sum(last) / len(last)
    if recent > DIVERGE_OVER_FIRST * first and recent > DIVERGE_OVER_BEST * best:
        return f"diverged: the last {len(last)} losses average {recent:.4g}, first {first:.4g}, lowest {best:.4g}"
    return None


def add_metric(s: Session, job: Job, record: dict) -> bool:
    """One metrics.jsonl record (posted or read); False when it has no int `step` or is known.

    (job, step, train|eval) is unique, so the post and the file's copy of a line meet once. A
    non-finite value is kept as its string (:func:`json_safe`) and sets the job's flag.
    """
    try:
        validated(EventKind.METRIC.value, record)
    except ValueError:
        return False
    record = json_safe(record)
    kind = "eval" if "eval_loss" in record else "train"
    exists = s.scalar(
        select(Metric.id).where(Metric.job_id == job.id, Metric.step == record["step"], Metric.kind == kind)
    )
    if exists:
        return False
    try:
        with s.begin_nested():
            loss = record.get("loss")
            s.add(
                Metric(job_id=job.id, step=record["step"], kind=kind, loss=loss if _number(loss) else None, data=record)
            )
    except IntegrityError:
        return False
    job.step = max(job.step or 0, record["step"])
    if kind == "train":
        job.last_metrics = record
        s.flush()
        job.flag = loss_flag(s, job, record)
        job.stage = record.get("stage", job.stage)
        if job.state == S.STARTING:
            set_state(s, job, S.RUNNING, phase="training")
    event(s, job, "metric", record)
    return True


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _checkpoint_known(s: Session, job: Job, *, path: str | None = None, step: int | None = None) -> bool:
    """Whether the job's stream has the checkpoint saved in `path` (or at `step`)."""
    s.flush()
    known = s.scalars(select(Event.data).where(Event.job_id == job.id, Event.kind == "checkpoint"))
    if path is not None:
        return any(d.get("path") == path for d in known)
    return step is not None and any(d.get("step") == step for d in known)


def checkpoint_events(s: Session, job: Job) -> dict[str, dict]:
    """Each checkpoint path of the job's stream -> its last event (`removed: true` once its folder
    was found gone: see watch.sync_checkpoints)."""
    s.flush()
    rows = s.scalars(select(Event.data).where(Event.job_id == job.id, Event.kind == "checkpoint").order_by(Event.id))
    return {d["path"]: d for d in rows if isinstance(d.get("path"), str)}


def apply_report(s: Session, job: Job, kind: str, data: dict) -> int:
    """One reported event (`report.EventKind`'s value, as posted or parsed from the log) applied to
    the record; 1 when it was new, 0 when known or of a kind the record does not keep."""
    try:
        kind = EventKind.named(kind)
        data = validated(kind.value, data)
    except ValueError:
        return 0  # a newer run's kind, or data that does not fit: the record unchanged
    if kind is EventKind.METRIC:
        return int(add_metric(s, job, data))
    if kind is EventKind.PHASE:
        if job.state in S.TERMINAL:
            return 0  # read from the log of a job already ended (cancelled): it has no phase
        if job.phase == data.get("phase") and job.stage == data.get("stage", job.stage):
            return 0
        if data.get("phase") == "checkpointing" and _checkpoint_known(s, job, step=data.get("step")):
            return 0  # the log's copy of a posted phase whose checkpoint is already saved
        job.phase = data.get("phase")
        job.stage = data.get("stage", job.stage)
        if job.state == S.STARTING:
            job.state = S.RUNNING
        event(s, job, "state", {"state": job.state, "phase": job.phase, "stage": job.stage})
        return 1
    if kind is EventKind.CHECKPOINT:
        if _checkpoint_known(s, job, path=data.get("path")):
            return 0  # posted by the run and read from its log: once
        event(s, job, "checkpoint", data)
        if job.phase == "checkpointing" and job.state not in S.TERMINAL:
            # The trainer reports the start of a save, not its end: the saved checkpoint is it,
            # and the run goes back to training (a later phase, e.g. exporting, is reported).
            job.phase = "training"
            event(s, job, "state", {"state": job.state, "phase": job.phase, "stage": job.stage})
        return 1
    return 0  # STOPPED: the job's end is settled from its exit (watch.Watcher.settle)


# -- where a queued job stands ---------------------------------------------------------------------
# From what the service knows and nothing else: the jobs ahead (the running ones, then the queued
# ones in the order the watcher starts them: oldest first), `--max-concurrent`, each running job's
# pace (its logged steps, as its own page's ETA) and how long the jobs that finished here took (the
# median of the most recent). Where one of those is missing (a running job that has logged no step
# and no finished job to go by) the estimate is None and `why` says what is missing.

#: The finished jobs whose durations make the typical one: the most recent that succeeded.
TYPICAL_OF = 20
#: The train lines a running job's pace is measured over: its last ones.
PACE_LINES = 50


def pace(lines: Sequence[dict]) -> tuple[float, int, int] | None:
    """(seconds per step, the last step, the run's total steps) from a run's train lines in step
    order, over the last ones of its latest start (`elapsed_s` starts again at a resume), as the job
    page computes its ETA; None without two such lines, a total, or steps that advance."""
    rows = [r for r in lines if _number(r.get("elapsed_s")) and isinstance(r.get("step"), int)]
    if not rows:
        return None
    i = len(rows) - 1
    while i > 0 and rows[i - 1]["elapsed_s"] <= rows[i]["elapsed_s"]:
        i -= 1
    first, last = rows[i], rows[-1]
    total = last.get("total_steps")
    if last["step"] <= first["step"] or not isinstance(total, int):
        return None
    return (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"]), last["step"], total


def start_after(running_left: Sequence[float], queued_ahead: Sequence[float], slots: int) -> float:
    """Seconds until a slot is free for the job behind `queued_ahead` (each one's expected duration,
    in the order they start), with `running_left` the time the running jobs still need and `slots`
    jobs at most at once. Jobs past the limit (started by another service on the same database)
    finish without freeing a slot, as the watcher counts every active job."""
    slots = max(slots, 1)
    left = sorted(running_left)
    free = left[len(left) - slots :] if len(left) > slots else [0.0] * (slots - len(left)) + left
    heapq.heapify(free)
    for duration in queued_ahead:
        heapq.heappush(free, heapq.heappop(free) + duration)
    return free[0]


def durations(s: Session, target: str = "local", limit: int = TYPICAL_OF) -> list[float]:
    """Wall seconds of the most recent succeeded jobs of `target` that ran once (one start: a
    resumed job's last run is part of a run), from their `starting` state event to `succeeded`."""
    ids = list(
        s.scalars(
            select(Job.id)
            .where(Job.state == S.SUCCEEDED, Job.target == target)
            .order_by(Job.updated.desc())
            .limit(limit * 2)
        )
    )
    rows = s.execute(
        select(Event.job_id, Event.created, Event.data)
        .where(Event.job_id.in_(ids), Event.kind == "state")
        .order_by(Event.id)
    ).all()
    starts: dict[str, list[dt.datetime]] = {}
    ends: dict[str, dt.datetime] = {}
    for job_id, created, data in rows:
        if data.get("state") == S.STARTING:
            starts.setdefault(job_id, []).append(created)
        elif data.get("state") == S.SUCCEEDED:
            ends[job_id] = created
    out = [(ends[j] - starts[j][0]).total_seconds() for j in ids if len(starts.get(j, [])) == 1 and j in ends]
    return out[:limit]


def remaining(s: Session, job: Job, typical: float | None, now: dt.datetime) -> tuple[float | None, str]:
    """(seconds the active `job` still needs, how that was told), or (None, why it cannot be)."""
    if job.state == S.STOPPING:
        return 0.0, "stopping (saves a checkpoint and ends)"
    lines = s.scalars(
        select(Metric.data)
        .where(Metric.job_id == job.id, Metric.kind == "train")
        .order_by(Metric.step.desc())
        .limit(PACE_LINES)
    ).all()
    measured = pace(list(reversed(lines)))
    if measured is not None:
        rate, step, total = measured
        return max(total - step, 0) * rate, f"its pace: {rate:.3g} s a step, {max(total - step, 0)} steps left"
    if typical is None:
        return None, f"job {job.id} has logged no step yet, and no job has finished here to tell how long one takes"
    states = s.execute(
        select(Event.created, Event.data).where(Event.job_id == job.id, Event.kind == "state").order_by(Event.id)
    ).all()
    started = [t for t, d in states if d.get("state") == S.STARTING]
    ran = (now - started[-1]).total_seconds() if started else 0.0
    return max(typical - ran, 0.0), f"no step logged yet: a typical job's {typical:.0f} s less the {ran:.0f} s it ran"


def queue_eta(s: Session, job: Job, slots: int | None, now: dt.datetime) -> dict[str, Any]:
    """Where the queued `job` stands: `position` (1: next to start), `ahead` (each job before it:
    id, state, `remaining_s` or None, `basis`), `typical_s` (the median duration of the finished
    jobs here, None without one) and `finished` (how many), `start_in_s` (None: unknown) and
    `why` (what the estimate rests on, or what is missing). A job that is not queued locally has
    no position (`why` says so)."""
    out: dict[str, Any] = {"state": job.state, "position": None, "ahead": [], "typical_s": None, "finished": 0}
    if job.state != S.QUEUED:
        return {**out, "start_in_s": None, "why": f"job {job.id} is {job.state}, not queued"}
    if job.target != "local" or job.target_id or slots is None:
        why = f"{job.target}'s own queue decides when it starts (this service does not hold it)"
        return {**out, "start_in_s": None, "why": why}
    local = Job.target == "local"
    queued = list(
        s.scalars(select(Job).where(local, Job.state == S.QUEUED, Job.target_id.is_(None)).order_by(Job.created))
    )
    ids = [j.id for j in queued]
    before = queued[: ids.index(job.id)] if job.id in ids else []
    active = list(s.scalars(select(Job).where(local, Job.state.in_(list(S.ACTIVE))).order_by(Job.created)))
    took = durations(s)
    typical = statistics.median(took) if took else None
    ahead = []
    for other in active:
        left, basis = remaining(s, other, typical, now)
        ahead.append({"id": other.id, "state": other.state, "remaining_s": left, "basis": basis})
    no_typical = "no job has finished here to tell how long one takes"
    for other in before:
        basis = f"the median of {len(took)} finished jobs here" if typical is not None else no_typical
        ahead.append({"id": other.id, "state": other.state, "remaining_s": typical, "basis": basis})
    out |= {"position": len(before) + 1, "ahead": ahead, "typical_s": typical, "finished": len(took)}
    unknown = next((a for a in ahead if a["remaining_s"] is None), None)
    if unknown is not None:
        return {
            **out,
            "start_in_s": None,
            "why": f"unknown: job {unknown['id']} ({unknown['state']}): {unknown['basis']}",
        }
    start = start_after([a["remaining_s"] for a in ahead[: len(active)]], [typical] * len(before), slots)  # type: ignore[misc]
    why = "; ".join(f"job {a['id']} ({a['state']}): {a['basis']}" for a in ahead) or "a slot is free"
    return {**out, "start_in_s": start, "why": why}
