"""The job routes: submit (or dry-run) a config, list and read jobs, their metrics, log and SSE
events with replay (ending after a terminal state), stop / cancel / resume / clone / delete, and the
job's own reports (its report token, not an API token)."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
import asyncio
import json
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials
from sse_starlette.sse import EventSourceResponse

from scaletune.errors import UserError
from scaletune.serve.api.schemas import (
    E409_422,
    E422,
    CloneRequest,
    Deleted,
    JobRequest,
    JobSummary,
    MetricsSummary,
    QueuePlace,
    ReportRequest,
    ResumeRequest,
    SecretsRequest,
    Submitted,
    refusal,
)
from scaletune.serve.edge import auth
from scaletune.serve.edge.access import JOB_BEARER, Submitter, Svc, read, still_allowed
from scaletune.serve.edge.teams import need_owner, record
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs import vault
from scaletune.serve.jobs.db import Job, now
from scaletune.serve.jobs.metric_summary import summarize
from scaletune.serve.jobs.records import MAX_INT, queue_eta
from scaletune.serve.jobs.removal import delete_job as remove_job
from scaletune.serve.jobs.service import JobNotFound, JobService
from scaletune.serve.jobs.states import TERMINAL

HEARTBEAT_S = 10.0
MAX_LOG_BYTES = 8 << 20  # one /logs answer at most
router = APIRouter()


def job_or_404(svc: JobService, job_id: str) -> Job:
    """The job; JobNotFound (the app answers 404) when there is none."""
    job = svc.get(job_id)
    if job is None:
        raise JobNotFound(job_id)
    return job


def stored(svc: JobService, job_id: str, head: str) -> str:
    """An audit row's detail: `head` and the job's overrides as stored, secret values taken out
    at submission (the request's own overrides may hold them)."""
    job = svc.get(job_id)
    return " ".join([head, *(job.overrides if job is not None else [])])


def bad(exc: UserError) -> JSONResponse:
    return refusal(exc.title, exc.problems)


@router.post(
    "/api/jobs",
    status_code=201,
    response_model=Submitted,
    response_model_exclude_unset=True,  # a queued job's answer has no `plan` key
    responses={
        200: {"model": Submitted, "description": "dry run: the plan, nothing submitted; or a request_id sent before"},
        202: {"model": Submitted, "description": "recorded; its check outlasted wait_s and goes on (`checking`)"},
        **E422,
    },
)
def create_job(req: JobRequest, response: Response, c: Submitter, svc: Svc):
    try:
        out = svc.submit(
            req.config,
            req.overrides,
            req.target,
            req.resources,
            req.dry_run,
            owner=c.name,
            request_id=req.request_id,
            wait_s=req.wait_s,
        )
    except UserError as exc:
        return bad(exc)
    if req.dry_run or out.get("replayed"):
        response.status_code = 200
        return out
    response.status_code = 202 if out["state"] == S.CHECKING else 201
    record(svc.Session, c.name, "job.submit", out["id"], stored(svc, out["id"], f"target {req.target}"))
    return out


@router.get("/api/jobs", dependencies=[read], response_model=list[JobSummary])
def list_jobs(svc: Svc):
    return [j.summary() for j in svc.list()]


@router.get("/api/jobs/{job_id}", dependencies=[read], response_model=JobSummary, responses=E422)
def get_job(job_id: str, svc: Svc):
    return job_or_404(svc, job_id).summary()


@router.get("/api/jobs/{job_id}/metrics", dependencies=[read], responses=E422)
def get_metrics(
    job_id: str,
    svc: Svc,
    since_step: Annotated[
        int | None,
        Query(ge=0, le=MAX_INT, description="Only the lines of later steps. Default: every line, step 0's included."),
    ] = None,
):
    """The job's metrics.jsonl lines by step: every line by default, the evaluation before training
    (step 0, `training.eval_on_start`) included; with `since_step`, those of later steps."""
    job_or_404(svc, job_id)
    return svc.metrics(job_id, since_step)


@router.get("/api/jobs/{job_id}/metrics/summary", dependencies=[read], response_model=MetricsSummary, responses=E422)
def get_metrics_summary(job_id: str, svc: Svc):
    """The job's metrics summed up: the metrics it logged and the last value of each, the best eval
    loss, steps, tokens and training time (the compare page's table); null where it logged nothing."""
    job_or_404(svc, job_id)
    return summarize(svc.metrics(job_id))


@router.get("/api/jobs/{job_id}/logs", dependencies=[read], response_class=PlainTextResponse, responses=E422)
def get_logs(
    job_id: str,
    svc: Svc,
    rank: Annotated[int | None, Query(ge=0, le=1 << 20, description="Refused: see below.")] = None,
    offset: Annotated[int | None, Query(ge=0, le=MAX_INT, description="Bytes; default: the end.")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LOG_BYTES, description="Bytes at most.")] = 1 << 20,
):
    """At most `limit` bytes of the job's log from `offset` (default: its last `limit` bytes).

    `rank` is refused (422): the log does not separate ranks. Rank 0 prints for the run and the
    other ranks stay quiet; torchrun runs without `--tee`, so only an uncaught error's traceback
    is prefixed `[rankN]:`, and a filter would return nearly the whole log as if it were rank N's.
    """
    if rank is not None:
        raise RequestValidationError(
            [
                {
                    "type": "value_error",
                    "loc": ("query", "rank"),
                    "msg": "ranks are not separated in this log (rank 0 prints for the run; only an uncaught "
                    "error's traceback lines are prefixed [rankN]:), so it cannot be filtered by rank; "
                    "leave out rank",
                    "input": str(rank),
                }
            ]
        )
    job = job_or_404(svc, job_id)
    # The log's bytes as written (not decoded and encoded again): a reader's next offset is its
    # offset plus the bytes it got, invalid UTF-8 or a cut character included.
    data = svc.dispatchers[job.target].log_bytes(svc.files(job), offset, limit)
    return Response(data, media_type="text/plain; charset=utf-8")


