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
from pathlib import Path

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
)

# The CPU seconds of the forks this process's zygote ran and waited for (theirs and their waited-for
# children's): what RUSAGE_CHILDREN would count had they been this process's children (tests/conftest.py
# adds it to a test's CPU).
FORKED_CPU = [0.0]

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
        if "sitecustomize" in sys.modules:  # tests/instrument: this process's wall time starts now
            sys.modules["sitecustomize"]._started = time.monotonic()
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
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(k.startswith(CALL_TIME_VARIABLES) for k in changed)

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

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


if __name__ == "__main__":
    serve(sys.argv[1])
