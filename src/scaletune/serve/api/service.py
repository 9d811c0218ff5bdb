"""The service's own routes: `/healthz` (no token) and the admin's policy settings (kept in the job
database)."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
import asyncio
import json
import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from scaletune.serve.api.schemas import E422, Health, PolicyUpdate
from scaletune.serve.edge.access import Admin, Svc, admin
from scaletune.serve.edge.teams import record
from scaletune.serve.jobs.db import scrubbed

log = logging.getLogger(__name__)
router = APIRouter()


@router.get(
    "/healthz",
    tags=["service"],
    response_model=Health,
    response_model_exclude_none=True,
    responses={503: {"model": Health}},
)
async def healthz(svc: Svc):
    """200 `{"status": "ok"}` once the job database answers, else 503; no token needed (for a
    load balancer or a platform's health check). Its query runs on asyncio's own executor, not in
    the request threads the other routes share: busy routes never make the service look dead."""

    def probe() -> None:
        with svc.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    try:
        await asyncio.to_thread(probe)
    except SQLAlchemyError as exc:
        log.warning("healthz: the job database does not answer: %s", scrubbed(exc, svc.engine.url))
        return JSONResponse({"status": "unavailable", "detail": "the job database does not answer"}, 503)
    return {"status": "ok"}


@router.get("/api/admin/policy", dependencies=[admin])
def get_policy(svc: Svc):
    return svc.policy.public()


@router.put("/api/admin/policy", responses=E422)
def put_policy(req: PolicyUpdate, c: Admin, svc: Svc):
    """Change the named settings; the change is kept in the job database, so it outlasts a restart
    (applied over the serve options at every start)."""
    change = req.model_dump(exclude_none=True)
    svc.update_policy(change)
    record(svc.Session, c.name, "policy.update", detail=json.dumps(change, sort_keys=True))
    return svc.policy.public()
