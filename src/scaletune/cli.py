"""The `scaletune` command line: one thin function per verb (DESIGN.md); the work lives below.

Exit codes: 0 success; 2 bad input (config, data, arguments) with every problem named and no
traceback; 1 anything else, with the traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from scaletune.errors import UserError

app = typer.Typer(
    name="scaletune",
    help="Fine-tune LLMs with one YAML file, from one CPU to many GPUs on many nodes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def train(
    config: Annotated[Path, typer.Argument(help="YAML config (see README: config reference).")],
    overrides: Annotated[Optional[list[str]], typer.Argument(help="Dotted overrides, e.g. training.learning_rate=1e-4.")] = None,
) -> None:
    """Train. Under torchrun, the deepspeed launcher or srun, each rank runs this. Started plainly
    with more than one process wanted (distributed.num_processes), it re-executes itself under
    torchrun with one process per device."""
    from scaletune.train import run_from_cli

    run_from_cli(config, overrides or [])


@app.command("init-model")
def init_model(
    preset: Annotated[str, typer.Argument(help="Preset name: see --help of this command for the list.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Folder to write the model and tokenizer to.")],
    seed: Annotated[int, typer.Option(help="Seed of the random initialisation.")] = 0,
) -> None:
    """Build a randomly initialised tiny model from a named preset (olmo2-tiny, llama-tiny, ...)
    with the bundled OLMo-2 tokenizer, and save_pretrained it to OUTPUT."""
    from scaletune.models import init_model as _init

    path = _init(preset, output, seed=seed)
    typer.echo(str(path))


def main(argv: list[str] | None = None) -> None:
    """Console entry point: maps UserError to exit code 2 without a traceback."""
    try:
        app(args=argv, standalone_mode=False)
    except UserError as exc:
        typer.echo(f"error: {exc.format()}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(1)
    except SystemExit:
        raise
    except Exception as exc:  # click usage errors are bad input too
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
