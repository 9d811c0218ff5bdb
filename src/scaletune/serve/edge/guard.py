"""The service's edge, before any route: the Host a request names (DNS rebinding), the Origin of
every unsafe request (cross-site forms and scripts, login included), the size of a request body,
and the headers every answer carries (nosniff, a Content-Security-Policy with a per-request
script nonce, no framing, no referrer to other sites).

A plain ASGI middleware: an unsafe request without a credential its route takes is refused (401)
before a byte of its body is read (`may_send_body`); the body is counted as it arrives and refused
(413) at the limit, before the rest is read or anything parses it. One route is let through unread: the data upload
(`POST /api/data`, :data:`UPLOAD_PATH`), whose file may be far larger than a request; it is refused
here only when it declares more than the policy's `max_upload_bytes`, and the route streams it to
disk counting every byte against that limit itself (api/data.py).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scaletune.serve.edge.policy import Policy

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
NONCE_KEY = "csp_nonce"  # in request.state: the page's scripts carry it
UPLOAD_PATH = "/api/data"  # the route that counts its own (larger) body: see the module's docstring


def host_name(value: str) -> str:
    """`[::1]:8000` -> `::1`, `Example.org:80` -> `example.org`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def csp(nonce: str) -> str:
    return (
        "default-src 'none'; "
        f"script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    )


class Guard:
    """Args:
    app: the app behind.
    policy: a callable returning the current policy (the admin may change it while serving).
    open_mode: a callable, true while the service has no token (then it answers loopback names only).
    may_send_body: a callable of (the request's connection, its route path), true when an unsafe
        request holds a credential its route takes (it runs in a worker thread: a database lookup).
    """

    def __init__(
        self,
        app: ASGIApp,
        policy: Callable[[], Policy],
        open_mode: Callable[[], bool],
        may_send_body: Callable[[HTTPConnection, str], bool] = lambda conn, path: True,
    ) -> None:
        self.app, self.policy, self.open_mode, self.may_send_body = app, policy, open_mode, may_send_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy()
        headers = Headers(scope=scope)
        nonce = secrets.token_urlsafe(16)
        scope.setdefault("state", {})[NONCE_KEY] = nonce

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                extra = [
                    (b"x-content-type-options", b"nosniff"),
                    (b"x-frame-options", b"DENY"),
                    (b"referrer-policy", b"same-origin"),  # no-referrer makes Chrome send `Origin: null`,
                ]
                if b"content-security-policy" not in have:
                    extra.append((b"content-security-policy", csp(nonce).encode()))
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        refusal = self.refusal(scope, headers, policy)
        if refusal is not None:
            await refusal(scope, receive, send_with_headers)
            return
        if scope["method"] in SAFE_METHODS:
            await self.app(scope, receive, send_with_headers)
            return
        if not await asyncio.to_thread(self.may_send_body, HTTPConnection(scope), _route_path(scope)):
            unauthorized = JSONResponse(
                {"detail": "a token is required (Authorization: Bearer TOKEN)"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            await unauthorized(scope, receive, send_with_headers)
            return
        declared = headers.get("content-length", "")
        if scope["method"] == "POST" and _route_path(scope) == UPLOAD_PATH:
            if declared.isdigit() and int(declared) > policy.max_upload_bytes:
                await self.too_large(policy, policy.max_upload_bytes)(scope, receive, send_with_headers)
                return
            await self.app(scope, receive, send_with_headers)
            return
        if declared.isdigit() and int(declared) > policy.max_request_bytes:
            await self.too_large(policy)(scope, receive, send_with_headers)
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > policy.max_request_bytes:
                await self.too_large(policy)(scope, receive, send_with_headers)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send_with_headers)

    @staticmethod
    def too_large(policy: Policy, limit: int | None = None) -> JSONResponse:
        mib = (limit or policy.max_request_bytes) / 2**20
        what = "data file" if limit else "request body"
        return JSONResponse({"detail": f"{what} over {mib:g} MiB: refused"}, status_code=413)

    def refusal(self, scope: Scope, headers: Headers, policy: Policy) -> JSONResponse | None:
        host = host_name(headers.get("host", ""))
        trusted = (*LOOPBACK_NAMES, *(h.lower() for h in policy.trusted_hosts))
        if (self.open_mode() or policy.trusted_hosts) and host not in trusted:
            # Without tokens a page on another name (DNS rebinding to 127.0.0.1) would be admin.
            return JSONResponse({"detail": f"Host {host!r} is not served here (--trusted-host)"}, status_code=400)
        if scope["method"] in SAFE_METHODS:
            return None
        origin = headers.get("origin")
        if origin is None:
            # A browser names the origin of every cross-site unsafe request; a missing one is a
            # client that is no browser (curl, the Python API), unless fetch metadata says otherwise.
            if headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none"):
                return None
            return JSONResponse({"detail": "a cross-site request: refused"}, status_code=403)
        if origin in policy.trusted_origins:
            return None
        parts = urlsplit(origin)
        if (
            origin != "null"
            and parts.scheme in ("http", "https")
            and parts.netloc.lower() == headers.get("host", "").lower()
        ):
            return None
        return JSONResponse({"detail": f"Origin {origin!r} may not change anything here"}, status_code=403)


def _route_path(scope: Scope) -> str:
    """The path the app routes, without the mount prefix (`root_path`) a server may leave in it."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root + "/") else path
