"""API tokens (stored as SHA-256, scopes read < submit < admin), Bearer and cookie login, CSRF.

Without any token in the database the service is open, and then it binds loopback only
(:func:`bind_problems`). The page logs in with a token: an HTTP-only, SameSite=Strict cookie
holds it; forms and the page's requests carry a CSRF token, an HMAC of the cookie under a key
kept in the database (`db.kept_key`: a page opened before a restart still works after it; double
submit, OWASP's CSRF cheat sheet), checked on every unsafe request that authenticates by cookie.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass

from sqlalchemy import func, select

from scaletune.errors import Problem
from scaletune.serve.db import Token

SCOPES = ("read", "submit", "admin")
COOKIE = "scaletune_session"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(Session, scope: str) -> str:  # noqa: N803 - a sessionmaker
    """A new API token of `scope`; its value is returned once and stored hashed.

    Raises:
        ValueError: an unknown scope.
    """
    if scope not in SCOPES:
        raise ValueError(f"--scope {scope!r}: one of {', '.join(SCOPES)}")
    token = "st_" + secrets.token_urlsafe(32)
    with Session() as s:
        s.add(Token(hash=digest(token), scope=scope))
        s.commit()
    return token


def has_tokens(Session) -> bool:  # noqa: N803
    with Session() as s:
        return bool(s.scalar(select(func.count(Token.id))))


def scope_of(Session, token: str) -> str | None:  # noqa: N803
    with Session() as s:
        return s.scalar(select(Token.scope).where(Token.hash == digest(token)))


def allows(have: str, need: str) -> bool:
    return SCOPES.index(have) >= SCOPES.index(need)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_problems(host: str, Session) -> list[Problem]:  # noqa: N803
    """Why the service may not listen on `host`: a non-loopback address needs an API token first."""
    if is_loopback(host) or has_tokens(Session):
        return []
    return [
        Problem(
            "serve bind",
            None,
            f"--host {host}: without API tokens the service binds only loopback (127.0.0.1, ::1)",
            "create one first: scaletune serve token create --scope admin",
        )
    ]


@dataclass(frozen=True)
class Caller:
    scope: str
    by_cookie: bool = False
    cookie: str = ""


class Csrf:
    def __init__(self, key: bytes) -> None:
        self.key = key

    def token(self, cookie: str) -> str:
        return hmac.new(self.key, cookie.encode(), hashlib.sha256).hexdigest()

    def valid(self, cookie: str, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(self.token(cookie), given or "")
