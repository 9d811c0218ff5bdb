"""The FastAPI app: the REST API of the job service (`api/`, one router per resource; OpenAPI at
/docs, behind a read token once tokens exist) and the web page (`page/`); `edge.guard.Guard`
stands before both. This module only assembles them: the app's state, the exception handlers, the
lifespan, the routers."""

import contextlib

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from scaletune.serve.api import artifacts, chat, config, data, docs, jobs, mcp_server, results, service, tasks, teams
from scaletune.serve.api.results import Refused, refused
from scaletune.serve.api.schemas import refusal, validation_lines
from scaletune.serve.edge import access, auth
from scaletune.serve.edge.guard import Guard
from scaletune.serve.jobs.chatting import ModelSlot
from scaletune.serve.jobs.db import kept_key
from scaletune.serve.jobs.retention import Sweeper
from scaletune.serve.jobs.service import JobNotFound, JobService
from scaletune.serve.jobs.tasks import Tasks
from scaletune.serve.jobs.validate import ChecksBusy
from scaletune.serve.page import admin, views

# In the order their routes were registered before the split (the OpenAPI document's order).
ROUTERS = (
    docs.router,
    service.router,
    jobs.router,
    artifacts.router,
    teams.router,
    data.router,
    config.router,
    results.router,
    chat.router,
    tasks.router,
    views.router,
    admin.router,
)


async def not_found(request: Request, exc: JobNotFound) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=404)


async def checks_busy(request: Request, exc: ChecksBusy) -> JSONResponse:
    answer = refusal("service busy", [str(exc)], 503)
    answer.headers["Retry-After"] = "5"
    return answer


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    # The shape of a refused config (one for every 422), not FastAPI's list of {loc, msg}.
    return refusal("invalid request", validation_lines(exc))


def create_app(svc: JobService, *, start: bool = True) -> FastAPI:
    """The app around a job service; with `start`, its watcher runs while the app does."""
    slot, runner = ModelSlot(), Tasks(svc.Session)
    sweeper = Sweeper(svc, runner)  # periodic: stale tasks, and the checkpoints retention (keep_checkpoints_days)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if start:
            svc.start()
            runner.sweep()  # the tasks a stopped service left running: interrupted, not running for ever
            sweeper.start()
        async with mcp.serving():  # the /mcp route's transport, while the app serves
            yield
        sweeper.stop()
        runner.stop_all()  # a task is the service's child: it ends with it (recorded before the database closes)
        if start:
            svc.shutdown()

    app = FastAPI(title="scaletune serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # What the routes share (edge.access reads svc and csrf; api.chat and api.tasks the other two).
    app.state.svc = svc
    app.state.csrf = auth.Csrf(kept_key(svc.Session, "csrf"))
    app.state.model_slot, app.state.tasks = slot, runner

    def open_mode() -> bool:
        # A database that does not answer cannot say whether tokens exist: answer as a tokenless
        # service does (loopback names only), the stricter, so /healthz can still say 503.
        try:
            return not auth.has_tokens(svc.Session)
        except SQLAlchemyError:
            return True

    def may_send_body(conn, path: str) -> bool:
        try:
            return access.may_send_body(svc, conn, path)
        except SQLAlchemyError:
            return True  # the route answers the database's failure (503), as before

    app.add_middleware(Guard, policy=lambda: svc.policy, open_mode=open_mode, may_send_body=may_send_body)
    app.add_exception_handler(JobNotFound, not_found)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(Refused, refused)
    app.add_exception_handler(ChecksBusy, checks_busy)
    for router in ROUTERS:
        app.include_router(router)
    mcp = mcp_server.mount(app)  # its transport runs while the app serves (the lifespan above)
    return app