@router.get("/api/jobs/{job_id}/queue", dependencies=[read], response_model=QueuePlace, responses=E422)
def get_queue_place(job_id: str, svc: Svc):
    """Where a queued job stands: its position, the jobs ahead (the running ones with the time each
    still needs by its pace, the queued ones with the median duration of the jobs that finished
    here) and `start_in_s`, when a slot should be free for it (`--max-concurrent`); null with the
    reason in `why` where nothing supports an estimate (no finished job, a job that has logged no
    step). Another target's queued job has no position here."""
    job = job_or_404(svc, job_id)
    d = svc.dispatchers.get(job.target)
    with svc.Session() as s:
        return queue_eta(s, job, d.max_concurrent if d is not None else None, now())


@router.get("/api/jobs/{job_id}/events", dependencies=[read], responses=E422)
async def events(job_id: str, request: Request, svc: Svc):
    job_or_404(svc, job_id)
    last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
    if not (last.isdigit() and len(last) <= 15):
        raise HTTPException(400, "Last-Event-ID: an event id (a number below 10**15)")
    return EventSourceResponse(event_stream(svc, job_id, int(last), request), ping=3600)


REVOCATION_POLLS = 10  # the stream's token is checked every 10 polls (3 s)


async def event_stream(svc: JobService, job_id: str, cursor: int, request: Request):
    """The job's events after `cursor` as server-sent events, polled until the client leaves, the
    job has ended, or the token the stream was opened with is revoked (checked every few seconds)."""
    quiet = 0.0
    ended_polls = 0
    polls = 0
    while not await request.is_disconnected():
        polls += 1
        if polls % REVOCATION_POLLS == 0 and not await asyncio.to_thread(still_allowed, request):
            return
        rows = await asyncio.to_thread(svc.events_after, job_id, cursor)
        for eid, kind, data in rows:
            cursor = eid
            yield {"id": str(eid), "event": kind, "data": json.dumps(data)}
        if rows:
            quiet = 0.0
        # The stream ends once the job's record is terminal and nothing came for two polls
        # (the watcher stores a run's last log lines just after its end state), with an
        # `end` event: a script's client stops there. A browser's EventSource reconnects
        # after `retry` ms from the last id: a tab on a finished job asks every 10 s and
        # sees a resume's events, instead of holding a connection open forever.
        job = await asyncio.to_thread(svc.get, job_id)
        ended_polls = ended_polls + 1 if not rows and (job is None or job.state in TERMINAL) else 0
        if ended_polls >= 2:
            state = job.state if job is not None else None
            yield {"id": str(cursor), "event": "end", "data": json.dumps({"state": state}), "retry": 10_000}
            return
        await asyncio.sleep(0.3)
        quiet += 0.3
        if quiet >= HEARTBEAT_S:
            quiet = 0.0
            yield {"id": str(cursor), "event": "heartbeat", "data": "{}"}


