"""The job service as an MCP server (Model Context Protocol, streamable HTTP at `/mcp`): tools an
agent calls to list, submit, watch and stop jobs and read their metrics.

Each tool is one request to the REST API (or, for `watch_job`, a few), made in-process through
the app itself with the MCP request's own `Authorization` header, its client address and its
Host. So a token's scope, a job's owner, the config's validation (every problem at once, as a
422's lines), the audit record and the edge's checks are the API's: nothing here decides who may
do what. Cookies are not passed on, so a browser's session cannot act through `/mcp`; an unsafe
request to `/mcp` without a live token is refused by the guard before its body is read, as any
other route's.

The transport is the SDK's streamable HTTP, stateless and answering in JSON (no session to keep
between calls; a restart loses nothing). `mcp` (the SDK, 2.x) comes with the serve extra.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from scaletune.serve.jobs.states import TERMINAL

PATH = "/mcp"
HOST = re.compile(r"[A-Za-z0-9.\-]+(:\d{1,5})?|\[[0-9A-Fa-f:.]+\](:\d{1,5})?")  # name or [IPv6], and a port
WATCH_POLL_S = 1.0
MAX_WATCH_S = 600.0  # one watch_job call at most; the agent calls again to go on watching
INSTRUCTIONS = (
    "scaletune's fine-tuning job service. submit_job takes a scaletune YAML config (as text); "
    "list_jobs, get_job and job_metrics read; watch_job waits for a job to end (or for wait_s); "
    "stop_job stops a running job, keeping its last checkpoint. A read token may read; submit and stop "
    "need a submit token (and the job's owner or an admin)."
)


class Api:
    """The REST API of `app`, called in-process as the MCP request's caller.

    Args:
        app: the FastAPI app (the caller's request passes its guard and routes, as over the network).
    """

    def __init__(self, app: Any):
        self.app = app

    async def call(self, ctx: Context, method: str, path: str, **kw: Any) -> Any:
        """The JSON answer of `method path`; raises ToolError with the API's refusal (status, title,
        every problem line) on a 4xx or 5xx."""
        request = ctx.request_context.request
        headers = {"accept": "application/json"}
        given = request.headers.get("authorization") if request is not None else None
        if given:
            headers["authorization"] = given
        # The Host the guard saw (it checks the inner request's too), passed as a header only: the
        # URL, and so the path, is fixed whatever the header holds.
        host = request.headers.get("host", "") if request is not None else ""
        if HOST.fullmatch(host):
            headers["host"] = host
        client = tuple(request.client) if request is not None and request.client else ("127.0.0.1", 0)
        transport = httpx.ASGITransport(app=self.app, client=client)  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", headers=headers) as http:
            answer = await http.request(method, path, **kw)
        if answer.status_code >= 400:
            raise ToolError(refusal_text(answer))
        return answer.json()


def refusal_text(answer: httpx.Response) -> str:
    """`HTTP 422 invalid config: line; line` from the API's refusal (`{detail, problems}`), or
    FastAPI's `{detail}`."""
    try:
        body = answer.json()
    except ValueError:
        body = {"detail": answer.text[:500]}
    detail = body.get("detail", "") if isinstance(body, dict) else body
    problems = body.get("problems") if isinstance(body, dict) else None
    text = f"HTTP {answer.status_code} {detail if isinstance(detail, str) else json.dumps(detail)}"
    return text + (": " + "; ".join(problems) if problems else "")


