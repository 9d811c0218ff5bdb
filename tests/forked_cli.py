"""`scaletune` command lines run in forks of one process that has already imported torch and
transformers (a "zygote", as Android and Chromium start their processes), for the tests that run
the command line many times (tests/helpers.py run_cli).

Why: every `python -m scaletune ...` a test starts first imports torch, transformers and peft,
8-10 CPU-s on a 2-core machine before it does anything, and CI starts ~300 of them (issue 33). A
fork of a process that has imported them starts in milliseconds. What the child runs is what the
`scaletune` script runs: `scaletune.cli.main()` on its own `sys.argv`, with the request's
environment, working directory, standard input and output files, ending through the CLI's own exit
(its exit status is the child's). It is a process of its own: a crash, an `os._exit`, a re-exec under
torchrun, a signal or a leak stays in it.

What a fork cannot give, the caller asks a fresh process for (helpers.run_cli decides): a child
whose environment differs in a variable read at import time (HF_*, HOME, DS_*, PYTHONPATH, ...: only
those in :data:`CALL_TIME_VARIABLES` may differ), one with its own CPU affinity, or a test of what
the command imports or costs to start. The tests that prove the user's command itself start it the
user's way (`train(..., launcher="scaletune")` of several processes re-executes under a real
torchrun; tests/e2e/test_train_cli.py, test_quickstart, the distributed tier).

**Delegated processes.** The processes a forked command starts in turn are fresh interpreters: the
torchrun that a plain `scaletune train` of several processes re-executes into, and each rank that
torchrun starts (`python -u -m scaletune train ...`), ~6 CPU-s of imports each (141 ranks and 61
torchruns in CI at 27fa30c). Where SCALETUNE_TEST_ZYGOTE names this zygote's socket (run_cli's
forks and run_torchrun set it, and their descendants inherit it), such a process hands itself to the
zygote at start-up (:func:`delegate`, called by tests/instrument/sitecustomize.py): a fork of the
zygote becomes it (its argv, environment, working directory, umask, standard files by descriptor,
session), and the process that was started stays as its stand-in: it forwards the signals it gets
(torchrun ends a worker by signalling its process group) and ends as the fork ended (its exit status,
or the same signal). It is done only for `-m scaletune`, `-m torch.distributed.run` and the scripts
of tests/distributed, only where the environment differs from the zygote's in variables read when a
command runs (:data:`CALL_TIME_VARIABLES`, :data:`WORKER_VARIABLES`), with the same interpreter,
no interpreter option but `-u`, the same CPU affinity and resource limits; anything else runs itself.
What the ranks run is the program a fresh rank runs (`runpy`, as `python -m` does); only the
imports are already done. A fresh interpreter is still proven where it is the question (`fresh=True`,
SCALETUNE_TEST_FORK=0, a test's own environment or cores).

Run as a script (by :class:`ForkServer`), this file is the zygote: it imports, then serves requests
on a Unix socket until its standard input closes (its pytest worker has gone). Each request is one
connection: the zygote forks a monitor for it, which forks the child, sends back the child's pid,
waits for it and sends back its wait status. (The zygote itself never waits: it ignores SIGCHLD so
its monitors are reaped by the kernel; the monitor restores SIGCHLD for the child, whose own
subprocesses must be waitable.)
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Mapping
from pathlib import Path, PurePath

# What a child's environment may change from the zygote's: variables read when a command runs, not
# when torch, transformers, huggingface_hub or DeepSpeed are imported (those read HF_HOME,
# HF_ENDPOINT, HF_HUB_OFFLINE, HOME, DS_ACCELERATOR, OMP_NUM_THREADS and more into module constants).
# scaletune reads its own variables when a verb runs (nothing in src/ reads os.environ at import).
# The last two are set in the test worker by DeepSpeed's own import (`os.environ.setdefault`), read
# when CUDA is asked about or inductor compiles; a fresh child that imports DeepSpeed sets the same.
# (In CI at ea0c86b they made one worker's every call differ from its zygote's, so start fresh.)
CALL_TIME_VARIABLES = (
    "SCALETUNE_",
    "PYTEST_CURRENT_TEST",
    "COLUMNS",
    "TERMINAL_WIDTH",
    "WANDB_",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "TORCHINDUCTOR_CACHE_DIR",
    # scaletune.safe_load.enforce sets the first in a command's process, so its torchrun and ranks
    # inherit it; torch.serialization reads both in torch.load.
    "TORCH_FORCE_WEIGHTS_ONLY_LOAD",
    "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD",
    # Set in a test worker by what its tests import or run in-process: scikit-learn, joblib and
    # threadpoolctl set Intel/LLVM OpenMP's KMP_DUPLICATE_LIB_OK and KMP_INIT_AT_FORK at import, and
    # inductor's compile sets the first and the pointer its compiled module reads when loaded. The
    # OpenMP that torch (and scikit-learn) load here is GNU's libgomp, which reads no KMP_ variable.
    # (In CI at 358b446 they made 280 of 330 processes that asked start fresh.)
    "KMP_DUPLICATE_LIB_OK",
    "KMP_INIT_AT_FORK",
    "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    # A shell sets these to the folder it runs in (the service's jobs start through `sh -c`:
    # scaletune/serve/jobs/dispatch/local.py). Python takes its working directory from the kernel
    # (:func:`_delegated_child` changes to the process's), and none of PRELOAD's imports reads them.
    "PWD",
    "OLDPWD",
)

# What torchrun gives each worker beyond its own environment (torch 2.13:
# torch/distributed/elastic/agent/server/local_elastic_agent.py _start_workers; the error file,
# elastic/multiprocessing/api.py; TORCHELASTIC_* also what torchrun passes its own agent), read when
# the process group starts: tracing os.environ during
# PRELOAD's imports and torch.distributed.run's finds none of them read at import (issue 33).
WORKER_VARIABLES = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "LOCAL_WORLD_SIZE",
        "WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    }
)

# The programs a process may hand to the zygote (:func:`delegate`): `python -m NAME` of these, or a
# script of this folder.
DELEGATED_MODULES = ("scaletune", "torch.distributed.run", "scaletune.serve.jobs.validate")
DELEGATED_SCRIPTS = Path(__file__).resolve().parent / "distributed"

# What the service's processes (a job, its config check, its tasks) start with that the zygote's do
# not (scaletune/serve/jobs/dispatch/base.py job_environment, dispatch/local.py):
# - interpreter options, which Python's start-up reads (Python/initconfig.c) and
#   :func:`_delegated_child` does as that start-up would: no working directory first on sys.path,
#   standard streams written through;
STARTUP_VARIABLES = ("PYTHONSAFEPATH", "PYTHONUNBUFFERED")
# - the job's own Hugging Face home, which huggingface_hub, transformers, datasets and accelerate read
#   at import into paths below it (huggingface_hub/constants.py, transformers/utils/hub.py,
#   datasets/config.py, accelerate/commands/config): :func:`rehome` re-points those in the fork, and
#   tests/distributed/test_delegated_processes.py checks the fork's bindings equal a fresh process's.
HOME_VARIABLE = "HF_HOME"

# The CPU seconds of the forks this process's zygote ran and waited for (theirs and their waited-for
# children's): what RUSAGE_CHILDREN would count had they been this process's children (tests/conftest.py
# adds it to a test's CPU).
FORKED_CPU = [0.0]

# The zygote's socket, in the zygote (its folder holds `delegated-cpu`: one line per delegated
# process, its CPU seconds and its waited-for children's).
SOCKET_PATH = [""]

# What the zygote imports before it forks: what a tiny `scaletune train`, `export`, `eval` and
# `generate` import anyway (python -X importtime of each), so that a child imports almost nothing.
PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.olmo2.modeling_olmo2",
    "peft",
    "safetensors.torch",
    "scaletune.cli",
    "scaletune.cli.app",
    "scaletune.trainer",
    "scaletune.models.loading",
    "torch.distributed.launcher.api",  # torchrun's, when it is delegated (not torchrun itself: runpy runs it)
    "datasets",  # data/build.py (0.5 CPU-s)
    "matplotlib.pyplot",  # loss.png (trainer/metrics.py, 0.4 CPU-s)
)


def _send(conn: socket.socket, obj: object) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack("!I", len(data)) + data)


def _recv(conn: socket.socket) -> object | None:
    """One message, or None when the other side closed first."""
    head = _read_exactly(conn, 4)
    if head is None:
        return None
    body = _read_exactly(conn, struct.unpack("!I", head)[0])
    return None if body is None else json.loads(body)


def _read_exactly(conn: socket.socket, n: int) -> bytes | None:
    chunks = b""
    while len(chunks) < n:
        chunk = conn.recv(n - len(chunks))
        if not chunk:
            return None
        chunks += chunk
    return chunks


# ---------------------------------------------------------------- the zygote (this file as a script)


def serve(socket_path: str) -> None:
    """Import :data:`PRELOAD`, then answer requests on `socket_path` until standard input closes."""
    import importlib

    SOCKET_PATH[0] = socket_path
    for name in PRELOAD:
        importlib.import_module(name)
    # Nothing may run in another thread when the zygote forks (a lock held there stays held in the
    # child forever): the imports above start none.
    assert threading.active_count() == 1, threading.enumerate()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable and not sys.stdin.buffer.read1(1):
            return  # the pytest worker that started this has gone
        if listener in readable:
            conn, _ = listener.accept()
            if os.fork() == 0:
                listener.close()
                _monitor(conn)
            conn.close()


def _monitor(conn: socket.socket) -> None:
    """One request: fork the child that runs it, tell the client its pid, wait, send its status."""
    try:
        request = _recv(conn)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        if "program" in request:
            _monitor_delegated(conn, request)
            return
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(request)
        _send(conn, {"pid": pid})
        _, status, usage = os.wait4(pid, 0)
        _send(conn, {"status": status, "cpu": usage.ru_utime + usage.ru_stime})
    finally:
        os._exit(0)  # the monitor has no exit functions of its own to run (the zygote's are not its)


def _child(request: dict) -> None:
    """Become `python -m scaletune ARGV` for `request` and run it; never returns."""
    try:
        os.setpgid(0, 0)  # its own process group, so that a timeout ends what it started too
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        for fd, (path, mode) in enumerate(
            [(request["stdin"], os.O_RDONLY), *[(request[k], os.O_WRONLY | os.O_TRUNC) for k in ("stdout", "stderr")]]
        ):
            opened = os.open(path, mode)
            os.dup2(opened, fd)
            os.close(opened)
        import scaletune.__main__ as entry

        sys.argv = [entry.__file__, *request["argv"]]
        _mark_started("forked")
        from scaletune.cli import main

        main()  # ends the process (cli._exit_now), with the verb's exit status
        os._exit(0)
    except SystemExit as exc:
        os._exit(exc.code if isinstance(exc.code, int) else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


def _monitor_delegated(conn: socket.socket, request: dict) -> None:
    """A process handing itself over (:func:`delegate`): fork the child that becomes it, or say why
    it must run itself; then wait for the child (or kill its process group, should the process that
    handed itself over end first), send its status, add its CPU to the zygote's tally."""
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    refusal = _refusal(request)
    if refusal:
        _send(conn, {"fresh": refusal})
        return
    pid = os.fork()
    if pid == 0:
        conn.close()
        _delegated_child(request, fds)
    for fd in fds:
        os.close(fd)
    _send(conn, {"pid": pid})
    pidfd = os.pidfd_open(pid)
    while pidfd not in select.select([conn, pidfd], [], [])[0]:
        if not conn.recv(1):  # the stand-in has gone (killed): so does what it stood for
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:  # not yet its own group
                os.kill(pid, signal.SIGKILL)
            break
    _, status, usage = os.wait4(pid, 0)
    cpu = usage.ru_utime + usage.ru_stime
    with open(os.path.join(os.path.dirname(SOCKET_PATH[0]), "delegated-cpu"), "a") as tally:
        tally.write(f"{cpu:.3f}\n")  # one short write under O_APPEND: whole
    try:
        _send(conn, {"status": status, "cpu": cpu})
    except OSError:
        pass


