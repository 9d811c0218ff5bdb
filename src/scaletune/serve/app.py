"""The FastAPI app: the REST API of the job service (OpenAPI at /docs, behind a read token once
tokens exist) and the web page (web.py); `guard.Guard` stands before both."""

import asyncio
import contextlib
import json
import logging
import posixpath
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sse_starlette.sse import EventSourceResponse

from scaletune.errors import UserError
from scaletune.serve import auth
from scaletune.serve.apidocs import add_docs
from scaletune.serve.db import kept_key, scrubbed
from scaletune.serve.guard import Guard
from scaletune.serve.jobs import JobNotFound, JobService
from scaletune.serve.records import MAX_INT
from scaletune.serve.schemas import (
    CloneRequest,
    Health,
    JobRequest,
    JobSummary,
    PolicyUpdate,
    ReportRequest,
    ResumeRequest,
    Submitted,
    problems_responses,
    refusal,
    validation_lines,
)
from scaletune.serve.states import TERMINAL
from scaletune.serve.teams import add_team_routes, need_owner, record

log = logging.getLogger(__name__)
HEARTBEAT_S = 10.0
ARTIFACTS = (
    *("final", "loss.png", "metrics.jsonl", "config.yaml", "plan.json", "memory.json", "checkpoints", "eval"),
    *("samples.md", "samples.jsonl", "exports"),
)
MAX_LOG_BYTES = 8 << 20  # one /logs answer at most
# Declared in /openapi.json (Swagger's Authorize button); auto_error off: the page's session
# cookie and the token-less mode authenticate too, and `caller` words the 401 itself.
BEARER = HTTPBearer(scheme_name="token", description="An API token: scaletune serve token create", auto_error=False)
JOB_BEARER = HTTPBearer(scheme_name="job token", description="The job's own report token", auto_error=False)
E422, E409_422 = problems_responses(422), problems_responses(409, 422)