def build(app: Any) -> MCPServer:
    """The MCP server whose tools call `app`'s API (:class:`Api`)."""
    api = Api(app)
    server = MCPServer(name="scaletune", instructions=INSTRUCTIONS)

    @server.tool(structured_output=True)
    async def list_jobs(ctx: Context) -> list[dict[str, Any]]:
        """Every job the service holds: id, name, state, owner, target, step, last metrics line,
        times (GET /api/jobs)."""
        return await api.call(ctx, "GET", "/api/jobs")

    @server.tool(structured_output=True)
    async def get_job(job_id: str, ctx: Context) -> dict[str, Any]:
        """One job's record (GET /api/jobs/{id}): its state (checking, queued, needs_secrets,
        starting, running, stopping, stopped, succeeded, failed, cancelled), the reason it failed,
        its phase, step and last metrics line."""
        return await api.call(ctx, "GET", f"/api/jobs/{_id(job_id)}")

    @server.tool(structured_output=True)
    async def submit_job(
        config: str,
        ctx: Context,
        overrides: list[str] | None = None,
        target: str = "local",
        dry_run: bool = False,
        request_id: str | None = None,
    ) -> dict[str, Any]:
        """Submit a training job (POST /api/jobs).

        Args:
            config: the scaletune YAML config, as text (`scaletune config new` writes one).
            overrides: dotted `key=value` overrides, as on the command line.
            target: local, slurm or modal (what the service offers).
            dry_run: return the resolved plan and submit nothing.
            request_id: the same id sent again returns the same job instead of a second one.

        Returns the job's id and state (and the plan). A config with problems is refused with every
        problem named (file line and key), nothing submitted."""
        body = {"config": config, "overrides": overrides or [], "target": target, "dry_run": dry_run}
        if request_id is not None:
            body["request_id"] = request_id
        return await api.call(ctx, "POST", "/api/jobs", json=body)

    @server.tool(structured_output=True)
    async def job_metrics(job_id: str, ctx: Context, since_step: int | None = None, last: int = 50) -> dict[str, Any]:
        """A job's metrics.jsonl lines (after `since_step` when given; the last `last` of them, at most 1,000:
        loss, lr, grad_norm, eval_loss, reward... per step) and its summary (the metrics it logged,
        each one's last value, the best eval loss, steps, tokens, training time)."""
        last = max(1, min(int(last), 1000))
        params = {} if since_step is None else {"since_step": since_step}
        lines = await api.call(ctx, "GET", f"/api/jobs/{_id(job_id)}/metrics", params=params)
        summary = await api.call(ctx, "GET", f"/api/jobs/{_id(job_id)}/metrics/summary")
        return {"lines": lines[-last:], "lines_after_since_step": len(lines), "summary": summary}

    @server.tool(structured_output=True)
    async def watch_job(job_id: str, ctx: Context, wait_s: float = 60.0) -> dict[str, Any]:
        """Wait until the job ends or `wait_s` seconds pass (at most 600), reporting its step as
        progress; returns the job's record, `ended` (whether it is in a final state) and its last
        metrics line. Call again to go on watching."""
        deadline = time.monotonic() + max(0.0, min(float(wait_s), MAX_WATCH_S))
        path = f"/api/jobs/{_id(job_id)}"
        while True:
            job = await api.call(ctx, "GET", path)
            total = (job.get("last_metrics") or {}).get("total_steps")
            await ctx.report_progress(job.get("step") or 0, total, job.get("state"))
            ended = job.get("state") in TERMINAL
            if ended or time.monotonic() >= deadline:
                break
            await anyio.sleep(WATCH_POLL_S)
        lines = await api.call(ctx, "GET", f"{path}/metrics")
        return {"job": job, "ended": ended, "last_metrics": lines[-1] if lines else None}

    @server.tool(structured_output=True)
    async def stop_job(job_id: str, ctx: Context) -> dict[str, Any]:
        """Stop a queued or running job (its owner or an admin; POST /api/jobs/{id}/stop): a running
        run writes a checkpoint first, so it can be resumed."""
        return await api.call(ctx, "POST", f"/api/jobs/{_id(job_id)}/stop")

    return server


def _id(job_id: str) -> str:
    """A job id as one path segment (an id holding `/`, `?` or `#` would name another route)."""
    if not job_id or any(c in job_id for c in "/?#%") or job_id in (".", ".."):
        raise ToolError(f"HTTP 422 invalid request: job_id {job_id!r} is not a job id")
    return job_id


class Endpoint:
    """The ASGI app at `/mcp`: the SDK's streamable HTTP transport of :func:`build`'s server.

    The SDK's session manager runs once per instance, and an app may start more than once (a test
    client per test): :meth:`serving`, which the app's lifespan enters, makes a new one each time.
    The SDK's own Host and Origin checks are off: the guard before every route makes them, and knows
    the service's names (the SDK's default allows only loopback)."""

    def __init__(self, app: Any):
        self.server = build(app)
        self.manager: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.manager is None:  # the app is not serving (no lifespan)
            await JSONResponse({"detail": "the MCP endpoint is not running"}, status_code=503)(scope, receive, send)
            return
        await self.manager.asgi_app(scope, receive, send)

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        self.server.streamable_http_app(
            streamable_http_path=PATH,
            stateless_http=True,  # nothing kept between calls: a restart loses no session
            json_response=True,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        manager = self.server.session_manager
        async with manager.run():
            self.manager = manager
            try:
                yield
            finally:
                self.manager = None


def mount(app: Any) -> Endpoint:
    """Add the `/mcp` route to `app` (after the API's routes, which its tools call); the app's
    lifespan enters the returned endpoint's :meth:`Endpoint.serving`."""
    endpoint = Endpoint(app)
    app.router.routes.append(Route(PATH, endpoint=endpoint, methods=["GET", "POST", "DELETE"]))
    return endpoint
