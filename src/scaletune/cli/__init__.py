"""The `scaletune` command line: one thin function per verb (DESIGN.md); the work lives below.

:mod:`.app` holds the typer app and what the verbs share; each `*_verbs` module registers its
verbs on it when imported, here, in `--help`'s order. :func:`main` is the console script
(`scaletune`) and `python -m scaletune`.

Exit codes: 0 success; 2 bad input (config, data, arguments) with every problem named and no
traceback; 1 anything else, with the traceback.
"""

from __future__ import annotations

import sys

import typer

from scaletune.cli.app import app
from scaletune.env import configure_logging
from scaletune.errors import UserError

# The verbs register themselves on `app` when imported; this order is --help's order.
# isort: off
from scaletune.cli import run_verbs, model_verbs, launch_verbs, config_verbs, serve_verbs, remote_verbs  # noqa: F401
# isort: on

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Usage errors exit 2 (click's standalone mode); a UserError raised by a
    verb exits 2 with every problem and no traceback; anything else exits 1 with the traceback."""
    configure_logging()
    try:
        app(args=argv, standalone_mode=True)
    except UserError as exc:
        typer.echo(_error_text(exc), err=True)
        sys.exit(2)


def _error_text(exc: UserError) -> str:
    """The error as printed. Under a launcher (`torchrun -m scaletune train ...`) every rank checks
    the same config and data and meets the same problems: local rank 0 of each node prints them in
    full, the other ranks one line, so a node's log names each problem once. (Each node's first
    rank still prints in full: what is missing on one node may be present on another.)"""
    import os

    local_rank = os.environ.get("LOCAL_RANK", "0")
    if local_rank in ("", "0") or len(exc.problems) == 0:
        return f"error: {exc.format()}"
    return f"error (local rank {local_rank}): {exc.title}; the problems are listed by local rank 0"
