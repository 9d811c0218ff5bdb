"""A rank of tests/distributed/test_delegated_processes.py: reports what a program can see of how its
process started, then ends as told.

Usage (each rank): delegation_probe.py OUT MODE, MODE one of
  report: write OUT/rank-R.json and exit 0;
  places HOME: import what the zygote imports (tests/forked_cli.py PRELOAD), write OUT/places.json
    (the bindings that name the Hugging Face home or HOME, sys.path, standard output's buffering) and
    exit 0; a process started as the service starts a job (scaletune/serve/jobs/dispatch/base.py
    job_environment: its own HF_HOME, PYTHONSAFEPATH, PYTHONUNBUFFERED), not under torchrun;
  fail:   rank 0 exits 3 at once, the other ranks wait for a signal (torchrun must end them);
  killed: rank 0 ends by SIGKILL, the other ranks wait for a signal.

It imports nothing heavy, so that started fresh it costs an interpreter's start-up only."""

import json
import os
import signal
import stat
import sys
import time

out, mode = sys.argv[1], sys.argv[2]
if mode == "places":
    import importlib

    torch_imported = "torch" in sys.modules  # the control: a fork of the zygote has, a fresh process has not
    from tests.forked_cli import PRELOAD, hf_bindings, hf_home

    for name in PRELOAD:
        importlib.import_module(name)
    report = {
        "bindings": hf_bindings(hf_home(os.environ), sys.argv[3]),
        "path": sys.path,
        "write_through": sys.stdout.write_through,
        "torch_imported": torch_imported,
    }
    with open(os.path.join(out, "places.json"), "w") as f:
        json.dump(report, f)
    sys.exit(0)
rank = int(os.environ["RANK"])
if mode == "report":
    umask = os.umask(0)
    os.umask(umask)
    report = {
        "argv": sys.argv,
        "orig_argv_tail": sys.orig_argv[1:],
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "name": __name__,
        "main_file": sys.modules["__main__"].__dict__.get("__file__"),
        "umask": umask,
        "session_leader": os.getsid(0) == os.getpid(),
        "group_leader": os.getpgid(0) == os.getpid(),
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "OMP_NUM_THREADS")},
        "stdout": {
            "fd": sys.stdout.fileno(),
            "write_through": sys.stdout.write_through,
            "line_buffering": sys.stdout.line_buffering,
            "is_fifo": stat.S_ISFIFO(os.fstat(1).st_mode),
            "same_as_dunder": sys.stdout is sys.__stdout__,
        },
        "stderr_line_buffering": sys.stderr.line_buffering or sys.stderr.write_through,
        "signals": {
            "SIGINT": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
            "SIGPIPE": signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN,
            "SIGTERM": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
            "SIGCHLD": signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL,
        },
        # the control that tells the two starts apart: a delegated rank is a fork of a zygote that
        # imported torch; a fresh one has imported nothing heavy
        "torch_imported": "torch" in sys.modules,
        # how tests/instrument/sitecustomize.py saw it start (a refusal names its reason)
        "started_as": getattr(sys.modules.get("sitecustomize"), "_started_as", None),
    }
    print(f"rank {rank} reporting", flush=True)
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(report, f)
    sys.exit(0)
if rank == 0:
    time.sleep(1)  # the others are waiting by then
    if mode == "fail":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
with open(os.path.join(out, f"waiting-{rank}"), "w") as f:
    f.write(str(os.getpid()))
signal.pause()  # SIGTERM from torchrun (to this rank's process group) ends it
