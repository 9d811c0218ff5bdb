"""Who is calling, as FastAPI dependencies the API's routers and the page share: the bearer token,
else the page's session cookie (with its CSRF token on an unsafe request), else the token-less
mode; the scope checks (`need("read")`, ...); the app's job service. Everything they read is on
`app.state` (`svc`, `csrf`), set by `app.create_app`."""

# No `from __future__ import annotations`: FastAPI reads the Annotated[..., Depends(...)] below.
import re
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.requests import HTTPConnection

from scaletune.serve.edge import auth
from scaletune.serve.jobs.service import JobService

# Declared in /openapi.json (Swagger's Authorize button); auto_error off: the page's session
# cookie and the token-less mode authenticate too, and `caller` words the 401 itself.
BEARER = HTTPBearer(scheme_name="token", description="An API token: scaletune serve token create", auto_error=False)
JOB_BEARER = HTTPBearer(scheme_name="job token", description="The job's own report token", auto_error=False)


def service(request: Request) -> JobService:
    """The app's job service (`app.state.svc`)."""
    return request.app.state.svc


Svc = Annotated[JobService, Depends(service)]


def caller(request: Request, bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> auth.Caller:
    svc = request.app.state.svc
    if bearer is not None:
        found = auth.identify(svc.Session, bearer.credentials.strip())
        if found is None:
            raise HTTPException(401, "invalid token", headers={"WWW-Authenticate": "Bearer"})
        return auth.Caller(found[1], found[0])
    cookie = request.cookies.get(auth.COOKIE)
    if cookie:
        found = auth.identify(svc.Session, cookie)
        if found is not None:
            if request.method not in ("GET", "HEAD", "OPTIONS") and not request.app.state.csrf.valid(
                cookie, request.headers.get("x-csrf-token")
            ):
                raise HTTPException(403, "missing or wrong CSRF token")
            return auth.Caller(found[1], found[0], by_cookie=True, cookie=cookie)
    if not auth.has_tokens(svc.Session):
        return auth.Caller("admin")  # no tokens: loopback only (bind_problems)
    raise HTTPException(
        401, "a token is required (Authorization: Bearer TOKEN)", headers={"WWW-Authenticate": "Bearer"}
    )


def still_allowed(request: Request) -> bool:
    """Whether the credential a request came with (its bearer token, else its session cookie) still
    identifies a live token: a long response (an event stream) ends when its token is revoked.
    Always true on a service without tokens (loopback only)."""
    return live_credential(request.app.state.svc, request)


def live_credential(svc: JobService, conn: HTTPConnection) -> bool:
    """Whether `conn` (a request, before or after its body is read) holds a live API token: its
    bearer token, else its session cookie; true on a service without tokens (loopback only)."""
    given = _bearer(conn) or conn.cookies.get(auth.COOKIE, "")
    if given and auth.identify(svc.Session, given) is not None:
        return True
    return not auth.has_tokens(svc.Session)


# The unsafe routes a request without an API token may reach: the login form (its body is the
# token) and logout, and a job's report (its own report token).
_TOKENLESS = ("/login", "/logout")
_REPORT = re.compile(r"/api/jobs/(?P<job>[^/]+)/report")


def may_send_body(svc: JobService, conn: HTTPConnection, path: str) -> bool:
    """Whether an unsafe request to the route `path` may have its body read: it holds a live API
    token (`live_credential`), or the route takes another credential (login, a job's report with
    that job's report token). The guard asks before it reads a byte of the body, so a caller without
    a credential holds no server memory with one (a route would refuse it only after FastAPI read it)."""
    if path in _TOKENLESS:
        return True
    report = _REPORT.fullmatch(path)
    if report is not None:
        token = _bearer(conn)
        return bool(token) and svc.check_job_token(report["job"], token)
    return live_credential(svc, conn)


def _bearer(conn: HTTPConnection) -> str:
    """The token of an `Authorization: Bearer TOKEN` header; "" without one."""
    header = conn.headers.get("authorization", "")
    return header[7:].strip() if header[:7].lower() == "bearer " else ""


def need(scope: str):
    """The dependency that lets a caller of `scope` or above through ("read", "submit", "admin")."""

    def dep(c: Annotated[auth.Caller, Depends(caller)]) -> auth.Caller:
        if not auth.allows(c.scope, scope):
            raise HTTPException(403, f"this token's scope is {c.scope}; {scope} is needed")
        return c

    return dep


Caller = Annotated[auth.Caller, Depends(caller)]
Reader = Annotated[auth.Caller, Depends(need("read"))]
Submitter = Annotated[auth.Caller, Depends(need("submit"))]
Admin = Annotated[auth.Caller, Depends(need("admin"))]
read, admin = Depends(need("read")), Depends(need("admin"))
