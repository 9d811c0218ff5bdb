"""The web page: server-rendered (jinja2, every value escaped) with a little JavaScript, no build
step and nothing fetched from elsewhere (the chart is an SVG built node by node by the page's own
script, which never parses a value as markup); the scripts run by the request's CSP nonce only.

Every URL the pages hold or go to starts with `base`: the mount prefix (`--root-path`, e.g.
`/team/st/` behind a proxy that strips `/team/st`) or `/`; the templates and scripts write
`{{ base }}jobs/ID` and `BASE + 'api/...'`, never a path from the host's root."""

# No `from __future__ import annotations`: FastAPI reads the routes' Annotated[..., Depends(...)].
import json
from pathlib import Path
from typing import Any, get_args
from urllib.parse import quote

import jinja2
import yaml
from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.security import HTTPAuthorizationCredentials

from scaletune.config import Dtype, ModelConfig
from scaletune.config.preference import METRIC_KEYS
from scaletune.serve.api.docs import root_of
from scaletune.serve.edge import auth
from scaletune.serve.edge.access import Svc, caller
from scaletune.serve.edge.guard import NONCE_KEY
from scaletune.serve.edge.teams import record
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs.data_formats import FORMATS
from scaletune.serve.jobs.db import Event, Job
from scaletune.serve.jobs.service import TARGETS, JobService

TEMPLATES = Path(__file__).resolve().parent / "templates"
_env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True)
MAX_COMPARED = 12  # runs on one compare page (one colour each)
# The largest config a compare page reads (a run's config.yaml is a few KiB): parsing and
# flattening a 4 MiB one cost a read token seconds of the service's CPU per request (issue 34).
MAX_COMPARED_CONFIG_BYTES = 256 * 1024
#: Left out of a compare page's differences: the service gives each job its own run directory.
NOT_COMPARED = ("output_dir",)


router = APIRouter()


def page(name: str, request: Request, **ctx) -> HTMLResponse:
    cookie = request.cookies.get(auth.COOKIE, "")
    csrf = request.app.state.csrf.token(cookie) if cookie else ""
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


@router.get("/login", response_class=HTMLResponse, include_in_schema=False)
def login_page(request: Request, error: str = ""):
    return page("login.html", request, error=error)


@router.post("/login", include_in_schema=False)
def login(request: Request, svc: Svc, token: str = Form(...)):
    found = auth.identify(svc.Session, token)
    if found is None:
        return go(request, "login?error=unknown+token")
    record(svc.Session, found[0], "login")
    resp = go(request, "")
    # Sent to this service's pages only, under a prefix too (not to other apps on the host).
    resp.set_cookie(auth.COOKIE, token, httponly=True, samesite="strict", path=root_of(request) + "/")
    return resp


@router.post("/logout", include_in_schema=False)
def logout(request: Request, svc: Svc, csrf: str = Form("")):
    """Forget the page's session: the cookie is deleted on the path it was set on (the mount
    prefix). The form carries the CSRF token, so another site cannot log a user out."""
    cookie = request.cookies.get(auth.COOKIE, "")
    if cookie and not request.app.state.csrf.valid(cookie, csrf):
        return HTMLResponse("missing or wrong CSRF token: reload the page", status_code=403)
    found = auth.identify(svc.Session, cookie) if cookie else None
    if found is not None:
        record(svc.Session, found[0], "logout")
    resp = go(request, "login")
    resp.delete_cookie(auth.COOKIE, path=root_of(request) + "/", httponly=True, samesite="strict")
    return resp


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
def index(request: Request, svc: Svc):
    c = who(request)
    if c is None:
        return go(request, "login")
    targets = [t for t in TARGETS if t not in svc.policy.disabled_targets]  # the form offers these only
    jobs = [j.summary() for j in svc.list()]
    return page(
        "index.html",
        request,
        jobs=jobs,
        scope=c.scope,
        who=c,
        targets=targets,
        formats=FORMATS,
        dtypes=get_args(Dtype),
        dtype_default=ModelConfig.model_fields["dtype"].default,
    )


