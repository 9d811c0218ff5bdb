"""Imported at start-up by every Python process the tests start (tests/helpers.py subprocess_env
puts this folder first on PYTHONPATH).

Where SCALETUNE_TEST_ZYGOTE names a zygote (tests/forked_cli.py), a torchrun or a rank hands itself
to it first (:func:`tests.forked_cli.delegate`): a fork that has imported torch and transformers
becomes it, and this process stands in for it until it ends.

While SCALETUNE_PROCESS_LOG names a file (scripts/test.sh sets it): at exit, the process appends one JSON line to that file: the test that started it
(PYTEST_CURRENT_TEST, inherited), what it ran, its rank under a launcher, its CPU seconds (user +
system, its own, not its children's) and its wall seconds. tests/conftest.py sums them at the end
of the run: how many processes the proofs start and where their CPU goes (issue 33).

A process that ends by a signal or `os._exit` without the interpreter's exit functions writes
nothing (scaletune's own exit, cli._exit_now, runs them). A process that re-executes itself (the
plain `scaletune train` of several processes becomes torchrun) writes one line, under the program
it ended as, with the CPU of both."""

import os

# "fresh"; "forked" (a CLI call run_cli forked from a zygote); "delegated" (a fork of a zygote became this process); "refused: WHY" (it asked a
# zygote, which said why it must start fresh): set by tests/forked_cli.py
_started_as = "fresh"

if os.environ.get("SCALETUNE_PROCESS_LOG"):
    import atexit
    import json
    import resource
    import sys
    import time

    _started = time.monotonic()

    def _log_process() -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        line = {
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
            # the program as its folder and file (scaletune/__main__.py, distributed/run.py), then the verb
            "argv": ["/".join(a.split("/")[-2:]) if i == 0 else a for i, a in enumerate(sys.argv[:2])],
            "rank": os.environ.get("RANK"),
            "cpu": round(usage.ru_utime + usage.ru_stime, 2),
            "wall": round(time.monotonic() - _started, 2),
            "started": _started_as,
        }
        try:
            with open(os.environ["SCALETUNE_PROCESS_LOG"], "a") as f:
                f.write(json.dumps(line) + "\n")  # one write of one short line: whole under O_APPEND
        except OSError:
            pass

    atexit.register(_log_process)

if os.environ.get("SCALETUNE_TEST_ZYGOTE"):
    from tests.forked_cli import delegate

    delegate()  # returns only where this process must run itself
