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
import math
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import func, select

from scaletune.errors import Problem
from scaletune.serve.jobs.db import Token, now

SCOPES = ("read", "submit", "admin")
COOKIE = "scaletune_session"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
ENV_ADMIN = "admin-env"  # the name of the token SCALETUNE_ADMIN_TOKEN installs
MIN_ENV_TOKEN = 32  # characters: an operator-chosen token guessable in fewer tries is refused
MIN_ENV_BITS = 128  # `entropy_bits` of it: a long token of few distinct characters is refused too


def create_token(Session, scope: str, name: str | None = None, created_by: str = "") -> str:  # noqa: N803
    """A new API token of `scope` held by `name` (default `SCOPE-N`); its value is returned once
    and stored hashed.

    Raises:
        ValueError: an unknown scope, a name that is not 1-64 of `A-Z a-z 0-9 _ . @ -` (first a
            letter or digit), `admin-env` (SCALETUNE_ADMIN_TOKEN's), or a name already taken (revoked
            tokens keep theirs).
    """
    if scope not in SCOPES:
        raise ValueError(f"--scope {scope!r}: one of {', '.join(SCOPES)}")
    if name is not None and not NAME.fullmatch(name):
        raise ValueError(f"--name {name!r}: 1-64 letters, digits, _ . @ - (starting with a letter or digit)")
    if name == ENV_ADMIN:
        raise ValueError(f"--name {name!r}: kept for the token SCALETUNE_ADMIN_TOKEN installs")
    token = "st_" + secrets.token_urlsafe(32)
    with Session() as s:
        if name is None:
            name = f"{scope}-{(s.scalar(select(func.max(Token.id))) or 0) + 1}"
        if s.scalar(select(Token.id).where(Token.name == name)) is not None:
            raise ValueError(f"--name {name!r}: a token of that name exists (names stay taken after revoking)")
        s.add(Token(hash=digest(token), scope=scope, name=name, created_by=created_by))
        s.commit()
    return token


def install_env_admin(Session, value: str) -> list[Problem]:  # noqa: N803
    """Make `value` (SCALETUNE_ADMIN_TOKEN) the admin token named `admin-env`, replacing the one an
    earlier value made: a platform's secret store holds it, rotating it there revokes the old one
    at the next start. Returns the problems (too short), naming the variable, never the value."""
    value = value.strip()
    make = 'make one with: python -c "import secrets; print(secrets.token_urlsafe(32))"'
    if len(value) < MIN_ENV_TOKEN:
        return [
            Problem(
                "SCALETUNE_ADMIN_TOKEN",
                None,
                f"SCALETUNE_ADMIN_TOKEN holds {len(value)} characters: an admin token needs at least {MIN_ENV_TOKEN}",
                make,
            )
        ]
    bits = entropy_bits(value)
    if bits < MIN_ENV_BITS:
        return [
            Problem(
                "SCALETUNE_ADMIN_TOKEN",
                None,
                f"SCALETUNE_ADMIN_TOKEN repeats too few characters to be hard to guess (about "
                f"{bits:.0f} bits; an admin token needs {MIN_ENV_BITS})",
                make,
            )
        ]
    with Session() as s:
        row = s.scalar(select(Token).where(Token.name == ENV_ADMIN))
        if row is None:
            s.add(Token(hash=digest(value), scope="admin", name=ENV_ADMIN, created_by="environment"))
        else:
            row.hash, row.scope, row.revoked = digest(value), "admin", None
        s.commit()
    return []


def entropy_bits(value: str) -> float:
    """An estimate of how hard `value` is to guess: its length times the Shannon entropy of its
    characters' frequencies (bits). `secrets.token_urlsafe(32)` gives about 200; 40 characters
    of one repeated letter and a short prefix about 60."""
    counts = [value.count(c) for c in set(value)]
    return len(value) * -sum(n / len(value) * math.log2(n / len(value)) for n in counts)


def drop_env_admin(Session) -> bool:  # noqa: N803
    """SCALETUNE_ADMIN_TOKEN is not set: revoke the `admin-env` token an earlier value made (a
    variable removed from the platform's secret store takes its access with it). True when one was
    in force."""
    with Session() as s:
        row = s.scalar(select(Token).where(Token.name == ENV_ADMIN, Token.revoked.is_(None)))
        if row is None:
            return False
        row.revoked = now()
        s.commit()
    return True


def list_tokens(Session) -> list[dict]:  # noqa: N803
    """Every token (revoked ones too), oldest first: name, scope, created, created_by, revoked, and
    `configured`: whether it is the one SCALETUNE_ADMIN_TOKEN installs at each start (`admin-env`),
    which only the environment rotates or removes for good."""
    with Session() as s:
        return [t.public() | {"configured": configured(t)} for t in s.scalars(select(Token).order_by(Token.id))]


def configured(row: Token) -> bool:
    """Whether `row` is the token SCALETUNE_ADMIN_TOKEN installs (`install_env_admin`)."""
    return row.name == ENV_ADMIN and row.created_by == "environment"


def token_info(Session, token: str) -> dict:  # noqa: N803
    """The listing entry of the token whose value is `token` (it must exist)."""
    with Session() as s:
        row = s.scalar(select(Token).where(Token.hash == digest(token)))
        assert row is not None
        return row.public()


def revoke_token(Session, name: str) -> dict | None:  # noqa: N803
    """Revoke the token `name` (it authenticates nothing from now on: the page's session cookie of
    it included); None when no token has that name. Revoking twice keeps the first time."""
    with Session() as s:
        row = s.scalar(select(Token).where(Token.name == name))
        if row is None:
            return None
        row.revoked = row.revoked or now()
        s.commit()
        return row.public()


def has_tokens(Session) -> bool:  # noqa: N803
    """Whether any token exists, revoked ones included: revoking the last token does not reopen
    the service to token-less access."""
    with Session() as s:
        return bool(s.scalar(select(func.count(Token.id))))


def identify(Session, token: str) -> tuple[str, str] | None:  # noqa: N803
    """(name, scope) of a live token; None for an unknown or revoked one."""
    with Session() as s:
        row = s.execute(
            select(Token.name, Token.scope).where(Token.hash == digest(token), Token.revoked.is_(None))
        ).first()
        return (row[0], row[1]) if row else None


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


OPEN = "local"  # who acts on a token-less (loopback-only) service


@dataclass(frozen=True)
class Caller:
    scope: str
    name: str = OPEN
    by_cookie: bool = False
    cookie: str = ""


class Csrf:
    def __init__(self, key: bytes) -> None:
        self.key = key

    def token(self, cookie: str) -> str:
        return hmac.new(self.key, cookie.encode(), hashlib.sha256).hexdigest()

    def valid(self, cookie: str, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(self.token(cookie), given or "")
