"""The web page: server-rendered (jinja2, every value escaped) with a little JavaScript, no build
step and nothing fetched from elsewhere (the chart is an SVG built node by node by the page's own
script, which never parses a value as markup); the scripts run by the request's CSP nonce only.

Every URL the pages hold or go to starts with `base`: the mount prefix (`--root-path`, e.g.
`/team/st/` behind a proxy that strips `/team/st`) or `/`; the templates and scripts write
`{{ base }}jobs/ID` and `BASE + 'api/...'`, never a path from the host's root."""

from __future__ import annotations

from pathlib import Path

import jinja2
from fastapi import FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials

from scaletune.serve import auth
from scaletune.serve.apidocs import root_of
from scaletune.serve.guard import NONCE_KEY
from scaletune.serve.jobs import JobService
from scaletune.serve.teams import record

TEMPLATES = Path(__file__).resolve().parent / "templates"
_env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)


def add_pages(app: FastAPI, svc: JobService, caller) -> None:
    def page(name: str, request: Request, **ctx) -> HTMLResponse:
        cookie = request.cookies.get(auth.COOKIE, "")
        csrf = app.state.csrf.token(cookie) if cookie else ""
        nonce = getattr(request.state, NONCE_KEY, "")
        base = root_of(request) + "/"
        return HTMLResponse(_env.get_template(name).render(csrf=csrf, nonce=nonce, base=base, **ctx))

    def go(request: Request, path: str) -> RedirectResponse:
        """303 to `path` (relative to the service: "login", "") under the mount prefix."""
        return RedirectResponse(f"{root_of(request)}/{path}", status_code=303)

    def who(request: Request) -> auth.Caller | None:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        bearer = (
            HTTPAuthorizationCredentials(scheme=scheme, credentials=value.strip())
            if scheme.lower() == "bearer" and value.strip()
            else None
        )
        try:
            return caller(request, bearer)
        except Exception:  # noqa: BLE001 - not logged in: the login page
            return None

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    def login_page(request: Request, error: str = ""):
        return page("login.html", request, error=error)

    @app.post("/login", include_in_schema=False)
    def login(request: Request, token: str = Form(...)):
        found = auth.identify(svc.Session, token)
        if found is None:
            return go(request, "login?error=unknown+token")
        record(svc.Session, found[0], "login")
        resp = go(request, "")
        # Sent to this service's pages only, under a prefix too (not to other apps on the host).
        resp.set_cookie(auth.COOKIE, token, httponly=True, samesite="strict", path=root_of(request) + "/")
        return resp

    @app.post("/logout", include_in_schema=False)
    def logout(request: Request, csrf: str = Form("")):
        """Forget the page's session: the cookie is deleted on the path it was set on (the mount
        prefix). The form carries the CSRF token, so another site cannot log a user out."""
        cookie = request.cookies.get(auth.COOKIE, "")
        if cookie and not app.state.csrf.valid(cookie, csrf):
            return HTMLResponse("missing or wrong CSRF token: reload the page", status_code=403)
        found = auth.identify(svc.Session, cookie) if cookie else None
        if found is not None:
            record(svc.Session, found[0], "logout")
        resp = go(request, "login")
        resp.delete_cookie(auth.COOKIE, path=root_of(request) + "/", httponly=True, samesite="strict")
        return resp

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index(request: Request):
        c = who(request)
        if c is None:
            return go(request, "login")
        return page("index.html", request, jobs=[j.summary() for j in svc.list()], scope=c.scope, who=c)

    @app.get("/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
    def job_page(job_id: str, request: Request):
        c = who(request)
        if c is None:
            return go(request, "login")
        job = svc.get(job_id)
        if job is None:
            return HTMLResponse("no such job", status_code=404)
        return page("job.html", request, job=job.summary(), scope=c.scope, who=c)

    @app.get("/compare", response_class=HTMLResponse, include_in_schema=False)
    def compare(request: Request, a: str, b: str):
        c = who(request)
        if c is None:
            return go(request, "login")
        if svc.get(a) is None or svc.get(b) is None:  # only job ids reach the page
            return HTMLResponse("no such job", status_code=404)
        return page("compare.html", request, a=a, b=b, who=c)
