"""Job records in SQL through SQLAlchemy (SQLite by default, any SQLAlchemy URL such as
`postgresql://...`, or the `postgres://...` Render and Heroku give); the schema is created and upgraded by the Alembic scripts in `migrations/`,
applied when the service starts (:func:`open_db`)."""

from __future__ import annotations

import datetime as dt
import os
import re
import secrets
from pathlib import Path
from typing import Any

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint, create_engine
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, IntegrityError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# The driver of a Postgres URL that names none: psycopg 3, the one the serve extra installs
# (SQLAlchemy's own default, psycopg2, is not installed by it).
POSTGRES_DRIVER = "postgresql+psycopg"
CONNECT_TIMEOUT_S = 10  # a server that does not answer fails the start and /healthz, not hangs them


def now() -> dt.datetime:
    return dt.datetime.now(dt.UTC).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Job(Base):
    """One submitted run. `secret_refs` names environment variables (references), never values."""

    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("owner", "request_id", name="uq_jobs_owner_request_id"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    state: Mapped[str] = mapped_column(String(16), index=True)
    phase: Mapped[str | None] = mapped_column(String(32), nullable=True)
    stage: Mapped[str | None] = mapped_column(String(200), nullable=True)
    step: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str | None] = mapped_column(String(64), nullable=True)
    message: Mapped[str | None] = mapped_column(Text, nullable=True)
    target: Mapped[str] = mapped_column(String(16))
    target_id: Mapped[str | None] = mapped_column(String(200), nullable=True)  # PID, SLURM job id, Modal call id
    config_yaml: Mapped[str] = mapped_column(Text)
    overrides: Mapped[list] = mapped_column(JSON, default=list)
    resources: Mapped[dict] = mapped_column(JSON, default=dict)
    secret_refs: Mapped[list] = mapped_column(JSON, default=list)
    # The submitted secret values sealed with the operator's key (`vault.py`, SCALETUNE_SECRETS_KEY):
    # a Fernet token, never plain text; None without a key, and once the job ended.
    sealed_secrets: Mapped[str | None] = mapped_column(Text, nullable=True)
    job_dir: Mapped[str] = mapped_column(Text)
    run_dir: Mapped[str] = mapped_column(Text)
    last_metrics: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    # Why the loss is not to be trusted: a non-finite loss, or a divergence (records.loss_flag).
    flag: Mapped[str | None] = mapped_column(String(200), nullable=True)
    token_hash: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(64), default="")  # the API token's name that submitted it
    # The client's id for its submission (`remote submit --request-id`): the same owner sending the
    # same id again gets this job back instead of a second one (unique with `owner`; NULLs apart).
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    stop_requested: Mapped[int] = mapped_column(Integer, default=0)
    # {file name: bytes the watcher has read}, so a restarted service reads on where it stopped.
    offsets: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    created: Mapped[dt.datetime] = mapped_column(DateTime, default=now)
    updated: Mapped[dt.datetime] = mapped_column(DateTime, default=now, onupdate=now)

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "state": self.state,
            "phase": self.phase,
            "stage": self.stage,
            "step": self.step,
            "reason": self.reason,
            "message": self.message,
            "target": self.target,
            "target_id": self.target_id,
            "run_dir": self.run_dir,
            "overrides": self.overrides,
            "resources": self.resources,
            "last_metrics": self.last_metrics,
            "flag": self.flag,
            "exit_code": self.exit_code,
            "owner": self.owner,
            "created": self.created.isoformat() + "Z",
            "updated": self.updated.isoformat() + "Z",
        }


class Event(Base):
    """What a job's SSE stream carries; `id` is the SSE event id (Last-Event-ID replays after it)."""

    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # state metric log checkpoint
    data: Mapped[dict] = mapped_column(JSON)
    created: Mapped[dt.datetime] = mapped_column(DateTime, default=now)


