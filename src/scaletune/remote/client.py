"""The job API over HTTP (serve/api/'s routes): one :class:`Client` per service address.

The token comes from the environment (SCALETUNE_TOKEN), never from a command-line argument: a
command line is readable by every user of the machine (`ps`) and stays in shell history. It is
sent only as the `Authorization: Bearer` header and never put into a message.

What the service answers becomes one of three errors, so the command line can map each to its
exit code (DESIGN.md): :class:`~scaletune.errors.UserError` (2) for what the caller must fix, the
config refused (422, every problem as the API lists them), a token refused (401/403), a job or an
artifact that does not exist (404); :class:`Unavailable` (1) for a service that cannot be reached
or answers 502/503/504 (worth retrying while waiting); :class:`RemoteError` (1) for the rest.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

from scaletune.errors import UserError

URL_ENV, TOKEN_ENV = "SCALETUNE_URL", "SCALETUNE_TOKEN"
TIMEOUT_S = 60.0  # one request (a submission's: `remote submit --timeout`)
# The event stream sends a heartbeat every 10 s (serve/api/jobs.py HEARTBEAT_S): a stream silent this
# long is dead (a proxy dropped it, the service restarted) and is opened again.
STREAM_READ_S = 45.0


class RemoteError(RuntimeError):
    """The service failed or answered what the client cannot use."""


class Unavailable(RemoteError):
    """The service cannot be reached now (connection refused or broken, timeout, 502/503/504)."""


def shown(url: str) -> str:
    """The address as it may be printed: without a `user:password@` part."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=f"***@{netloc}"))


def _seg(text: str) -> str:
    return quote(text, safe="")  # a job id is one path segment: `../admin` cannot reach another route


