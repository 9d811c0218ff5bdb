"""`remote submit / status / logs / download`: the job service's client for scripts and CI (the work
is in scaletune.remote)."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from scaletune.cli.app import ConfigArg, OverridesArg, app
from scaletune.errors import UserError

if TYPE_CHECKING:
    from scaletune.remote.client import Client

TOKEN_HELP = (
    "The service's address comes from --url or SCALETUNE_URL; its token from the environment variable "
    "SCALETUNE_TOKEN only, never from an option: a token on a command line is visible to every user of "
    "the machine (`ps`) and stays in shell history."
)
remote_app = typer.Typer(
    help="The job service's client for scripts and CI: submit (and wait for the outcome), status, logs, "
    "download. " + TOKEN_HELP,
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(remote_app, name="remote")

UrlOpt = Annotated[
    str | None,
    typer.Option(
        "--url",
        envvar="SCALETUNE_URL",
        help="The service's address, e.g. https://st.example.com/team (with its --root-path). The token is read "
        "from SCALETUNE_TOKEN only: a token on a command line leaks into `ps` and shell history.",
    ),
]
JobArg = Annotated[str, typer.Argument(help="The job's id (what `remote submit` printed).")]


def _say(text: str) -> None:
    typer.echo(text, err=True)


@contextlib.contextmanager
def _client(url: str | None) -> Iterator[Client]:
    """The client of --url / SCALETUNE_URL with SCALETUNE_TOKEN; a service that cannot be reached or
    fails is one line and exit 1 (no traceback: the fault is not in this program)."""
    try:
        from scaletune.remote.client import Client, RemoteError
    except ImportError as exc:
        raise RuntimeError(f"scaletune remote needs httpx ({exc}): pip install 'scaletune[serve]'") from None
    try:
        with Client.from_env(url) as client:
            yield client
    except RemoteError as exc:
        _say(f"error: {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        _say("interrupted; the job goes on at the service (scaletune remote status JOB)")
        raise typer.Exit(130) from None


def _resources(items: list[str] | None) -> dict:
    import yaml

    out, problems = {}, []
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            problems.append(f"--resource {item!r}: KEY=VALUE, e.g. nodes=2")
            continue
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            problems.append(f"--resource {item!r}: the value is not YAML: {exc}")
    if problems:
        raise UserError(problems, title="invalid arguments")
    return out


@remote_app.command()
def submit(
    config: ConfigArg,
    overrides: OverridesArg = None,
    url: UrlOpt = None,
    target: Annotated[str, typer.Option(help="Where the job runs: local, slurm or modal.")] = "local",
    resource: Annotated[
        list[str] | None,
        typer.Option(help="A target resource KEY=VALUE (repeatable), e.g. nodes=2, gpus_per_node=8, gpu_count=4."),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(help="Follow the job until it ends and exit with its outcome: 0 succeeded, 2 bad input, 1 else."),
    ] = False,
    timeout: Annotated[
        float,
        typer.Option(
            min=1,
            help="Seconds to wait for the service's answer. It checks the config meanwhile; a check that takes longer "
            "goes on there, with the job `checking`, and its id is printed.",
        ),
    ] = 60.0,
    request_id: Annotated[
        str | None,
        typer.Option(
            help="This submission's id (default: a new one): sending it again gives the job it made, never a second "
            "one (for a submit whose answer was lost, or a script's retry).",
        ),
    ] = None,
) -> None:
    """Submit CONFIG (read here, sent as text; its paths are the service's) and print the job's id.
    A config the service refuses exits 2 with every problem it lists. The service answers within
    --timeout: a config whose check (the preflight) takes longer is answered `checking`, with the
    job's id; the check goes on there. With --wait, the job's states, steps and errors follow on
    stderr and the exit code is the job's outcome; a failed job's log tail is printed.

    Example: `scaletune remote submit my.yaml --url https://scaletune.example.org`
    """
    import uuid

    from scaletune.remote.client import Unavailable
    from scaletune.remote.follow import describe, outcome, submitted_text
    from scaletune.remote.follow import wait as wait_for

    try:
        text = config.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{config}: cannot be read: {exc}", title="invalid arguments") from None
    res = _resources(resource)
    rid = request_id or uuid.uuid4().hex
    # The service waits for the check this long, leaving the rest of --timeout for its answer.
    wait_s = max(0.0, timeout - min(10.0, timeout / 2))
    with _client(url) as client:
        try:
            job = client.submit(text, overrides or [], target, res, request_id=rid, wait_s=wait_s, timeout_s=timeout)
        except Unavailable as exc:
            raise Unavailable(
                f"{exc}; if the service received the submission, its job exists: the same command with "
                f"--request-id {rid} answers that job, never a second one"
            ) from None
        job_id = job["id"]
        typer.echo(job_id)
        _say(submitted_text(job, client.url, rid))
        if not wait:
            return
        job = wait_for(client, job_id, _say)
        code = outcome(job)
        if code != 0:
            tail = client.log(job_id, None, 4000).decode(errors="replace").rstrip()
            _say(f"--- the end of job {job_id}'s log ---\n{tail}\n---" if tail else f"job {job_id} has no log")
        _say(describe(job))
    raise typer.Exit(code)


@remote_app.command()
def status(
    job: JobArg,
    url: UrlOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="The API's JSON (GET /api/jobs/JOB) as it is.")] = False,
) -> None:
    """The job's state, phase, step, failure reason and last metrics."""
    from scaletune.remote.follow import describe

    with _client(url) as client:
        summary = client.job(job)
    typer.echo(json.dumps(summary, indent=2) if as_json else describe(summary))


@remote_app.command()
def logs(
    job: JobArg,
    url: UrlOpt = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Go on printing until the job has ended.")] = False,
) -> None:
    """The job's whole log on stdout; with --follow, what it appends too, until the job ends."""
    from scaletune.remote.follow import copy_log

    def write(data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()

    with _client(url) as client:
        copy_log(client, job, write, follow=follow, say=_say)


@remote_app.command()
def download(
    job: JobArg,
    artifact: Annotated[
        str, typer.Argument(help="final, checkpoints/step-N, metrics.jsonl, loss.png, config.yaml, plan.json, ...")
    ] = "final",
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write into (made if missing).")] = ...,
    url: UrlOpt = None,
) -> None:
    """Download one of the job's artifacts into DIR: a folder's files at their paths inside it
    (`final` -> DIR/config.json, ... loadable with from_pretrained), a file as DIR/NAME."""
    from scaletune.remote.follow import download as fetch

    if output.exists() and not output.is_dir():
        raise UserError(f"-o {output}: not a folder", title="invalid arguments")
    with _client(url) as client:
        written = fetch(client, job, artifact, output, _say)
    typer.echo(f"{len(written)} file(s) in {output}")
