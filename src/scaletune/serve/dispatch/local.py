"""`local`: the job as a subprocess of this machine (`scaletune train`, which re-executes itself
under torchrun when the config wants several processes), at most `max_concurrent` at a time.

The process runs in a session of its own under a small `sh` wrapper that writes its exit code
into the job folder, so a restarted service still learns how a job it did not start ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from scaletune.report import STOP_ENV
from scaletune.serve.dispatch.base import EXIT_FILE, LOG_FILE, Dispatcher, JobFiles, Status, exit_code, pid_alive

# "$@" is the train command; $0 the job folder: values reach sh as arguments, never as code. The
# wrapper's PID goes into the folder first, so a service that died while starting it adopts it.
_WRAPPER = (
    'echo $$ > "$0/pid.tmp" && mv "$0/pid.tmp" "$0/pid"; "$@"; code=$?; '
    'echo "$code" > "$0/exit-code.tmp" && mv "$0/exit-code.tmp" "$0/exit-code"'
)
PID_FILE = "pid"


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun puts its workers in sessions of their own); [] when
    `pid` is gone."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


class LocalDispatcher(Dispatcher):
    name = "local"

    def __init__(self, max_concurrent: int = 1, python: str = sys.executable) -> None:
        self.max_concurrent = max_concurrent
        self.python = python
        self._procs: dict[int, subprocess.Popen] = {}

    def argv(self, job: JobFiles) -> list[str]:
        train = [self.python, "-m", "scaletune", "train", str(job.config_path), *job.overrides]
        return ["/bin/sh", "-c", _WRAPPER, str(job.job_dir), *train]

    def submit(self, job: JobFiles) -> str:
        for stale in (job.job_dir / EXIT_FILE, job.stop_file, job.job_dir / PID_FILE):
            stale.unlink(missing_ok=True)
        log = os.fdopen(os.open(job.job_dir / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a")
        env = {**os.environ, **job.env, STOP_ENV: str(job.stop_file), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(
            self.argv(job),
            cwd=job.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self._procs[proc.pid] = proc
        return str(proc.pid)

    def poll(self, target_id: str, job: JobFiles) -> Status:
        pid = int(target_id)
        proc = self._procs.get(pid)
        if proc is not None and proc.poll() is not None:
            self._procs.pop(pid, None)
        code = exit_code(job)
        if code is not None:
            return Status("exited", code)
        if pid_alive(pid, str(job.job_dir)):
            return Status("running")
        return Status("lost")

    def adopt(self, job: JobFiles) -> str | None:
        """The wrapper's PID from the job folder (or, written not yet, from the process table)."""
        try:
            pid = int((job.job_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            pid = next((p.pid for p in psutil.process_iter(["cmdline"]) if _is_wrapper(p, job)), 0)
        if pid and (pid_alive(pid, str(job.job_dir)) or exit_code(job) is not None):
            return str(pid)
        return None

    def cancel(self, target_id: str, job: JobFiles) -> None:
        pid = int(target_id)
        if not pid_alive(pid, str(job.job_dir)):
            return
        tree = [pid, *descendants(pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in tree:
                try:
                    os.kill(p, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(_exists(p) for p in tree):
                self._reap(pid)
                time.sleep(0.1)
        self._reap(pid)

    def _reap(self, pid: int) -> None:
        proc = self._procs.get(pid)
        if proc is not None and proc.poll() is not None:
            self._procs.pop(pid, None)


def _exists(pid: int) -> bool:
    """Whether `pid` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _is_wrapper(proc: psutil.Process, job: JobFiles) -> bool:
    cmd = proc.info.get("cmdline") or []
    return len(cmd) > 3 and cmd[2] == _WRAPPER and cmd[3] == str(job.job_dir)
