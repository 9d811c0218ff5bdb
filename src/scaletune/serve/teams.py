"""Teams: named, listable, revocable tokens; who owns a job and who may act on it; the audit
record of who did what; `whoami`. Routes are admin-only except `whoami` and a job's history.

The rule of who may act on a job (stop, cancel, resume) is :func:`may_act`: its owner or an admin.
A submit token may still read every job (read < submit) and clone one (the clone is its own).
"""

# No `from __future__ import annotations`: FastAPI reads the routes' Annotated[..., Depends(caller)]
# at definition, where `caller` is a local name a postponed annotation could not resolve.
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Query
from sqlalchemy import select

from scaletune.serve import auth
from scaletune.serve.db import Audit, Job
from scaletune.serve.schemas import (
    AuditEntry,
    TokenCreated,
    TokenInfo,
    TokenRequest,
    Whoami,
    problems_responses,
    refusal,
)

E422 = problems_responses(422)  # FastAPI's own 422 schema replaced by the one refusal shape
MAX_DETAIL = 500  # characters of an audit row's detail (a job's overrides can be long)


def record(Session, actor: str, action: str, job_id: str | None = None, detail: str = "") -> None:  # noqa: N803
    """One audit row. `detail` is what the action was about (a checkpoint, a token's name and scope,
    a job's overrides as stored: secret values are taken out at submission, so callers pass those,
    never a request's own)."""
    with Session() as s:
        s.add(Audit(actor=actor, action=action, job_id=job_id, detail=detail[:MAX_DETAIL]))
        s.commit()


def may_act(caller: auth.Caller, job: Job) -> bool:
    """Whether `caller` may stop, cancel or resume `job`: an admin, or the token that submitted it;
    a job from before owners existed (no owner) stays open to any submit token, as it was."""
    return caller.scope == "admin" or not job.owner or caller.name == job.owner


def need_owner(caller: auth.Caller, job: Job) -> None:
    """Raises HTTPException 403 naming the owner when :func:`may_act` says no."""
    if not may_act(caller, job):
        raise HTTPException(403, f"job {job.id} belongs to {job.owner}: only its owner or an admin token may act on it")


def add_team_routes(app: FastAPI, svc, caller, read, admin) -> None:
    """`caller` is the app's dependency that authenticates a request (an `auth.Caller`); `read`
    and `admin` its scope checks."""
    Session = svc.Session  # noqa: N806 - a sessionmaker

    @app.get("/api/whoami", response_model=Whoami, tags=["teams"], responses=E422, dependencies=[read])
    def whoami(c: Annotated[auth.Caller, Depends(caller)]):
        """The token's name and scope (on a token-less service: `local`, admin)."""
        return {"name": c.name, "scope": c.scope}

    @app.get("/api/tokens", response_model=list[TokenInfo], tags=["teams"], responses=E422, dependencies=[admin])
    def tokens():
        """Every token, revoked ones too, oldest first; values are never shown again."""
        return auth.list_tokens(Session)

    @app.post(
        "/api/tokens",
        status_code=201,
        response_model=TokenCreated,
        tags=["teams"],
        responses=E422,
        dependencies=[admin],
    )
    def create(req: TokenRequest, c: Annotated[auth.Caller, Depends(caller)]):
        """A new token; its value is in this answer only."""
        try:
            value = auth.create_token(Session, req.scope, req.name, created_by=c.name)
        except ValueError as exc:
            return refusal("invalid token request", [str(exc).removeprefix("--")])
        made = auth.token_info(Session, value)
        record(Session, c.name, "token.create", detail=f"{made['name']} ({made['scope']})")
        return {**made, "token": value}

    @app.delete("/api/tokens/{name}", response_model=TokenInfo, tags=["teams"], responses=E422, dependencies=[admin])
    def revoke(name: str, c: Annotated[auth.Caller, Depends(caller)]):
        """Revoke a token: it (and a page logged in with it) authenticates nothing from now on. The
        `admin-env` token comes back at the next start while SCALETUNE_ADMIN_TOKEN still holds it."""
        done = auth.revoke_token(Session, name)
        if done is None:
            raise HTTPException(404, f"no token named {name}")
        record(Session, c.name, "token.revoke", detail=name)
        return done

    @app.get("/api/audit", response_model=list[AuditEntry], tags=["teams"], responses=E422, dependencies=[admin])
    def audit(
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
        with Session() as s:
            return [a.public() for a in s.scalars(q)]

    @app.get(
        "/api/jobs/{job_id}/history",
        response_model=list[AuditEntry],
        tags=["teams"],
        responses=E422,
        dependencies=[read],
    )
    def history(job_id: str):
        """Who did what to this job, oldest first (submit, stop, resume, ...)."""
        if svc.get(job_id) is None:
            raise HTTPException(404, f"no job {job_id}")
        with Session() as s:
            return [a.public() for a in s.scalars(select(Audit).where(Audit.job_id == job_id).order_by(Audit.id))]
