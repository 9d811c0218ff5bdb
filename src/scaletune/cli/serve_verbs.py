"""`serve` (the job API and web page) and `serve token create`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from scaletune.cli.app import app
from scaletune.errors import Problem, UserError

serve_app = typer.Typer(
    help="Job API and web page: submit, watch, stop, cancel, resume and clone runs (local, slurm, modal).\n\n"
    "Example: `scaletune serve --port 8000`, then open http://127.0.0.1:8000/",
    invoke_without_command=True,
    rich_markup_mode="markdown",
)
token_app = typer.Typer(help="API tokens.", no_args_is_help=True)
serve_app.add_typer(token_app, name="token")
app.add_typer(serve_app, name="serve")

DbOpt = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar=["SCALETUNE_DB", "DATABASE_URL"],
        show_envvar=True,
        help="SQLAlchemy URL of the job records, postgres:// too (default sqlite:///~/.scaletune/serve.db).",
    ),
]
ADMIN_ENV = "SCALETUNE_ADMIN_TOKEN"


@serve_app.callback()
def serve(
    ctx: typer.Context,
    host: Annotated[str, typer.Option(help="Address to bind; anything but loopback needs API tokens.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    db: DbOpt = None,
    jobs_dir: Annotated[
        Path | None,
        typer.Option(
            "--jobs-dir", help="Folder of the job folders (config, log, stop request); default ~/.scaletune/jobs."
        ),
    ] = None,
    max_concurrent: Annotated[int, typer.Option(help="Local jobs running at once; the rest wait queued.")] = 1,
    allow_factories: Annotated[
        bool, typer.Option(help="Let configs name model/data factories (submitted code, checked in a child process).")
    ] = False,
    allow_remote_code: Annotated[bool, typer.Option(help="Let configs set trust_remote_code.")] = False,
    allow_env: Annotated[
        list[str] | None,
        typer.Option(
            help="A distributed.env name (or name prefix) jobs may set besides the built-in list (repeatable; docs/security.md)."
        ),
    ] = None,
    disable_target: Annotated[
        list[str] | None,
        typer.Option(
            help="A target jobs may not be sent to: local, slurm or modal (repeatable; e.g. local on a web-only host)."
        ),
    ] = None,
    job_secret: Annotated[
        list[str] | None,
        typer.Option(
            help="OWNER:NAME=VAR: jobs of the token named OWNER (* for every job) get this service's "
            "variable VAR as NAME (repeatable; e.g. '*:HF_TOKEN=HF_TOKEN'). No other credential of the "
            "service reaches a job."
        ),
    ] = None,
    read_root: Annotated[
        list[Path] | None,
        typer.Option(help="A folder jobs may read data and models from (repeatable; default: the working directory)."),
    ] = None,
    write_root: Annotated[
        list[Path] | None, typer.Option(help="A folder run directories may be in besides the jobs folder (repeatable).")
    ] = None,
    trusted_host: Annotated[
        list[str] | None, typer.Option(help="A Host name answered besides loopback's (repeatable).")
    ] = None,
    max_request_mb: Annotated[float, typer.Option(help="Largest request body, in MiB.")] = 4.0,
    max_upload_mb: Annotated[
        float, typer.Option(help="Largest data file uploaded to the data area (POST /api/data), in MiB.")
    ] = 256.0,
    max_data_gb: Annotated[
        float, typer.Option(help="The data area's quota: every uploaded data file together, in GiB.")
    ] = 8.0,
    max_connections: Annotated[
        int,
        typer.Option(
            help="Open connections (and requests in progress) at most; past it a request is answered 503 "
            "at once. Idle and half-sent connections count: an address that opens thousands holds no more."
        ),
    ] = 256,
    root_path: Annotated[
        str,
        typer.Option(
            "--root-path",
            envvar="SCALETUNE_ROOT_PATH",
            show_envvar=True,
            help="The path prefix a reverse proxy serves this under and strips (e.g. /team/st); links carry it.",
        ),
    ] = "",
    public_url: Annotated[
        str | None,
        typer.Option(
            envvar="SCALETUNE_PUBLIC_URL",
            show_envvar=True,
            help="The address jobs on other machines (Modal, SLURM) post their reports to; Modal needs it.",
        ),
    ] = None,
) -> None:
    """Serve the job API (/api, OpenAPI at /docs) and the web page (/). What submitted configs may
    do is the policy (docs/security.md): the --allow-*, --read-root and --write-root options.
    SCALETUNE_ADMIN_TOKEN (at least 32 characters, hard to guess), when set, is an admin API token
    named admin-env (for platforms whose secret store holds it: docs/deploy.md); unset, that token
    is revoked.
    """
    if ctx.invoked_subcommand is not None:
        return
    import uvicorn

    from scaletune.serve.app import create_app
    from scaletune.serve.edge.auth import bind_problems, drop_env_admin, install_env_admin
    from scaletune.serve.edge.policy import Policy, job_secret_problems
    from scaletune.serve.jobs.db import DatabaseUnavailable, database_url, default_url, redacted
    from scaletune.serve.jobs.service import JobService

    problems: list[Problem] = []
    if max_concurrent < 1:
        problems.append(Problem("serve options", None, f"--max-concurrent must be 1 or more, got {max_concurrent}"))
    if max_connections < 8:  # a page holds an event stream and a few requests at once
        problems.append(Problem("serve options", None, f"--max-connections must be 8 or more, got {max_connections}"))
    problems += job_secret_problems(job_secret or (), os.environ)
    for t in disable_target or ():
        if t not in ("local", "slurm", "modal"):
            problems.append(Problem("serve options", None, f"--disable-target {t!r}: one of local, slurm, modal"))
    root_path = root_path.rstrip("/")
    if root_path and (not root_path.startswith("/") or "//" in root_path or any(c in root_path for c in "?#%\\\"' <>")):
        problems.append(
            Problem("serve options", None, f"--root-path must be a path such as /team/st, got {root_path!r}")
        )
    if public_url is not None and not public_url.startswith(("http://", "https://")):
        problems.append(
            Problem("serve options", None, f"--public-url must be an http(s):// address, got {public_url!r}")
        )
    jobs_dir = (jobs_dir or Path.home() / ".scaletune" / "jobs").resolve()
    policy = Policy(
        allow_factories=allow_factories,
        allow_remote_code=allow_remote_code,
        env_prefixes=tuple(allow_env or ()),
        disabled_targets=tuple(disable_target or ()),
        job_secrets=tuple(job_secret or ()),
        read_roots=tuple(str(p.resolve()) for p in read_root) if read_root else None,
        write_roots=tuple(str(p.resolve()) for p in write_root or ()),
        trusted_hosts=tuple(trusted_host or ()),
        max_request_bytes=int(max_request_mb * 2**20),
        max_upload_bytes=int(max_upload_mb * 2**20),
        max_data_bytes=int(max_data_gb * 2**30),
    )
    db = db or default_url()
    address = f"http://{host}:{port}"
    try:
        svc = JobService(db, jobs_dir, address, max_concurrent=max_concurrent, policy=policy, public_url=public_url)
    except DatabaseUnavailable as exc:
        _unavailable(exc)
    if os.environ.get(ADMIN_ENV):
        problems += install_env_admin(svc.Session, os.environ[ADMIN_ENV])
    elif drop_env_admin(svc.Session):
        typer.echo(f"[scaletune] {ADMIN_ENV} is not set: the admin-env token it made is revoked", err=True)
    problems += bind_problems(host, svc.Session)
    if problems:
        raise UserError(problems, title="cannot serve")
    # One line an operator (or a platform's log) sees at start; the password is never printed.
    typer.echo(
        f"scaletune serve: {address} | database {redacted(database_url(db))} | targets {', '.join(t for t in svc.dispatchers if t not in policy.disabled_targets)}"
        f" | at most {max_concurrent} local job{'s' if max_concurrent > 1 else ''} at once"
        + (f" | under {root_path}/ (--root-path)" if root_path else ""),
        err=True,
    )
    uvicorn.run(
        create_app(svc),
        host=host,
        port=port,
        log_level="warning",
        root_path=root_path,
        limit_concurrency=max_connections,  # uvicorn counts open connections and running requests
    )


def _sessions(db: str | None):
    from scaletune.serve.jobs.db import DatabaseUnavailable, default_url, open_db

    try:
        return open_db(db or default_url())[1]
    except DatabaseUnavailable as exc:
        _unavailable(exc)


@token_app.command("create")
def token_create(
    scope: Annotated[str, typer.Option(help="read | submit | admin")] = "read",
    name: Annotated[
        str | None,
        typer.Option(help="Who holds it (a person, a pipeline); jobs and the audit name it. Default SCOPE-N."),
    ] = None,
    db: DbOpt = None,
) -> None:
    """Create an API token; it is printed once, as the last word (stored hashed)."""
    from scaletune.serve.edge.auth import create_token
    from scaletune.serve.edge.teams import record

    Session = _sessions(db)  # noqa: N806 - a sessionmaker
    try:
        token = create_token(Session, scope, name, created_by="cli")
    except ValueError as exc:
        raise UserError(str(exc), title="invalid arguments") from None
    from scaletune.serve.edge.auth import token_info

    made = token_info(Session, token)
    record(Session, "cli", "token.create", detail=f"{made['name']} ({scope})")
    typer.echo(f"created the {scope} token {made['name']} (shown once): {token}")


@token_app.command("list")
def token_list(db: DbOpt = None) -> None:
    """Every token (never its value): name, scope, created, by whom, revoked."""
    from scaletune.serve.edge.auth import list_tokens

    rows = list_tokens(_sessions(db))
    if not rows:
        typer.echo("no tokens: the service is open on loopback only")
    for t in rows:
        revoked = f"  REVOKED {t['revoked']}" if t["revoked"] else ""
        typer.echo(f"{t['name']:<24} {t['scope']:<7} created {t['created']} by {t['created_by'] or '-'}{revoked}")


@token_app.command("revoke")
def token_revoke(
    name: Annotated[str, typer.Argument(help="The token's name (see `token list`).")], db: DbOpt = None
) -> None:
    """Revoke a token: from now on it authenticates nothing, the page logged in with it included."""
    from scaletune.serve.edge.auth import revoke_token
    from scaletune.serve.edge.teams import record

    Session = _sessions(db)  # noqa: N806
    if revoke_token(Session, name) is None:
        raise UserError(f"no token named {name!r} (see scaletune serve token list)", title="invalid arguments")
    record(Session, "cli", "token.revoke", detail=name)
    typer.echo(f"revoked {name}")


def _unavailable(exc: Exception) -> NoReturn:
    """A database that cannot be reached is a wrong environment (exit 1), told in one line: its
    traceback says nothing more, and the driver's exception inside it could hold the password."""
    typer.echo(f"error: {exc}", err=True)
    raise typer.Exit(1)
