"""The FastAPI app: the REST API of the job service (OpenAPI at /docs, behind a read token once
tokens exist) and the web page (web.py); `guard.Guard` stands before both."""

import asyncio
import contextlib
import json
import logging
import posixpath
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field, model_validator
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sse_starlette.sse import EventSourceResponse

from scaletune.errors import UserError
from scaletune.serve import auth
from scaletune.serve.db import kept_key, scrubbed
from scaletune.serve.guard import Guard
from scaletune.serve.jobs import JobNotFound, JobService
from scaletune.serve.records import MAX_INT, validated

log = logging.getLogger(__name__)
HEARTBEAT_S = 10.0
ARTIFACTS = ("final", "loss.png", "metrics.jsonl", "config.yaml", "plan.json", "memory.json", "checkpoints")
MAX_LOG_BYTES = 8 << 20  # one /logs answer at most
# Swagger UI's script and style come from its CDN: the one page allowed to load them.
DOCS_CSP = (
    "default-src 'none'; script-src 'unsafe-inline' https://cdn.jsdelivr.net; "
    "style-src https://cdn.jsdelivr.net; img-src 'self' data: https://fastapi.tiangolo.com; "
    "connect-src 'self'; frame-ancestors 'none'"
)


class JobRequest(BaseModel):
    config: str = Field(description="The YAML config, as text.")
    overrides: list[str] = Field(default_factory=list, description="Dotted overrides, as on the command line.")
    target: str = Field("local", description="local | slurm | modal")
    resources: dict[str, Any] = Field(default_factory=dict, description="Target resources (nodes, gpus_per_node, ...).")
    dry_run: bool = Field(False, description="Return the resolved plan and what would be submitted; submit nothing.")


class ResumeRequest(BaseModel):
    checkpoint: str | None = Field(None, description="A checkpoints/step-N folder; default: the latest.")
    target: str | None = Field(None, description="Another target; default: the job's.")
    resources: dict[str, Any] | None = Field(None, description="Other resources (e.g. more ranks).")
    overrides: list[str] = Field(default_factory=list, description="Added overrides, e.g. distributed.num_processes=2.")


class CloneRequest(BaseModel):
    overrides: list[str] = Field(default_factory=list)


class ReportEvent(BaseModel):
    kind: str = Field(max_length=32)
    data: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _fits(self) -> "ReportEvent":
        validated(self.kind, self.data)  # ValueError: a 422 naming what does not fit
        return self


class ReportRequest(BaseModel):
    events: list[ReportEvent] = Field(max_length=1000)