class Metric(Base):
    """One metrics.jsonl line of a job; (job, step, kind) is unique, so the rank-0 post and the
    file tail of the same line meet once."""

    __tablename__ = "metrics"
    __table_args__ = (UniqueConstraint("job_id", "step", "kind"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(8))  # train | eval
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    data: Mapped[dict] = mapped_column(JSON)


class Token(Base):
    """An API token, stored as its SHA-256 (the value is shown once, at creation). `name` is who
    holds it (a person, a CI pipeline): jobs and the audit record name it, never the value. A
    revoked token stays listed (the record of who did what still names it) and authenticates
    nothing."""

    __tablename__ = "tokens"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    hash: Mapped[str] = mapped_column(String(64), unique=True)
    scope: Mapped[str] = mapped_column(String(8))
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_by: Mapped[str] = mapped_column(String(64), default="")
    revoked: Mapped[dt.datetime | None] = mapped_column(DateTime, nullable=True)
    created: Mapped[dt.datetime] = mapped_column(DateTime, default=now)

    def public(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "scope": self.scope,
            "created": self.created.isoformat() + "Z",
            "created_by": self.created_by,
            "revoked": self.revoked.isoformat() + "Z" if self.revoked else None,
        }


class Audit(Base):
    """Who did what: one row per action that changes something (submit, stop, cancel, resume,
    clone, token create/revoke, policy change, login, logout), naming the token, never its value."""

    __tablename__ = "audit"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(DateTime, default=now, index=True)
    actor: Mapped[str] = mapped_column(String(64), index=True)
    action: Mapped[str] = mapped_column(String(32))
    job_id: Mapped[str | None] = mapped_column(String(32), nullable=True, index=True)
    detail: Mapped[str] = mapped_column(Text, default="")

    def public(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at.isoformat() + "Z",
            "actor": self.actor,
            "action": self.action,
            "job_id": self.job_id,
            "detail": self.detail,
        }


class Setting(Base):
    """A value the service keeps across restarts and shares between its processes (the page's
    CSRF signing key): in the database, beside the tokens, and never printed."""

    __tablename__ = "settings"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class TaskRecord(Base):
    """A small task on a job (evaluate, export: `tasks.Tasks`): what it is for, who started it, how
    it stands and its result. Never its command line nor its environment (they hold the job's
    secrets). `host` and `service` name the service process that watches it (its PID and start
    mark) and `seen` is that watcher's last sign of life, so a task whose service stopped is told
    from one another service runs (`tasks.Tasks.sweep`); `pid`/`pid_mark` are the task's process."""

    __tablename__ = "tasks"
    id: Mapped[str] = mapped_column(String(16), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    what: Mapped[str] = mapped_column(Text, default="")
    owner: Mapped[str] = mapped_column(String(64), default="")
    state: Mapped[str] = mapped_column(String(16), index=True)  # running succeeded failed interrupted
    result: Mapped[dict | None] = mapped_column(JSON, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    started: Mapped[float] = mapped_column(Float)  # seconds since the epoch, as the API shows them
    ended: Mapped[float | None] = mapped_column(Float, nullable=True)
    seen: Mapped[float] = mapped_column(Float)
    host: Mapped[str] = mapped_column(String(255), default="")
    service: Mapped[str] = mapped_column(String(64), default="")
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    pid_mark: Mapped[str | None] = mapped_column(String(32), nullable=True)


def kept_key(Session: sessionmaker, name: str) -> bytes:  # noqa: N803 - a sessionmaker
    """The 32-byte random key stored as setting `name`, made on first use. A key made at start
    instead would void every open page's signed tokens at each restart; services starting at once
    on one database race to insert it, and the loser reads the winner's."""
    with Session() as s:
        row = s.get(Setting, name)
        if row is not None:
            return bytes.fromhex(row.value)
        s.add(Setting(name=name, value=secrets.token_hex(32)))
        try:
            s.commit()
        except IntegrityError:
            s.rollback()
    with Session() as s:
        return bytes.fromhex(s.get(Setting, name).value)


class DatabaseUnavailable(RuntimeError):
    """The job database cannot be reached or migrated (a wrong environment). The message names the
    database with its password hidden and never holds the password."""


def database_url(url: str) -> URL:
    """`url` as SQLAlchemy takes it: `postgres://` (what Render and Heroku give; SQLAlchemy refuses
    that scheme) and a `postgresql://` naming no driver become `postgresql+psycopg://`.

    Raises:
        UserError: `url` is no database URL (the message hides anything that may be a password).
    """
    from scaletune.errors import UserError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise UserError(
            f"--db {redacted(url)}: not a database URL (sqlite:///PATH or postgresql://USER:PASSWORD@HOST/DB)",
            title="invalid database URL",
        ) from None
    if parsed.drivername in ("postgres", "postgresql"):
        parsed = parsed.set(drivername=POSTGRES_DRIVER)
    return parsed


def redacted(url: str | URL) -> str:
    """`url` with its password shown as `***`, for messages and logs."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:  # not parsable: hide whatever stands between `user:` and `@`
        return re.sub(r"(://[^/@:]*:)[^/]*@", r"\1***@", str(url))


def scrubbed(exc: BaseException, url: str | URL) -> str:
    """The text of a database error with the URL's password, if it appears anywhere, hidden (a
    driver may echo its connection string)."""
    text = str(exc)
    try:
        password = make_url(url).password
    except ArgumentError:
        password = None
    if password:
        from urllib.parse import quote_plus

        for form in {str(password), quote_plus(str(password))}:
            text = text.replace(form, "***")
    return text


def default_url(home: Path | None = None) -> str:
    home = home or Path.home() / ".scaletune"
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'serve.db'}"


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL (None for another database or an in-memory one)."""
    if not url.startswith("sqlite:///") or url in ("sqlite:///", "sqlite:///:memory:"):
        return None
    return Path(url[len("sqlite:///") :].split("?", 1)[0])


def upgrade(url: str) -> None:
    """Apply the Alembic migrations up to head (idempotent). Services starting at once on a fresh
    SQLite file take turns (a file lock beside it), so none meets a half-made schema; the file is
    made readable by the service's user only (its WAL and shared-memory files inherit the mode)."""
    from alembic import command
    from alembic.config import Config as AlembicConfig
    from filelock import FileLock

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    path = sqlite_file(url)
    if path is None:  # a server database: Postgres takes turns under an advisory lock (migrations/env.py)
        command.upgrade(cfg, "head")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock", timeout=120):
        if not path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
        command.upgrade(cfg, "head")


def open_db(url: str) -> tuple[Engine, sessionmaker]:
    """Migrate the database at `url` (normalized by :func:`database_url`) and return its engine
    and session factory.

    Raises:
        UserError: `url` is no database URL.
        DatabaseUnavailable: the database cannot be reached or migrated.
    """
    parsed = database_url(url)
    try:
        upgrade(parsed.render_as_string(hide_password=False))
    except Exception as exc:  # noqa: BLE001 - one clear message for a wrong environment
        # Not chained: the driver's exception (printed with a traceback) could carry the password.
        raise DatabaseUnavailable(f"cannot open the job database {redacted(parsed)}: {scrubbed(exc, parsed)}") from None
    sqlite = parsed.get_backend_name() == "sqlite"
    if sqlite:
        args: dict[str, Any] = {"check_same_thread": False, "timeout": 30}
    elif parsed.drivername == POSTGRES_DRIVER and "connect_timeout" not in parsed.query:
        args = {"connect_timeout": CONNECT_TIMEOUT_S}
    else:
        args = {}
    # pre_ping: a server database restarted under the service is reconnected to, not failed on.
    engine = create_engine(parsed, connect_args=args, pool_pre_ping=not sqlite)
    if sqlite:
        from sqlalchemy import event

        @event.listens_for(engine, "connect")
        def _wal(conn, _):  # concurrent readers while the poller writes
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA busy_timeout=30000")

    return engine, sessionmaker(engine, expire_on_commit=False)