def _refusal(request: dict) -> str:
    """Why a process with `request`'s circumstances would not behave as a fork of this zygote ('': it would)."""
    import resource

    if request["executable"] != sys.executable:
        return f"another interpreter ({request['executable']})"
    read_at_import = [
        k
        for k in read_at_import_differences(request["env"], os.environ, launched=True)
        if k not in (*STARTUP_VARIABLES, HOME_VARIABLE)
    ]
    if read_at_import:
        return "its environment differs in variables read at import: " + ", ".join(read_at_import)
    if request["affinity"] != sorted(os.sched_getaffinity(0)):
        return "another CPU affinity"
    for name, limits in request["rlimits"].items():
        if list(resource.getrlimit(getattr(resource, name))) != limits:
            return f"another {name}"
    return ""


def read_at_import_differences(env: Mapping[str, str], base: Mapping[str, str], *, launched: bool = False) -> list[str]:
    """The variables in which `env` differs from `base` (a zygote's) that a process may read at
    import, where a fork of the zygote would not see them as a fresh process does: all but
    :data:`CALL_TIME_VARIABLES`, and (`launched`: a process torchrun started, or torchrun itself)
    :data:`WORKER_VARIABLES` and TORCHELASTIC_*."""
    allowed = (*CALL_TIME_VARIABLES, "TORCHELASTIC_") if launched else CALL_TIME_VARIABLES
    return sorted(
        k
        for k in env.keys() | base.keys()
        if env.get(k) != base.get(k) and not (k.startswith(allowed) or (launched and k in WORKER_VARIABLES))
    )


