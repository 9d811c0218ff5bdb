"""The FastAPI app: the REST API of the job service (OpenAPI at /docs) and the web page (web.py)."""

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse

from scaletune.errors import UserError
from scaletune.serve import auth
from scaletune.serve.jobs import JobNotFound, JobService

HEARTBEAT_S = 10.0
ARTIFACTS = ("final", "loss.png", "metrics.jsonl", "config.yaml", "plan.json", "memory.json", "checkpoints")


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


class ReportRequest(BaseModel):
    events: list[dict[str, Any]]


def create_app(svc: JobService, *, start: bool = True) -> FastAPI:
    """The app around a job service; with `start`, its watcher runs while the app does."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if start:
            svc.start()
        yield
        if start:
            svc.shutdown()

    app = FastAPI(title="scaletune serve", lifespan=lifespan)
    app.state.svc = svc
    app.state.csrf = auth.Csrf()

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

    read, submit = Depends(need("read")), Depends(need("submit"))

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
    def get_metrics(job_id: str, since_step: int = 0):
        job_or_404(job_id)
        return svc.metrics(job_id, since_step)

    @app.get("/api/jobs/{job_id}/logs", dependencies=[read], response_class=PlainTextResponse)
    def get_logs(job_id: str, rank: int | None = None):
        job = job_or_404(job_id)
        return svc.dispatchers[job.target].logs(svc.files(job), rank)

    @app.get("/api/jobs/{job_id}/events", dependencies=[read])
    async def events(job_id: str, request: Request):
        job_or_404(job_id)
        last = request.headers.get("last-event-id") or request.query_params.get("last_event_id") or "0"
        cursor = int(last) if last.isdigit() else 0

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
        return {"accepted": svc.ingest(job_id, req.events)}

    @app.get("/api/jobs/{job_id}/artifacts/{path:path}", dependencies=[read])
    def artifact(job_id: str, path: str):
        job = job_or_404(job_id)
        root = Path(job.run_dir).resolve()
        target = (root / path).resolve()
        if not target.is_relative_to(root) or target == root or Path(path).parts[0] not in ARTIFACTS:
            raise HTTPException(404, "not an artifact of this run")
        if target.is_dir():
            return sorted(str(p.relative_to(root)) for p in target.rglob("*") if p.is_file())
        if not target.is_file():
            raise HTTPException(404, f"{path}: not written (yet)")
        return FileResponse(target)

    from scaletune.serve.web import add_pages

    add_pages(app, svc, caller)
    return app