class Client:
    """Args:
    url: the service's address, with the path prefix it is served under (`--root-path`), if any.
    token: an API token (`scaletune serve token create`), or None for a service without tokens.
    transport: an httpx transport (tests); None: the network.
    """

    def __init__(self, url: str, token: str | None, *, transport: httpx.BaseTransport | None = None) -> None:
        problems = []
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            problems.append(f"--url {shown(url)!r}: an http:// or https:// address, e.g. http://127.0.0.1:8000")
        if problems:
            raise UserError(problems, title="invalid arguments")
        self.url = url.rstrip("/")
        self.has_token = bool(token)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(
            base_url=self.url + "/",
            headers=headers,
            timeout=httpx.Timeout(TIMEOUT_S),
            follow_redirects=False,  # a redirect is reported with its target (a POST must not turn into a GET)
            transport=transport,
        )

    @classmethod
    def from_env(cls, url: str | None) -> Client:
        """`url` (--url, which typer fills from SCALETUNE_URL) and the token in SCALETUNE_TOKEN."""
        url = url or os.environ.get(URL_ENV, "")
        if not url.strip():
            raise UserError(
                f"no service address: give --url http://HOST:PORT or set {URL_ENV}", title="invalid arguments"
            )
        return cls(url.strip(), os.environ.get(TOKEN_ENV, "").strip() or None)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the routes --------------------------------------------------------------------------
    def submit(
        self,
        config: str,
        overrides: list[str],
        target: str = "local",
        resources: dict | None = None,
        *,
        request_id: str | None = None,
        wait_s: float | None = None,
        timeout_s: float | None = None,
    ) -> dict:
        """POST /api/jobs: the job's `{id, state}`: `queued`, or `checking` when the service's
        check of the config outlasts `wait_s` (it goes on there), with `replayed` when `request_id`
        was sent before (that job, not a new one: so a submission whose answer was lost can be sent
        again). `timeout_s`: this request's limit (default TIMEOUT_S)."""
        body: dict[str, Any] = {"config": config, "overrides": list(overrides), "target": target}
        body["resources"] = resources or {}
        if request_id is not None:
            body["request_id"] = request_id
        if wait_s is not None:
            body["wait_s"] = wait_s
        timeout = httpx.Timeout(timeout_s) if timeout_s is not None else httpx.USE_CLIENT_DEFAULT
        return self._json(self._send("POST", "api/jobs", json=body, timeout=timeout))

    def job(self, job_id: str) -> dict:
        """GET /api/jobs/ID: the job's summary (state, phase, step, reason, exit code, ...)."""
        return self._json(self._send("GET", f"api/jobs/{_seg(job_id)}", job_id=job_id))

    def log(self, job_id: str, offset: int | None, limit: int) -> bytes:
        """At most `limit` bytes of the job's log from byte `offset` (None: its last `limit`)."""
        params: dict[str, int] = {"limit": limit}
        if offset is not None:
            params["offset"] = offset
        return self._send("GET", f"api/jobs/{_seg(job_id)}/logs", params=params, job_id=job_id).content

    def events(self, job_id: str, last_id: int = 0) -> Iterator[tuple[int, str, dict]]:
        """The job's event stream (SSE) after event `last_id`: (id, kind, data) until the service
        closes it. A stream that breaks or stays silent raises :class:`Unavailable`."""
        headers = {"Last-Event-ID": str(last_id)} if last_id else {}
        timeout = httpx.Timeout(TIMEOUT_S, read=STREAM_READ_S)
        try:
            with self.http.stream("GET", f"api/jobs/{_seg(job_id)}/events", headers=headers, timeout=timeout) as resp:
                if resp.status_code >= 300:
                    resp.read()
                    self._check(resp, job_id)
                yield from parse_sse(resp.iter_lines())
        except httpx.TransportError as exc:
            raise Unavailable(f"the event stream of job {job_id} at {shown(self.url)} broke: {_why(exc)}") from None

    def artifact_listing(self, job_id: str, path: str) -> list[str] | None:
        """The files under an artifact folder (paths from the run directory), or None when `path`
        is a file (then :meth:`artifact_file` reads it)."""
        with self._stream(job_id, path) as resp:
            if _is_attachment(resp):
                return None
            resp.read()
            listing = self._json(resp)
        if not isinstance(listing, list) or not all(isinstance(p, str) for p in listing):
            raise RemoteError(f"artifact {path} of job {job_id}: the service's listing is not a list of paths")
        return listing

    @contextlib.contextmanager
    def artifact_file(self, job_id: str, path: str) -> Iterator[httpx.Response]:
        """The streamed answer of one artifact file (iter_bytes)."""
        with self._stream(job_id, path) as resp:
            if not _is_attachment(resp):
                raise RemoteError(f"artifact {path} of job {job_id}: a folder where a file was listed")
            yield resp

    # -- HTTP --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _stream(self, job_id: str, path: str) -> Iterator[httpx.Response]:
        route = f"api/jobs/{_seg(job_id)}/artifacts/" + "/".join(_seg(p) for p in path.split("/"))
        try:
            with self.http.stream("GET", route) as resp:
                if resp.status_code >= 300:
                    resp.read()
                    self._check(resp, job_id)
                yield resp
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot read {path} of job {job_id} from {shown(self.url)}: {_why(exc)}") from None

    def _send(self, method: str, route: str, *, job_id: str | None = None, **kw: Any) -> httpx.Response:
        try:
            resp = self.http.request(method, route, **kw)
        except httpx.TransportError as exc:
            raise Unavailable(f"cannot reach the service at {shown(self.url)}: {_why(exc)}") from None
        self._check(resp, job_id)
        return resp

    def _check(self, resp: httpx.Response, job_id: str | None) -> None:
        """The answer's status as one of the module's errors (see the module's docstring)."""
        code = resp.status_code
        if code < 300:
            return
        detail, problems = _detail(resp)
        where = shown(self.url)
        if code == 401:
            if not self.has_token:
                raise UserError(
                    f"the service at {where} needs a token ({detail}): set {TOKEN_ENV} to one "
                    "(`scaletune serve token create`); a token is never given on the command line",
                    title="not authorised",
                )
            raise UserError(
                f"the service at {where} refused the token in {TOKEN_ENV} ({detail}): it does not know it "
                "(revoked, mistyped, or another service's)",
                title="not authorised",
            )
        if code == 403:
            raise UserError(f"the service at {where} refused this request: {detail}", title="not allowed")
        if code == 404:
            what = detail if detail and detail != "Not Found" else "not found"
            raise UserError(
                f"job {job_id}: {what}" if job_id else f"{where}: {what} (is this a scaletune service?)",
                title="not found",
            )
        if code in (409, 422):
            raise UserError(problems or [detail], title=detail or "refused")
        if 300 <= code < 400:
            raise UserError(
                f"the service at {where} answered {code} to {resp.headers.get('location', '?')}: give that address",
                title="invalid arguments",
            )
        error = Unavailable if code in (502, 503, 504) else RemoteError
        raise error(f"{resp.request.method} {resp.request.url.path}: the service at {where} answered {code}: {detail}")

    @staticmethod
    def _json(resp: httpx.Response) -> Any:
        try:
            return resp.json()
        except ValueError:
            raise RemoteError(
                f"{resp.request.url.path}: the answer is not JSON ({resp.text[:200]!r}); is this a scaletune service?"
            ) from None


def parse_sse(lines: Iterator[str]) -> Iterator[tuple[int, str, dict]]:
    """Server-sent events as (id, event, data): fields gathered until a blank line; comments
    (`: ping`) skipped; an event without an id keeps the last one (a heartbeat repeats it)."""
    eid, kind, data = 0, "message", []
    for line in lines:
        if not line:
            if data:
                try:
                    payload = json.loads("\n".join(data))
                except ValueError:
                    payload = {"text": "\n".join(data)}
                yield eid, kind, payload if isinstance(payload, dict) else {"value": payload}
            kind, data = "message", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "id" and value.isdigit():
            eid = int(value)
        elif name == "event":
            kind = value
        elif name == "data":
            data.append(value)


def _is_attachment(resp: httpx.Response) -> bool:
    return resp.headers.get("content-disposition", "").lower().startswith("attachment")


def _detail(resp: httpx.Response) -> tuple[str, list[str]]:
    """The refusal's `detail` and `problems` (schemas.py's one shape), else the text."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text.strip()[:500] or resp.reason_phrase, []
    if not isinstance(body, dict):
        return str(body)[:500], []
    detail = body.get("detail", "")
    problems = body.get("problems")
    if not isinstance(detail, str):
        detail = json.dumps(detail)[:500]
    return detail, [str(p) for p in problems] if isinstance(problems, list) else []


def _why(exc: httpx.TransportError) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
