"""Teams: who owns a job and who may act on it; the audit record of who did what (the routes of
tokens, the audit, `whoami` and a job's history are `api/teams.py`'s).

The rule of who may act on a job (stop, cancel, resume) is :func:`may_act`: its owner or an admin.
A submit token may still read every job (read < submit) and clone one (the clone is its own).
"""

from __future__ import annotations

from fastapi import HTTPException

from scaletune.serve.edge import auth
from scaletune.serve.jobs.db import Audit, Job

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
