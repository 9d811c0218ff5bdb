"""The `scaletune` command line: one thin function per verb (DESIGN.md); the work lives below.

:mod:`.app` holds the typer app and what the verbs share; each `*_verbs` module registers its
verbs on it when imported, here, in `--help`'s order. :func:`main` is the console script
(`scaletune`) and `python -m scaletune`.

Exit codes: 0 success; 2 bad input (config, data, arguments) with every problem named and no
traceback; 1 anything else, with the traceback.
"""

from __future__ import annotations

import os
import sys

import typer

from scaletune.cli.app import app
from scaletune.env import configure_logging
from scaletune.errors import RunFailure, UserError

# The verbs register themselves on `app` when imported; this order is --help's order.
# isort: off
from scaletune.cli import run_verbs, model_verbs, launch_verbs, config_verbs, serve_verbs, remote_verbs  # noqa: F401
# isort: on

__all__ = ["app", "main"]


def main(argv: list[str] | None = None) -> None:
    """Console entry point. Usage errors exit 2 (click's standalone mode); a UserError raised by a
    verb exits 2 with every problem and no traceback; a RunFailure exits 1 with its message and no
    traceback; anything else exits 1 with the traceback.

    As the process's entry (`argv` None: the `scaletune` script, `python -m scaletune`) it ends the
    process through :func:`_exit_now`; called with `argv` (in-process) it raises SystemExit as click does."""
    configure_logging()
    try:
        try:
            app(args=argv, standalone_mode=True)
        except UserError as exc:
            typer.echo(_error_text(exc), err=True)
            sys.exit(2)
        except RunFailure as exc:
            typer.echo(f"error: {exc}", err=True)
            sys.exit(1)
    except SystemExit as exc:
        if argv is not None:
            raise
        _exit_now(exc.code)


def _exit_now(code: object) -> None:
    """End this process with exit status `code` (SystemExit's: None is 0, a message is printed and 1)
    after what the interpreter's own shutdown does for others (Py_FinalizeEx: threads joined, atexit
    handlers run, standard streams flushed), skipping only its teardown of every module and object.

    Why: tearing down torch, transformers and their imports costs 1.5-2 s of CPU per process,
    measured on the tiny run (12.7 vs 14.3 CPU-s a single-process run, 28.9 vs 31.7 a two-rank one),
    paid by every rank of every run for nothing the run needs. The files scaletune writes are closed
    by their owners before the verb returns (the metrics logger in the loop's `finally`)."""
    import atexit
    import threading

    threading._shutdown()  # type: ignore[attr-defined] - joins non-daemon threads as the interpreter does
    atexit._run_exitfuncs()
    if isinstance(code, str):
        print(code, file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


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
