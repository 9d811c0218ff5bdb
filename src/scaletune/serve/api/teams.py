"""The team routes: named, listable, revocable tokens, the audit record, `whoami`, a job's history.
Admin-only except `whoami` and a job's history (who may act on a job: `edge/teams.py`)."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
import datetime as dt
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Response
from sqlalchemy import select

from scaletune.serve.api.jobs import job_or_404
from scaletune.serve.api.schemas import E422, AuditEntry, TokenCreated, TokenInfo, TokenRequest, Whoami, refusal
from scaletune.serve.edge import auth
from scaletune.serve.edge.access import Caller, Svc, admin, read
from scaletune.serve.edge.teams import record
from scaletune.serve.jobs.db import Audit

router = APIRouter()


@router.get("/api/whoami", response_model=Whoami, tags=["teams"], responses=E422, dependencies=[read])
def whoami(c: Caller):
    """The token's name and scope (on a token-less service: `local`, admin)."""
    return {"name": c.name, "scope": c.scope}


@router.get("/api/tokens", response_model=list[TokenInfo], tags=["teams"], responses=E422, dependencies=[admin])
def tokens(svc: Svc):
    """Every token, revoked ones too, oldest first; values are never shown again. `configured`: the
    token SCALETUNE_ADMIN_TOKEN installs at each start (revoked here, it comes back at the next)."""
    return auth.list_tokens(svc.Session)


@router.post(
    "/api/tokens",
    status_code=201,
    response_model=TokenCreated,
    tags=["teams"],
    responses=E422,
    dependencies=[admin],
)
def create(req: TokenRequest, c: Caller, svc: Svc, response: Response):
    """A new token; its value is in this answer only (`Cache-Control: no-store`: no cache keeps it)."""
    response.headers["Cache-Control"] = "no-store"
    try:
        value = auth.create_token(svc.Session, req.scope, req.name, created_by=c.name)
    except ValueError as exc:
        return refusal("invalid token request", [str(exc).removeprefix("--")])
    made = auth.token_info(svc.Session, value)
    record(svc.Session, c.name, "token.create", detail=f"{made['name']} ({made['scope']})")
    return {**made, "token": value}


@router.delete("/api/tokens/{name}", response_model=TokenInfo, tags=["teams"], responses=E422, dependencies=[admin])
def revoke(name: str, c: Caller, svc: Svc):
    """Revoke a token: it (and a page logged in with it) authenticates nothing from now on. The
    `admin-env` token comes back at the next start while SCALETUNE_ADMIN_TOKEN still holds it."""
    done = auth.revoke_token(svc.Session, name)
    if done is None:
        raise HTTPException(404, f"no token named {name}")
    record(svc.Session, c.name, "token.revoke", detail=name)
    return done


@router.get("/api/audit", response_model=list[AuditEntry], tags=["teams"], responses=E422, dependencies=[admin])
def audit(
    svc: Svc,
    job_id: str | None = None,
    actor: str | None = None,
    action: str | None = None,
    since: Annotated[dt.datetime | None, Query(description="ISO 8601; no zone: UTC")] = None,
    until: Annotated[dt.datetime | None, Query(description="ISO 8601; no zone: UTC")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
    offset: Annotated[int, Query(ge=0)] = 0,
):
    """Who did what, newest first: the rows of the job `job_id`, by the token `actor`, of the action
    `action` (exact: `token.revoke`), at or after `since` and before `until`, every filter given at
    once; `limit` rows after skipping `offset` of them (the next page: `offset + limit`)."""
    q = select(Audit).order_by(Audit.id.desc()).limit(limit).offset(offset)
    for column, value in ((Audit.job_id, job_id), (Audit.actor, actor), (Audit.action, action)):
        if value is not None:
            q = q.where(column == value)
    if since is not None:
        q = q.where(Audit.at >= utc(since))
    if until is not None:
        q = q.where(Audit.at < utc(until))
    with svc.Session() as s:
        return [a.public() for a in s.scalars(q)]


def utc(moment: dt.datetime) -> dt.datetime:
    """`moment` as the audit stores times: UTC without a zone (a moment without one is UTC already)."""
    return moment.astimezone(dt.UTC).replace(tzinfo=None) if moment.tzinfo is not None else moment


@router.get(
    "/api/jobs/{job_id}/history",
    response_model=list[AuditEntry],
    tags=["teams"],
    responses=E422,
    dependencies=[read],
)
def history(job_id: str, svc: Svc):
    """Who did what to this job, oldest first (submit, stop, resume, ...)."""
    job_or_404(svc, job_id)  # 404 {"detail": "no job ID"}
    with svc.Session() as s:
        return [a.public() for a in s.scalars(select(Audit).where(Audit.job_id == job_id).order_by(Audit.id))]