class PolicyUpdate(BaseModel):
    """Admin settings to change (the others stay); see docs/serve.md."""

    allow_factories: bool | None = None
    allow_remote_code: bool | None = None
    env_prefixes: list[str] | None = None
    read_roots: list[str] | None = None
    write_roots: list[str] | None = None
    trusted_hosts: list[str] | None = None
    trusted_origins: list[str] | None = None


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

    def caller(request: Request) -> auth.Caller:
        header = request.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            scope = auth.scope_of(svc.Session, header[7:].strip())
            if scope is None:
                raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
            return auth.Caller(scope)
        cookie = request.cookies.get(auth.COOKIE)
        if cookie:
            scope = auth.scope_of(svc.Session, cookie)
            if scope is not None:
                if request.method not in ("GET", "HEAD", "OPTIONS") and not app.state.csrf.valid(
                    cookie, request.headers.get("x-csrf-token")
                ):
                    raise HTTPException(403, "missing or wrong CSRF token")
                return auth.Caller(scope, by_cookie=True, cookie=cookie)
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

    read, submit, admin = Depends(need("read")), Depends(need("submit")), Depends(need("admin"))

    @app.get("/openapi.json", include_in_schema=False, dependencies=[read])
    def openapi():
        return app.openapi()

    @app.get("/docs", include_in_schema=False, dependencies=[read])
    def docs():
        page = get_swagger_ui_html(openapi_url="/openapi.json", title="scaletune serve API")
        page.headers["content-security-policy"] = DOCS_CSP
        return page

    @app.get("/healthz", tags=["service"])
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

    @app.put("/api/admin/policy", dependencies=[admin])
    def put_policy(req: PolicyUpdate):
        svc.policy = svc.policy.updated(**req.model_dump(exclude_none=True))
        return svc.policy.public()

    def job_or_404(job_id: str):
        job = svc.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def bad(exc: UserError) -> JSONResponse:
        return JSONResponse({"detail": exc.title, "problems": exc.problems}, status_code=422)

    @app.post("/api/jobs", status_code=201, dependencies=[submit])
    def create_job(req: JobRequest):
        try:
            out = svc.submit(req.config, req.overrides, req.target, req.resources, req.dry_run)
        except UserError as exc:
            return bad(exc)
        return JSONResponse(out, status_code=200 if req.dry_run else 201)

    @app.get("/api/jobs", dependencies=[read])
    def list_jobs():
        return [j.summary() for j in svc.list()]

    @app.get("/api/jobs/{job_id}", dependencies=[read])
    def get_job(job_id: str):
        return job_or_404(job_id).summary()

    @app.get("/api/jobs/{job_id}/metrics", dependencies=[read])
    def get_metrics(job_id: str, since_step: Annotated[int, Query(ge=0, le=MAX_INT)] = 0):
        job_or_404(job_id)
        return svc.metrics(job_id, since_step)

    @app.get("/api/jobs/{job_id}/logs", dependencies=[read], response_class=PlainTextResponse)
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
        return svc.dispatchers[job.target].logs(svc.files(job), offset, limit)

    @app.get("/api/jobs/{job_id}/events", dependencies=[read])
    async def events(job_id: str, request: Request):
        job_or_404(job_id)
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
        if not (last.isdigit() and len(last) <= 15):
            raise HTTPException(400, "Last-Event-ID: an event id (a number below 10**15)")
        cursor = int(last)

        async def stream():
            nonlocal cursor
            quiet = 0.0
            while not await request.is_disconnected():
                rows = await asyncio.to_thread(svc.events_after, job_id, cursor)
                for eid, kind, data in rows:
                    cursor = eid
                    yield {"id": str(eid), "event": kind, "data": json.dumps(data)}
                if rows:
                    quiet = 0.0
                await asyncio.sleep(0.3)
                quiet += 0.3
                if quiet >= HEARTBEAT_S:
                    quiet = 0.0
                    yield {"id": str(cursor), "event": "heartbeat", "data": "{}"}

        return EventSourceResponse(stream(), ping=3600)

    def control(fn, *args):
        try:
            return fn(*args).summary()
        except UserError as exc:
            return JSONResponse({"detail": exc.title, "problems": exc.problems}, status_code=409)

    @app.post("/api/jobs/{job_id}/stop", dependencies=[submit])
    def stop(job_id: str):
        return control(svc.stop, job_id)

    @app.post("/api/jobs/{job_id}/cancel", dependencies=[submit])
    def cancel(job_id: str):
        return control(svc.cancel, job_id)

    @app.post("/api/jobs/{job_id}/resume", dependencies=[submit])
    def resume(job_id: str, req: ResumeRequest | None = None):
        req = req or ResumeRequest()
        job_or_404(job_id)
        try:
            return svc.resume(job_id, req.checkpoint, req.target, req.resources, req.overrides).summary()
        except UserError as exc:
            return bad(exc)

    @app.post("/api/jobs/{job_id}/clone", status_code=201, dependencies=[submit])
    def clone(job_id: str, req: CloneRequest | None = None):
        job_or_404(job_id)
        try:
            return svc.clone(job_id, (req or CloneRequest()).overrides)
        except UserError as exc:
            return bad(exc)

    @app.post("/api/jobs/{job_id}/report")
    def report(job_id: str, req: ReportRequest, request: Request):
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not token or not svc.check_job_token(job_id, token):
            raise HTTPException(401, "this job's report token is required", headers={"WWW-Authenticate": "Bearer"})
        return {"accepted": svc.ingest(job_id, [e.model_dump() for e in req.events])}

    @app.get("/api/jobs/{job_id}/artifacts/{path:path}", dependencies=[read])
    def artifact(job_id: str, path: str):
        """A file of the run's allow-list (or a listing of a folder of it), as an attachment."""
        job = job_or_404(job_id)
        if "\x00" in path or "\\" in path:
            raise HTTPException(404, "not an artifact of this run")
        rel = posixpath.normpath(path)  # `final/../X` is `X`: the allow-list sees what is served
        parts = rel.split("/")
        if rel.startswith(("/", "..")) or parts[0] not in ARTIFACTS:
            raise HTTPException(404, "not an artifact of this run")
        root = Path(job.run_dir).resolve()
        allowed = (root / parts[0]).resolve()
        target = (root / rel).resolve()  # links followed: they must stay inside the allowed entry
        if not (target == allowed or target.is_relative_to(allowed)) or not allowed.is_relative_to(root):
            raise HTTPException(404, "not an artifact of this run")
        if target.is_dir():
            return sorted(str(p.relative_to(root)) for p in target.rglob("*") if p.is_file() and not p.is_symlink())
        if not target.is_file():
            raise HTTPException(404, f"{rel}: not written (yet)")
        return FileResponse(target, filename=target.name, content_disposition_type="attachment")

    from scaletune.serve.web import add_pages

    add_pages(app, svc, caller)
    return app