def _mark_started(how: str) -> None:
    """Tell tests/instrument/sitecustomize.py, where it is loaded, how this process started
    ("forked", "delegated") and that its wall time starts now."""
    if "sitecustomize" in sys.modules:
        sys.modules["sitecustomize"]._started = time.monotonic()
        sys.modules["sitecustomize"]._started_as = how


def _delegated_child(request: dict, fds: list[int]) -> None:
    """Become the process that handed itself over: `python [-u] -m MODULE ARGS` or `python [-u]
    SCRIPT ARGS` as a fresh interpreter runs it (runpy, as Python's main does); never returns."""
    code = 1
    try:
        os.setsid() if request["session"] else os.setpgid(0, 0)
        for sig in signal.valid_signals():
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(sig, signal.SIG_DFL)
        # What Python's start-up sets (Python/pylifecycle.c): KeyboardInterrupt, no death by SIGPIPE or SIGXFSZ.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        rehome()
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        _standard_streams(unbuffered=request["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED")))
        sys.orig_argv = request["orig_argv"]
        _mark_started("delegated")
        import runpy

        program = request["program"]
        try:
            if os.environ.get("PYTHONSAFEPATH"):
                del sys.path[0]  # -P: neither the working directory nor the script's folder
            if program[0] == "-m":
                sys.argv = ["-m", *program[2:]]
                if not os.environ.get("PYTHONSAFEPATH"):
                    sys.path[0] = request["cwd"]
                runpy._run_module_as_main(program[1], alter_argv=True)
            else:
                sys.argv = list(program)
                if not os.environ.get("PYTHONSAFEPATH"):
                    sys.path[0] = os.path.dirname(os.path.realpath(program[0]))
                runpy.run_path(program[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except KeyboardInterrupt:
            code = -signal.SIGINT  # Python ends by SIGINT after an uncaught KeyboardInterrupt
            sys.excepthook(*sys.exc_info())
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        # What the interpreter does at exit (Py_FinalizeEx): wait for threads, exit functions, flush.
        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    except BaseException:
        import traceback

        traceback.print_exc()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 1)


def hf_home(env: Mapping[str, str]) -> str:
    """The Hugging Face home a process with `env` reads at import (huggingface_hub/constants.py)."""
    return os.path.expanduser(
        env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    )


def rehome() -> None:
    """Where os.environ names another Hugging Face home than the one this process's modules read at
    import: every binding below the old one (:func:`_path_bindings`: a string or path, or one in a
    tuple) re-pointed below the new one, as a fresh process's imports would have made it."""
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is None:
        return
    old, new = constants.HF_HOME, hf_home(os.environ)
    if old == new:
        return

    def moved(value: object) -> object:
        if isinstance(value, str) and (value == old or value.startswith(old + os.sep)):
            return new + value[len(old) :]
        if isinstance(value, PurePath) and (str(value) == old or str(value).startswith(old + os.sep)):
            return type(value)(new + str(value)[len(old) :])
        return value

    for owner, key, value in _path_bindings():
        if isinstance(value, tuple):
            if type(value) is tuple and any(moved(v) is not v for v in value):
                setattr(owner, key, tuple(moved(v) for v in value))
        elif (m := moved(value)) is not value:
            setattr(owner, key, m)


def _path_bindings() -> list[tuple[object, str, object]]:
    """(owner, name, value) of every binding that may hold a path: the attributes of every imported
    module and of the classes defined in it whose value is a string, a path or a tuple, and every
    function's defaults (name `__defaults__`). Read with warnings silenced: a deprecated binding warns
    when looked at (torch.distributed.reduce_op)."""
    import warnings

    found: list[tuple[object, str, object]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for module in list(sys.modules.values()):
            if module is None or not hasattr(module, "__dict__"):
                continue
            owners = [
                module,
                *(v for v in vars(module).values() if isinstance(v, type) and v.__module__ == module.__name__),
            ]
            for owner in owners:
                for key, value in list(vars(owner).items()):
                    if isinstance(value, types.FunctionType) and value.__defaults__:
                        found.append((value, "__defaults__", value.__defaults__))
                    if isinstance(value, (str, PurePath, tuple)):
                        found.append((owner, key, value))
    return found


def hf_bindings(*homes: str) -> dict[str, str]:
    """Every binding :func:`rehome` looks at whose value names one of `homes`, as "owner.name" ->
    its value's text (a tuple's strings and paths, space-separated)."""
    found = {}
    for owner, key, value in _path_bindings():
        paths = value if isinstance(value, tuple) else (value,)
        text = " ".join(str(p) for p in paths if isinstance(p, (str, PurePath)))
        if any(h in text for h in homes):
            where = (
                owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
            )
            found[f"{where}.{key}"] = text
    return found


def _exit_code(exc: SystemExit) -> int:
    """The exit status Python gives `raise SystemExit(code)` (None: 0; not an int: printed, 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def _standard_streams(*, unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr over descriptors 0-2 as Python's start-up makes them
    (Python/pylifecycle.c create_stdio): stdout line-buffered on a terminal, stderr always; with -u
    both written through, unbuffered."""
    import io

    made = []
    for fd, like in enumerate((sys.__stdin__, sys.__stdout__, sys.__stderr__)):
        write = fd > 0
        raw = io.FileIO(fd, "wb" if write else "rb", closefd=False)
        buffered = not (write and unbuffered)
        buffer = raw if not buffered else (io.BufferedWriter(raw) if write else io.BufferedReader(raw))
        made.append(
            io.TextIOWrapper(
                buffer,
                encoding=like.encoding,
                errors=like.errors,
                newline="\n",
                line_buffering=buffered and write and (fd == 2 or raw.isatty()),
                write_through=not buffered,
            )
        )
    sys.stdin, sys.stdout, sys.stderr = made
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def delegate() -> None:
    """At the start of a process the tests started (tests/instrument/sitecustomize.py): if
    SCALETUNE_TEST_ZYGOTE names a zygote and this process is one it may stand for (`python [-u] -m`
    of :data:`DELEGATED_MODULES`, or a script of tests/distributed), hand it over and end as the
    fork that became it ends; return where it must run itself (another interpreter, option,
    environment, affinity or limits: :func:`_refusal`; SCALETUNE_TEST_FORK=0; no zygote)."""
    socket_path = os.environ.get("SCALETUNE_TEST_ZYGOTE")
    if not socket_path or os.environ.get("SCALETUNE_TEST_FORK") == "0":
        return
    program = sys.orig_argv[1:]
    unbuffered = program[:1] == ["-u"]
    program = program[1:] if unbuffered else program
    if program[:1] == ["-m"]:
        if program[1:2] not in ([m] for m in DELEGATED_MODULES):
            return
    elif not (program and program[0].endswith(".py") and Path(program[0]).resolve().parent == DELEGATED_SCRIPTS):
        return
    import resource

    request = {
        "program": program,
        "unbuffered": unbuffered,
        "orig_argv": sys.orig_argv,
        "executable": sys.executable,
        "env": dict(os.environ),
        "cwd": os.getcwd(),
        "umask": os.umask(0o022),
        "session": os.getsid(0) == os.getpid(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "rlimits": {
            name: list(resource.getrlimit(getattr(resource, name)))
            for name in dir(resource)
            if name.startswith("RLIMIT_")
        },
    }
    os.umask(request["umask"])
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(socket_path)
    except OSError:  # the worker and its zygote have gone (a process that outlived its test)
        conn.close()
        return
    _send(conn, request)
    socket.send_fds(conn, [b"\0"], [0, 1, 2])
    answer = _recv(conn) or {"fresh": "the zygote's monitor ended"}
    if "fresh" in answer:
        conn.close()
        if "sitecustomize" in sys.modules:  # its line in the process log says why (tests/conftest.py sums them)
            sys.modules["sitecustomize"]._started_as = "refused: " + answer["fresh"]
        return
    pid = answer["pid"]

    def forward(sig: int, _frame) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    answer = _recv(conn)
    if answer is None:
        os.write(2, b"[forked_cli] the zygote's monitor ended without the delegated process's status\n")
        os._exit(1)
    status = answer["status"]
    if os.WIFSIGNALED(status):
        if os.WTERMSIG(status) not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if not os.WIFSIGNALED(status) else 128 + os.WTERMSIG(status))


# ---------------------------------------------------------------- the client (a pytest worker)


class ForkServer:
    """A zygote for this process, started on first use with `env` (:func:`run` forks of it)."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env = env
        self.folder = Path(tempfile.mkdtemp(prefix="scaletune-zygote-"))
        self.socket_path = str(self.folder / "socket")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, self.socket_path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=cwd,
            text=True,
        )
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the CLI zygote did not start (exit {self.proc.wait()})")

    def can_run(self, env: dict[str, str]) -> bool:
        """Whether a child with `env` behaves as a fresh process would: only variables read when a
        command runs differ from the zygote's."""
        return not read_at_import_differences(env, self.env)

    def run(
        self, argv: list[str], *, env: dict[str, str], cwd: Path, input: str, timeout: float
    ) -> subprocess.CompletedProcess:
        """`scaletune ARGV` in a fork, as `subprocess.run([python, -m, scaletune, *argv],
        capture_output=True, text=True, timeout=timeout, ...)` would run it."""
        with tempfile.TemporaryDirectory(dir=self.folder) as tmp:
            files = {name: Path(tmp) / name for name in ("stdin", "stdout", "stderr")}
            files["stdin"].write_text(input)
            for name in ("stdout", "stderr"):
                files[name].touch()
            request = {"argv": argv, "env": env, "cwd": str(cwd), **{k: str(v) for k, v in files.items()}}
            status = self._ask(request, timeout, argv, files)
            out, err = (files[k].read_text(errors="replace") for k in ("stdout", "stderr"))
        code = os.waitstatus_to_exitcode(status)
        return subprocess.CompletedProcess([sys.executable, "-m", "scaletune", *argv], code, out, err)

    def _ask(self, request: dict, timeout: float, argv: list[str], files: dict[str, Path]) -> int:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.socket_path)
            _send(conn, request)
            conn.settimeout(timeout)
            pid = (_recv(conn) or {}).get("pid")
            assert pid, "the CLI zygote's monitor ended before it started the child"
            try:
                answer = _recv(conn)
            except TimeoutError:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:  # killed before it made its own group
                    os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(
                    argv,
                    timeout,
                    files["stdout"].read_text(errors="replace"),
                    files["stderr"].read_text(errors="replace"),
                ) from None
            assert answer is not None, f"the CLI zygote's monitor of pid {pid} ended without its status"
            FORKED_CPU[0] += answer["cpu"]
            return answer["status"]

    def delegated_cpu(self) -> float:
        """The CPU seconds of the processes delegated to this zygote that have ended (:func:`delegate`)."""
        try:
            return sum(float(x) for x in (self.folder / "delegated-cpu").read_text().split())
        except FileNotFoundError:
            return 0.0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve(sys.argv[1])
