"""The team routes: named, listable, revocable tokens, the audit record, `whoami`, a job's history.
Admin-only except `whoami` and a job's history (who may act on a job: `edge/teams.py`)."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query
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
    """Every token, revoked ones too, oldest first; values are never shown again."""
    return auth.list_tokens(svc.Session)


@router.post(
    "/api/tokens",
    status_code=201,
    response_model=TokenCreated,
    tags=["teams"],
    responses=E422,
    dependencies=[admin],
)
def create(req: TokenRequest, c: Caller, svc: Svc):
    """A new token; its value is in this answer only."""
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
    limit: Annotated[int, Query(ge=1, le=10_000)] = 200,
):
    """Who did what, newest first (filtered by job or by token name)."""
    q = select(Audit).order_by(Audit.id.desc()).limit(limit)
    if job_id is not None:
        q = q.where(Audit.job_id == job_id)
    if actor is not None:
        q = q.where(Audit.actor == actor)
    with svc.Session() as s:
        return [a.public() for a in s.scalars(q)]


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