@router.get("/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
def job_page(job_id: str, request: Request, svc: Svc):
    c = who(request)
    if c is None:
        return go(request, "login")
    job = svc.get(job_id)
    if job is None:
        return HTMLResponse("no such job", status_code=404)
    # The objectives' metric keys the chart may offer (reward_accuracy has its own chart).
    extra = [k for k in METRIC_KEYS if k != "reward_accuracy"]
    return page(
        "job.html", request, job=job.summary(), times=run_times(svc, job), scope=c.scope, who=c, objective_metrics=extra
    )


@router.get("/compare", response_class=HTMLResponse, include_in_schema=False)
def compare(request: Request, svc: Svc, ids: str = "", a: str = "", b: str = ""):
    """N runs' loss curves on one chart and the config keys whose values differ; the older
    `?a=X&b=Y` form is sent on to `?ids=X,Y`."""
    c = who(request)
    if c is None:
        return go(request, "login")
    if a or b:
        return go(request, "compare?ids=" + quote(",".join(x for x in (a, b) if x)))
    wanted = [x for x in ids.split(",") if x]  # a run beside itself too (its curve twice)
    if not 2 <= len(wanted) <= MAX_COMPARED:
        return HTMLResponse(f"compare 2 to {MAX_COMPARED} jobs: ?ids=ID,ID,...", status_code=422)
    jobs = [svc.get(x) for x in wanted]
    if any(j is None for j in jobs):  # only job ids reach the page
        return HTMLResponse("no such job", status_code=404)
    configs = [run_config(svc, j) for j in jobs]
    return page("compare.html", request, jobs=[j.summary() for j in jobs], diff=config_diff(configs), who=c)


def run_times(svc: JobService, job: Job) -> dict[str, str | None]:
    """When the job first started (its first `starting`/`running` state event) and, once it is
    in an end state, when it got there: ISO 8601 UTC to the second, or None."""
    from sqlalchemy import select

    with svc.Session() as s:
        rows = s.execute(
            select(Event.created, Event.data).where(Event.job_id == job.id, Event.kind == "state").order_by(Event.id)
        ).all()
    started = next((t for t, d in rows if d.get("state") in (S.STARTING, S.RUNNING)), None)
    ended = (
        next((t for t, d in reversed(rows) if d.get("state") in S.TERMINAL), None) if job.state in S.TERMINAL else None
    )
    iso = lambda t: t.isoformat(timespec="seconds") if t is not None else None  # noqa: E731
    return {"started": iso(started), "ended": iso(ended)}


def run_config(svc: JobService, job: Job) -> dict[str, Any]:
    """The config a job ran with: its run's `config.yaml` (every default filled in, secret values
    redacted) read as the artifacts API serves it, from any target; before the run wrote it (queued,
    or its target cannot be asked), the submitted config with the job's overrides, resolved the same
    way. {} when neither can be read (the page then says so); one key, `config.yaml`, saying so
    when the file is over MAX_COMPARED_CONFIG_BYTES."""
    from scaletune.config import load_config, redacted
    from scaletune.serve.jobs.dispatch.base import ArtifactMissing, ArtifactUnreachable

    too_large = lambda size: {"config.yaml": f"{size:,} bytes: over the {MAX_COMPARED_CONFIG_BYTES:,} compared"}  # noqa: E731
    try:
        found = svc.dispatchers[job.target].artifact(svc.files(job), job.run_dir, "config.yaml")
        if not isinstance(found, list):
            if found.path is not None:
                size = found.path.stat().st_size
                if size > MAX_COMPARED_CONFIG_BYTES:
                    return too_large(size)
                raw = found.path.read_bytes()
            else:
                raw = b""
                for chunk in found.chunks:
                    raw += chunk
                    if len(raw) > MAX_COMPARED_CONFIG_BYTES:
                        return too_large(len(raw))
            data = yaml.safe_load(raw.decode())
            if isinstance(data, dict):
                return data
    except (ArtifactMissing, ArtifactUnreachable, OSError, UnicodeDecodeError, yaml.YAMLError):
        pass
    submitted = Path(job.job_dir) / "config.yaml"
    try:
        if submitted.stat().st_size > MAX_COMPARED_CONFIG_BYTES:
            return too_large(submitted.stat().st_size)
        return redacted(load_config(submitted, list(job.overrides)))
    except Exception:  # noqa: BLE001 - a config that no longer loads (moved data): nothing to compare
        return {}


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """`{"training": {"learning_rate": 1}}` -> `{"training.learning_rate": 1}`; lists are values."""
    if not isinstance(data, dict) or (prefix and not data):
        return {prefix: data}
    out: dict[str, Any] = {}
    for k, v in data.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def config_diff(configs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dotted keys whose values are not the same in every config (absent counts as a value),
    sorted, each with its value per config as text (JSON; "(absent)" where a config lacks it)."""
    flats = [_flat(c) for c in configs]
    keys = sorted({k for f in flats for k in f} - set(NOT_COMPARED))
    rows = []
    for key in keys:
        values = [json.dumps(f[key], sort_keys=True) if key in f else "(absent)" for f in flats]
        if len(set(values)) > 1:
            rows.append({"key": key, "values": values})
    return rows