def control(svc: JobService, c: auth.Caller, verb: str, job_id: str):
    need_owner(c, job_or_404(svc, job_id))
    try:
        done = getattr(svc, verb)(job_id).summary()
    except UserError as exc:
        return refusal(exc.title, exc.problems, 409)
    record(svc.Session, c.name, f"job.{verb}", job_id)
    return done


@router.post("/api/jobs/{job_id}/stop", response_model=JobSummary, responses=E409_422)
def stop(job_id: str, c: Submitter, svc: Svc):
    return control(svc, c, "stop", job_id)


@router.post("/api/jobs/{job_id}/cancel", response_model=JobSummary, responses=E409_422)
def cancel(job_id: str, c: Submitter, svc: Svc):
    return control(svc, c, "cancel", job_id)


@router.post("/api/jobs/{job_id}/resume", response_model=JobSummary, responses=E422)
def resume(job_id: str, c: Submitter, svc: Svc, req: ResumeRequest | None = None):
    req = req or ResumeRequest()
    need_owner(c, job_or_404(svc, job_id))
    try:
        done = svc.resume(job_id, req.checkpoint, req.target, req.resources, req.overrides).summary()
    except UserError as exc:
        return bad(exc)
    record(svc.Session, c.name, "job.resume", job_id, stored(svc, job_id, f"from {req.checkpoint or 'latest'}"))
    return done


@router.delete("/api/jobs/{job_id}", response_model=Deleted, responses=E409_422)
def delete_job(job_id: str, request: Request, c: Submitter, svc: Svc):
    """Delete an ended job (its owner or an admin): its records (tasks, events, metrics, the job),
    its job folder and its run folder on this machine, where they lie inside the service's run
    folders (links removed, never followed). 409 for a job that has not ended (cancel it first),
    whose process still runs or that has a task running. `kept` says what was not deleted and why:
    a Modal job's run on its volume, a SLURM job's record at the cluster, a folder outside the run
    folders. The audit record keeps the deletion (`job.delete`)."""
    job = job_or_404(svc, job_id)
    need_owner(c, job)
    request.app.state.tasks.sweep()  # a task a stopped service left `running` holds nothing
    try:
        out = remove_job(svc, job_id)
    except UserError as exc:
        return refusal(exc.title, exc.problems, 409)
    head = f"{job.name} ({job.state}, {job.target}, owner {job.owner or '-'}): "
    record(svc.Session, c.name, "job.delete", job_id, head + out.summary())
    return out.public()


@router.post(
    "/api/jobs/{job_id}/clone",
    status_code=201,
    response_model=Submitted,
    response_model_exclude_unset=True,
    responses=E422,
)
def clone(job_id: str, c: Submitter, svc: Svc, req: CloneRequest | None = None):
    job_or_404(svc, job_id)
    overrides = (req or CloneRequest()).overrides
    try:
        out = svc.clone(job_id, overrides, owner=c.name)
    except UserError as exc:
        return bad(exc)
    record(svc.Session, c.name, "job.clone", out["id"], stored(svc, out["id"], f"of {job_id}"))
    return out


@router.put("/api/jobs/{job_id}/secrets", response_model=JobSummary, responses=E409_422)
def give_secrets(job_id: str, req: SecretsRequest, c: Submitter, svc: Svc):
    """The secrets of a job that needs them again (`needs_secrets`: the service restarted without
    SCALETUNE_SECRETS_KEY, or with another key): every secret variable it was submitted with, no other.
    Its owner or an admin; the job is queued. No value is answered, logged or audited (names only)."""
    need_owner(c, job_or_404(svc, job_id))
    try:
        done = vault.give(svc, job_id, req.secrets).summary()
    except vault.NotWaiting as exc:
        return refusal(exc.title, exc.problems, 409)
    except UserError as exc:
        return bad(exc)
    record(svc.Session, c.name, "job.secrets", job_id, "given again: " + ", ".join(sorted(req.secrets)))
    return done


@router.post("/api/jobs/{job_id}/report", responses=E422)
def report(
    job_id: str,
    req: ReportRequest,
    svc: Svc,
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(JOB_BEARER)],
):
    token = bearer.credentials.strip() if bearer is not None else ""
    if not token or not svc.check_job_token(job_id, token):
        raise HTTPException(401, "this job's report token is required", headers={"WWW-Authenticate": "Bearer"})
    return {"accepted": svc.ingest(job_id, [e.model_dump() for e in req.events])}
