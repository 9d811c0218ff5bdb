"""The typer app of the `scaletune` command line and what its verbs share: the argument types,
:func:`resolved` (the config a verb works on), :func:`emit` and :func:`output_file`.

The verb modules import this module and register on :data:`app` / :data:`config_app`;
:mod:`scaletune.cli` imports the verbs and runs the app (:func:`scaletune.cli.main`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from scaletune.errors import UserError

if TYPE_CHECKING:
    from scaletune.env import DistributedEnv
    from scaletune.resolve import RunSpec

app = typer.Typer(
    name="scaletune",
    help="Fine-tune LLMs with one YAML file, from one CPU to many GPUs on many nodes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Markdown: a docstring's hard line breaks join into paragraphs, so help rewraps to the terminal.
    rich_markup_mode="markdown",
)
config_app = typer.Typer(
    help="Standalone DeepSpeed / FSDP configs, and the config's resolved form and reference.",
    no_args_is_help=True,
    rich_markup_mode="markdown",
)
app.add_typer(config_app, name="config")


def _print_version(value: bool) -> None:
    if value:
        from scaletune import version_string

        typer.echo(f"scaletune {version_string()}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print scaletune's version (with the git commit when run from a checkout) and exit.",
        ),
    ] = False,
) -> None:
    pass


ConfigArg = Annotated[Path, typer.Argument(help="YAML config.")]
OverridesArg = Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. training.learning_rate=1e-4.")]
EnvPresetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--env-preset",
        help="NCCL/torch.distributed env preset, repeatable: debug, no-p2p, no-ib, no-shm, long-timeouts, socket-ifname=IFACE (docs/launch.md).",
    ),
]


def emit(text: str, output: Path | None) -> None:
    """Print generated text, or write it to `output` and print the path."""
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text)
        typer.echo(str(output))


def resolved(
    config: Path,
    overrides: list[str] | None,
    *,
    world_size: int | None = None,
    env: DistributedEnv | None = None,
    check: bool = True,
) -> RunSpec:
    """The run a verb works on: the config read and resolved (`auto` by the planner) for this
    process's environment, or `env` (a machine planned for).

    Raises:
        UserError: every schema (and, with `check`, rule) problem, with file:line.
    """
    from scaletune.config import read_config
    from scaletune.env import DistributedEnv
    from scaletune.plan import choose_auto, choose_checkpointing
    from scaletune.resolve import resolve

    env = env or DistributedEnv.from_environ()
    return resolve(
        read_config(config, overrides or []),
        env,
        choose_auto=choose_auto,
        choose_checkpointing=choose_checkpointing,
        world_size=world_size,
        check=check,
    )


def output_file(path: Path | None, option: str) -> None:
    """A file a verb is to write must be writable as a file: checked before anything is computed.

    Raises:
        UserError: the path is a directory, or its folder does not exist or is not writable.
    """
    import os

    if path is None:
        return
    problems = []
    if path.is_dir():
        problems.append(f"{option} {path}: is a directory; give a file name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        problems.append(f"{option} {path}: the folder {parent} does not exist")
    elif not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        problems.append(f"{option} {path}: not writable")
    if problems:
        raise UserError(problems, title="invalid arguments")