def create_app(svc: JobService, *, start: bool = True) -> FastAPI:
    """The app around a job service; with `start`, its watcher runs while the app does."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if start:
            svc.start()
        yield
        if start:
            svc.shutdown()

    app = FastAPI(title="scaletune serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.svc = svc
    app.state.csrf = auth.Csrf(kept_key(svc.Session, "csrf"))

    def open_mode() -> bool:
        # A database that does not answer cannot say whether tokens exist: answer as a tokenless
        # service does (loopback names only), the stricter, so /healthz can still say 503.
        try:
            return not auth.has_tokens(svc.Session)
        except SQLAlchemyError:
            return True

    app.add_middleware(Guard, policy=lambda: svc.policy, open_mode=open_mode)

    @app.exception_handler(JobNotFound)
    async def not_found(request: Request, exc: JobNotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        # The shape of a refused config (one for every 422), not FastAPI's list of {loc, msg}.
        return refusal("invalid request", validation_lines(exc))

    def caller(
        request: Request, bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]
    ) -> auth.Caller:
        if bearer is not None:
            found = auth.identify(svc.Session, bearer.credentials.strip())
            if found is None:
                raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
            return auth.Caller(found[1], found[0])
        cookie = request.cookies.get(auth.COOKIE)
        if cookie:
            found = auth.identify(svc.Session, cookie)
            if found is not None:
                if request.method not in ("GET", "HEAD", "OPTIONS") and not app.state.csrf.valid(
                    cookie, request.headers.get("x-csrf-token")
                ):
                    raise HTTPException(403, "missing or wrong CSRF token")
                return auth.Caller(found[1], found[0], by_cookie=True, cookie=cookie)
        if not auth.has_tokens(svc.Session):
            return auth.Caller("admin")  # no tokens: loopback only (bind_problems)
        raise HTTPException(
            401, "a token is required (Authorization: Bearer TOKEN)", headers={"WWW-Authenticate": "Bearer"}
        )

    def need(scope: str):
        def dep(c: Annotated[auth.Caller, Depends(caller)]) -> auth.Caller:
            if not auth.allows(c.scope, scope):
                raise HTTPException(403, f"this token's scope is {c.scope}; {scope} is needed")
            return c

        return dep

    read, admin = Depends(need("read")), Depends(need("admin"))

    add_docs(app, read)

    @app.get(
        "/healthz",
        tags=["service"],
        response_model=Health,
        response_model_exclude_none=True,
        responses={503: {"model": Health}},
    )
    def healthz():
        """200 `{"status": "ok"}` once the job database answers, else 503; no token needed (for a
        load balancer or a platform's health check)."""
        try:
            with svc.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except SQLAlchemyError as exc:
            log.warning("healthz: the job database does not answer: %s", scrubbed(exc, svc.engine.url))
            return JSONResponse({"status": "unavailable", "detail": "the job database does not answer"}, 503)
        return {"status": "ok"}

    @app.get("/api/admin/policy", dependencies=[admin])
    def get_policy():
        return svc.policy.public()

    @app.put("/api/admin/policy", responses=E422)
    def put_policy(req: PolicyUpdate, c: Annotated[auth.Caller, Depends(need("admin"))]):
        change = req.model_dump(exclude_none=True)
        svc.policy = svc.policy.updated(**change)
        record(svc.Session, c.name, "policy.update", detail=json.dumps(change, sort_keys=True))
        return svc.policy.public()

    def job_or_404(job_id: str):
        job = svc.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def stored(job_id: str, head: str) -> str:
        """An audit row's detail: `head` and the job's overrides as stored, secret values taken out
        at submission (the request's own overrides may hold them)."""
        job = svc.get(job_id)
        return " ".join([head, *(job.overrides if job is not None else [])])

    def bad(exc: UserError) -> JSONResponse:
        return refusal(exc.title, exc.problems)

    @app.post(
        "/api/jobs",
        status_code=201,
        response_model=Submitted,
        response_model_exclude_unset=True,  # a queued job's answer has no `plan` key
        responses={200: {"model": Submitted, "description": "dry run: the plan, nothing submitted"}, **E422},
    )
    def create_job(req: JobRequest, response: Response, c: Annotated[auth.Caller, Depends(need("submit"))]):
        try:
            out = svc.submit(req.config, req.overrides, req.target, req.resources, req.dry_run, owner=c.name)
        except UserError as exc:
            return bad(exc)
        response.status_code = 200 if req.dry_run else 201
        if not req.dry_run:
            record(svc.Session, c.name, "job.submit", out["id"], stored(out["id"], f"target {req.target}"))
        return out

    @app.get("/api/jobs", dependencies=[read], response_model=list[JobSummary])
    def list_jobs():
        return [j.summary() for j in svc.list()]

    @app.get("/api/jobs/{job_id}", dependencies=[read], response_model=JobSummary, responses=E422)
    def get_job(job_id: str):
        return job_or_404(job_id).summary()

    @app.get("/api/jobs/{job_id}/metrics", dependencies=[read], responses=E422)
    def get_metrics(job_id: str, since_step: Annotated[int, Query(ge=0, le=MAX_INT)] = 0):
        job_or_404(job_id)
        return svc.metrics(job_id, since_step)

    @app.get("/api/jobs/{job_id}/logs", dependencies=[read], response_class=PlainTextResponse, responses=E422)
    def get_logs(
        job_id: str,
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
        job = job_or_404(job_id)
        # The log's bytes as written (not decoded and encoded again): a reader's next offset is its
        # offset plus the bytes it got, invalid UTF-8 or a cut character included.
        data = svc.dispatchers[job.target].log_bytes(svc.files(job), offset, limit)
        return Response(data, media_type="text/plain; charset=utf-8")

    @app.get("/api/jobs/{job_id}/events", dependencies=[read], responses=E422)
    async def events(job_id: str, request: Request):
        job_or_404(job_id)
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
        if not (last.isdigit() and len(last) <= 15):
            raise HTTPException(400, "Last-Event-ID: an event id (a number below 10**15)")
        cursor = int(last)

        async def stream():
            nonlocal cursor
            quiet = 0.0
            ended_polls = 0
            while not await request.is_disconnected():
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

        return EventSourceResponse(stream(), ping=3600)

    Submitter = Annotated[auth.Caller, Depends(need("submit"))]

    def control(c: auth.Caller, verb: str, job_id: str):
        need_owner(c, job_or_404(job_id))
        try:
            done = getattr(svc, verb)(job_id).summary()
        except UserError as exc:
            return refusal(exc.title, exc.problems, 409)
        record(svc.Session, c.name, f"job.{verb}", job_id)
        return done

    @app.post("/api/jobs/{job_id}/stop", response_model=JobSummary, responses=E409_422)
    def stop(job_id: str, c: Submitter):
        return control(c, "stop", job_id)

    @app.post("/api/jobs/{job_id}/cancel", response_model=JobSummary, responses=E409_422)
    def cancel(job_id: str, c: Submitter):
        return control(c, "cancel", job_id)

    @app.post("/api/jobs/{job_id}/resume", response_model=JobSummary, responses=E422)
    def resume(job_id: str, c: Submitter, req: ResumeRequest | None = None):
        req = req or ResumeRequest()
        need_owner(c, job_or_404(job_id))
        try:
            done = svc.resume(job_id, req.checkpoint, req.target, req.resources, req.overrides).summary()
        except UserError as exc:
            return bad(exc)
        record(svc.Session, c.name, "job.resume", job_id, stored(job_id, f"from {req.checkpoint or 'latest'}"))
        return done

    @app.post(
        "/api/jobs/{job_id}/clone",
        status_code=201,
        response_model=Submitted,
        response_model_exclude_unset=True,
        responses=E422,
    )
    def clone(job_id: str, c: Submitter, req: CloneRequest | None = None):
        job_or_404(job_id)
        overrides = (req or CloneRequest()).overrides
        try:
            out = svc.clone(job_id, overrides, owner=c.name)
        except UserError as exc:
            return bad(exc)
        record(svc.Session, c.name, "job.clone", out["id"], stored(out["id"], f"of {job_id}"))
        return out

    @app.post("/api/jobs/{job_id}/report", responses=E422)
    def report(
        job_id: str,
        req: ReportRequest,
        bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(JOB_BEARER)],
    ):
        token = bearer.credentials.strip() if bearer is not None else ""
        if not token or not svc.check_job_token(job_id, token):
            raise HTTPException(401, "this job's report token is required", headers={"WWW-Authenticate": "Bearer"})
        return {"accepted": svc.ingest(job_id, [e.model_dump() for e in req.events])}

    @app.get(
        "/api/jobs/{job_id}/artifacts/{path:path}",
        dependencies=[read],
        responses={**E422, 502: {"description": "Modal's volume could not be asked: where it is, how to fetch it"}},
    )
    def artifact(job_id: str, path: str):
        """A file of the run's allow-list (or a listing of a folder of it), as an attachment: read
        from the run directory, or from the Modal volume for a Modal job (502, naming the volume,
        the path and the `modal volume get` command, when Modal cannot be asked)."""
        import mimetypes
        from urllib.parse import quote

        from fastapi.responses import StreamingResponse

        from scaletune.serve.dispatch.base import ArtifactMissing, ArtifactUnreachable

        job = job_or_404(job_id)
        if "\x00" in path or "\\" in path:
            raise HTTPException(404, "not an artifact of this run")
        rel = posixpath.normpath(path)  # `final/../X` is `X`: the allow-list sees what is served
        # The allow-list, here only and before any target is asked: dispatchers get `rel` checked.
        if rel.startswith(("/", "..")) or rel.split("/")[0] not in ARTIFACTS:
            raise HTTPException(404, "not an artifact of this run")
        try:
            found = svc.dispatchers[job.target].artifact(svc.files(job), job.run_dir, rel)
        except ArtifactMissing as exc:
            raise HTTPException(404, str(exc)) from None
        except ArtifactUnreachable as exc:
            raise HTTPException(502, str(exc)) from None
        if isinstance(found, list):
            return found
        if found.path is not None:
            return FileResponse(found.path, filename=found.name, content_disposition_type="attachment")
        name = quote(found.name)  # as FileResponse words it
        disposition = f'attachment; filename="{name}"' if name == found.name else f"attachment; filename*=utf-8''{name}"
        headers = {"content-disposition": disposition}
        if found.size is not None:
            headers["content-length"] = str(found.size)
        kind = mimetypes.guess_type(found.name)[0] or "application/octet-stream"
        return StreamingResponse(found.chunks, media_type=kind, headers=headers)

    from scaletune.serve.datasets import add_data_routes
    from scaletune.serve.form import add_form_routes
    from scaletune.serve.results import add_result_routes
    from scaletune.serve.web import add_pages

    add_team_routes(app, svc, caller, read, admin)
    add_data_routes(app, svc, need)
    add_form_routes(app, svc, need)
    add_result_routes(app, svc, need)
    add_pages(app, svc, caller)
    return app
