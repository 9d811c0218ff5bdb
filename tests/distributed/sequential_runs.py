"""Several `scaletune train` command lines, one after another, in the ranks of one torchrun.

    torchrun --nproc-per-node N tests/distributed/sequential_runs.py JOBS.json

JOBS.json is a list of {"argv": ["train", CONFIG, key=value, ...], "log": PATH}. Every rank runs
each job's argv through the command line's own entry (`scaletune.cli.main(argv)`: the same parsing,
preflight and loop as `torchrun -m scaletune train ...`), its stdout and stderr (file descriptors 1
and 2, so torch's and DeepSpeed's C++ output too) written to PATH on rank 0 and PATH.rankR on the
others; `PATH.exit` gets the job's exit status once every rank has finished it.

Why: a process that loads a model imports torch and transformers first, 8-10 s of CPU on this
machine before any arithmetic, which was most of what a distributed proof cost (a run of the tiny
model computes for 4-6 CPU-s a rank). Here the ranks pay it once for all their runs. The first job
that fails ends every rank (exit 1), since the others would wait in a collective it left.

Only for proofs whose subject is a run's arithmetic and files: what a user's command adds around
the loop (the plain command's re-exec under torchrun, its preflight, a fresh process) is proven by
runs started as users start them (each module that uses this says which)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 (and Python's sys.stdout/sys.stderr over them) written to `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with path.open("w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run(argv: list[str]) -> int:
    """`scaletune ARGV` in this process; its exit status."""
    from scaletune.cli import main

    try:
        main(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - the job's traceback goes to its log, the status to the test
        traceback.print_exc()
        return 1
    return 0


def main() -> None:
    import torch.distributed as dist

    jobs = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ["RANK"])
    for job in jobs:
        log = Path(job["log"])
        with output_to(log if rank == 0 else log.with_name(f"{log.name}.rank{rank}")):
            code = run(job["argv"])
        if code != 0:
            log.with_name(f"{log.name}.exit").write_text(str(code))
            sys.stderr.write(f"[sequential_runs] rank {rank}: {job['argv']} exited {code} (log: {log})\n")
            sys.stderr.flush()
            os._exit(1)
        if rank == 0:
            log.with_name(f"{log.name}.exit").write_text("0")
        assert not dist.is_initialized(), "a run left its process group behind"
    import atexit

    atexit._run_exitfuncs()  # what the command runs at its end (tests/instrument's CPU log among them)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as the command does (scaletune.cli._exit_now): no teardown of torch's modules


if __name__ == "__main__":
    main()
