"""The admin page (`/admin`, admin tokens only): the tokens (list, create with the value shown once,
revoke after an in-page confirmation) and the audit record filtered and paged, both through the
API's own routes (`/api/tokens`, `/api/audit`: `api/teams.py`), which the page's script calls."""

# No `from __future__ import annotations`: FastAPI reads the route's Annotated[..., Depends(...)].
from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from sqlalchemy import select

from scaletune.serve.edge import auth
from scaletune.serve.edge.access import Svc
from scaletune.serve.jobs.db import Audit
from scaletune.serve.page.views import go, page, who

router = APIRouter()
AUDIT_PAGE = 50  # audit rows per page


@router.get("/admin", response_class=HTMLResponse, include_in_schema=False)
def admin_page(request: Request, svc: Svc):
    """403 for a token below admin (the other pages offer no link to it then)."""
    c = who(request)
    if c is None:
        return go(request, "login")
    if not auth.allows(c.scope, "admin"):
        return HTMLResponse(f"the admin page needs an admin token; this one's scope is {c.scope}", status_code=403)
    with svc.Session() as s:  # the filter's choices: the actions recorded so far, every token's name
        actions = sorted(s.scalars(select(Audit.action).distinct()))
    names = [t["name"] for t in auth.list_tokens(svc.Session)]
    return page(
        "admin.html",
        request,
        who=c,
        scope=c.scope,
        scopes=auth.SCOPES,
        actions=actions,
        names=names,
        per_page=AUDIT_PAGE,
    )
