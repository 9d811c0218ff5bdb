"""`local`: the job as a subprocess of this machine (`scaletune train`, which re-executes itself
under torchrun when the config wants several processes), at most `max_concurrent` at a time.

The process runs in a session of its own under a small `sh` wrapper that writes its exit code
into the job folder, so a restarted service still learns how a job it did not start ended.

A job's process is known by its PID and its start time (`process` in the job folder), never by its
command line: right after the start, /proc/PID/cmdline is empty or still the service's own until
the exec completes, and a PID alone may be another process's later. A job is `lost` only when its
process is verifiably gone and no exit code appeared within `lost_grace_s`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from scaletune.report import STOP_ENV
from scaletune.serve.jobs.dispatch.base import (
    EXIT_FILE,
    LOG_FILE,
    Dispatcher,
    JobFiles,
    Status,
    exit_code,
    job_environment,
    pid_alive,
    start_mark,
)

# "$@" is the train command; $0 the job folder: values reach sh as arguments, never as code. The
# wrapper's PID goes into the folder first, so a service that died while starting it adopts it.
_WRAPPER = (
    'echo $$ > "$0/pid.tmp" && mv "$0/pid.tmp" "$0/pid"; "$@"; code=$?; '
    'echo "$code" > "$0/exit-code.tmp" && mv "$0/exit-code.tmp" "$0/exit-code"'
)
PID_FILE = "pid"
PROCESS_FILE = "process"  # "PID START": the wrapper's PID and start mark (base.start_mark), by the service
LOST_GRACE_S = 3.0  # a process gone without an exit code: how long a late exit-code file is waited for


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun puts its workers in sessions of their own); [] when
    `pid` is gone."""
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


class LocalDispatcher(Dispatcher):
    name = "local"

    def __init__(
        self, max_concurrent: int = 1, python: str = sys.executable, lost_grace_s: float = LOST_GRACE_S
    ) -> None:
        self.max_concurrent = max_concurrent
        self.python = python
        self.lost_grace_s = lost_grace_s
        self._procs: dict[int, subprocess.Popen] = {}
        self._gone: dict[str, float] = {}  # job folder -> when its process was first found gone

    def argv(self, job: JobFiles) -> list[str]:
        train = [self.python, "-m", "scaletune", "train", str(job.config_path), *job.overrides]
        return ["/bin/sh", "-c", _WRAPPER, str(job.job_dir), *train]

    def submit(self, job: JobFiles) -> str:
        for stale in (job.job_dir / EXIT_FILE, job.stop_file, job.job_dir / PID_FILE, job.job_dir / PROCESS_FILE):
            stale.unlink(missing_ok=True)
        self._gone.pop(str(job.job_dir), None)
        log = os.fdopen(os.open(job.job_dir / LOG_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a")
        env = job_environment(job, **{STOP_ENV: str(job.stop_file), "PYTHONUNBUFFERED": "1"})
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
        # Our child, not yet reaped: its PID is its own, so the start mark read now is the one a
        # later service compares with.
        try:
            _record(job, proc.pid, start_mark(proc.pid))
        except OSError:
            self.cancel(str(proc.pid), job)
            raise
        return str(proc.pid)

    def running(self) -> int:
        """The processes this service started that have not ended (whatever their jobs' records say)."""
        for pid in list(self._procs):
            self._reap(pid)
        return len(self._procs)

    def poll(self, target_id: str, job: JobFiles) -> Status:
        pid, key = int(target_id), str(job.job_dir)
        code = exit_code(job)
        if code is not None:
            self._reap(pid)
            self._gone.pop(key, None)
            return Status("exited", code)
        if self.alive(pid, job):
            self._gone.pop(key, None)
            return Status("running")
        # Gone without an exit code. The wrapper writes the file as its last act; a late one (a
        # slow or network file system) still settles the job by its code, not as lost.
        first = self._gone.setdefault(key, time.monotonic())
        if time.monotonic() - first < self.lost_grace_s:
            return Status("ending")
        code = exit_code(job)
        return Status("exited", code) if code is not None else Status("lost")

    def alive(self, pid: int, job: JobFiles) -> bool:
        """Whether the job's wrapper process `pid` still runs: our child not yet ended, else the
        process with the recorded start mark; for a job without one (started by an older
        service), one whose command line names the job folder or is not readable yet."""
        if pid in self._procs:
            self._reap(pid)
            return pid in self._procs  # reaped only once ended: until then the PID cannot be reused
        mark = start_mark(pid)
        if mark is None:
            return False
        recorded = _recorded(job, pid)
        if recorded is not None:
            return recorded == mark
        return pid_alive(pid, str(job.job_dir))

    def adopt(self, job: JobFiles) -> str | None:
        """The wrapper's PID from the job folder (or, written not yet, from the process table);
        its start mark recorded, as `submit` would have."""
        try:
            pid = int((job.job_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            pid = next((p.pid for p in psutil.process_iter(["cmdline"]) if _is_wrapper(p, job)), 0)
        if not pid:
            return None
        if self.alive(pid, job):
            mark = start_mark(pid)
            if mark is not None and _recorded(job, pid) is None:
                _record(job, pid, mark)
            return str(pid)
        return str(pid) if exit_code(job) is not None else None

    def cancel(self, target_id: str, job: JobFiles) -> None:
        pid = int(target_id)
        if not self.alive(pid, job):
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


def _record(job: JobFiles, pid: int, mark: str | None) -> None:
    if mark is None:  # not readable here: the command line check stands in (base.pid_alive)
        return
    tmp = job.job_dir / f"{PROCESS_FILE}.tmp"
    tmp.write_text(f"{pid} {mark}\n")
    tmp.replace(job.job_dir / PROCESS_FILE)


def _recorded(job: JobFiles, pid: int) -> str | None:
    """The start mark recorded for `pid` in the job folder; None without one (or for another PID)."""
    try:
        got_pid, mark = (job.job_dir / PROCESS_FILE).read_text().split()
    except (OSError, ValueError):
        return None
    return mark if got_pid == str(pid) else None


def _is_wrapper(proc: psutil.Process, job: JobFiles) -> bool:
    cmd = proc.info.get("cmdline") or []
    return len(cmd) > 3 and cmd[2] == _WRAPPER and cmd[3] == str(job.job_dir)
