"""Small tasks on a finished job (evaluate on a data set, export): the scaletune command run as a
child process (an argv list, no shell), watched by a thread, so the page never waits on it. At most
one task per job at a time. Each task is a row of the job database (`db.TaskRecord`), so a
restarted service lists what ran before it; a task whose service stopped while it ran is
`interrupted`, with why, never `running` for ever. Each task's output is a log file in the job's
own folder."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import sessionmaker

from scaletune.report import TOKEN_ENV, URL_ENV
from scaletune.serve.jobs.db import Job, TaskRecord
from scaletune.serve.jobs.dispatch.base import job_environment, start_mark
from scaletune.serve.jobs.records import json_safe

log = logging.getLogger(__name__)
LOG_TAIL = 4000  # characters of a failed task's output shown
RUNNING, SUCCEEDED, FAILED, INTERRUPTED = "running", "succeeded", "failed", "interrupted"
# A watching service writes `seen` every HEARTBEAT_S; a running task not seen for STALE_S has lost
# its service (the only sign there is when that service ran on another machine).
HEARTBEAT_S, STALE_S = 30.0, 180.0
STOPPED = "the service stopped while it ran; its result was not recorded: start it again"


class Busy(Exception):
    """The job has a task running (the API answers 409)."""


@dataclass
class Task:
    """A task this service started and watches: its process, and `finish(task, stdout)`, run once
    it exited 0, which returns the task's result (a dict shown with it); an exception there fails
    the task."""

    id: str
    job_id: str
    kind: str
    argv: list[str]
    out: Path
    err: Path
    proc: subprocess.Popen
    finish: Callable[[Task, str], dict[str, Any]] | None = None


def tail(folder: Path, task_id: str) -> str:
    """The end of a task's output (its stderr, then its stdout)."""
    text = ""
    for name in (f"{task_id}.log", f"{task_id}.out"):
        try:
            text += (folder / name).read_text(errors="replace")
        except OSError:
            pass
    return text[-LOG_TAIL:]


def public(row: TaskRecord, folder: Path | None) -> dict[str, Any]:
    """What the API lists: the log's tail only for a task that failed or was interrupted."""
    ended = row.state in (FAILED, INTERRUPTED) and folder is not None
    return {
        "id": row.id,
        "kind": row.kind,
        "what": row.what,
        "owner": row.owner,
        "state": row.state,
        "started": row.started,
        "ended": row.ended,
        "result": row.result,
        "message": row.message,
        "log_tail": tail(folder, row.id) if ended else None,
    }


class Tasks:
    """The tasks of every job, in the job database (newest first per job), and those this service
    watches."""

    def __init__(self, Session: sessionmaker) -> None:  # noqa: N803 - the factory, named as SQLAlchemy names it
        self.Session = Session
        self._lock = threading.Lock()
        self._live: dict[str, Task] = {}
        self.host = socket.gethostname()[:255]
        # This process, as another service on this machine tells it from a later one with its PID.
        self.service = f"{os.getpid()}:{start_mark(os.getpid())}"

    def list(self, job_id: str) -> list[dict[str, Any]]:
        self.sweep()
        with self.Session() as s:
            job_dir = s.scalar(select(Job.job_dir).where(Job.id == job_id))
            folder = Path(job_dir) / "tasks" if job_dir else None
            rows = s.scalars(
                select(TaskRecord).where(TaskRecord.job_id == job_id).order_by(TaskRecord.started.desc(), TaskRecord.id)
            )
            return [public(r, folder) for r in rows]

    def start(
        self,
        files: Any,
        kind: str,
        what: str,
        args: list[str],
        finish: Callable[[Task, str], dict[str, Any]] | None = None,
        owner: str = "",
    ) -> dict[str, Any]:
        """Start `python -m scaletune ARGS` for the job (`files`: its `JobFiles`) in the service's
        working directory (relative paths read as a submitted config's are), with the job's
        environment less its report URL and token (a task reports nothing into the job); record it
        (`owner`: who asked) and return it as listed.

        Raises:
            Busy: the job has a task running.
            OSError: the process cannot be started.
        """
        folder = Path(files.job_dir) / "tasks"
        folder.mkdir(parents=True, exist_ok=True)
        task_id = uuid.uuid4().hex[:10]
        argv = [sys.executable, "-m", "scaletune", *args]
        env = {k: v for k, v in job_environment(files, PYTHONUNBUFFERED="1").items() if k not in (URL_ENV, TOKEN_ENV)}
        self.sweep()  # a task left `running` by a stopped service does not hold the job
        with self._lock, self.Session() as s:
            running = select(TaskRecord.id).where(TaskRecord.job_id == files.job_id, TaskRecord.state == RUNNING)
            if s.scalar(running.limit(1)) is not None:
                raise Busy(f"job {files.job_id} has a task running; wait for it to end")
            out, err = folder / f"{task_id}.out", folder / f"{task_id}.log"
            with open(out, "wb") as o, open(err, "wb") as e:
                proc = subprocess.Popen(argv, stdout=o, stderr=e, stdin=subprocess.DEVNULL, cwd=files.workdir, env=env)
            now = time.time()
            row = TaskRecord(
                id=task_id, job_id=files.job_id, kind=kind, what=what, owner=owner, state=RUNNING, message="",
                started=now, seen=now, host=self.host, service=self.service, pid=proc.pid,
                pid_mark=start_mark(proc.pid),
            )  # fmt: skip
            s.add(row)
            try:
                s.commit()
            except SQLAlchemyError:
                proc.kill()  # not recorded: it must not run where nobody can see it
                raise
            task = self._live[task_id] = Task(task_id, files.job_id, kind, argv, out, err, proc, finish)
            listed = public(row, folder)
        threading.Thread(target=self._watch, args=(task,), name=f"task-{task_id}", daemon=True).start()
        return listed

    def _watch(self, task: Task) -> None:
        while True:
            try:
                code = task.proc.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                self._update(task.id, seen=time.time())
        state, result, message = FAILED, None, f"exit code {code}"
        if code == 0:
            try:
                stdout = task.out.read_text(errors="replace")
                result = json_safe(task.finish(task, stdout)) if task.finish else None
                state, message = SUCCEEDED, ""
            except Exception as exc:  # noqa: BLE001 - the task fails with the reason, the service goes on
                log.exception("task %s (%s) could not be finished", task.id, task.kind)
                message = f"its result could not be read: {exc}"
        self._update(task.id, state=state, result=result, message=message, ended=time.time())
        with self._lock:
            self._live.pop(task.id, None)

    def _update(self, task_id: str, **values: Any) -> None:
        """The running task's record changed; one already ended (interrupted by `stop_all`) stays."""
        try:
            with self.Session() as s:
                s.execute(
                    update(TaskRecord).where(TaskRecord.id == task_id, TaskRecord.state == RUNNING).values(**values)
                )
                s.commit()
        except SQLAlchemyError:  # the database is away: the next heartbeat, or the sweep, says more
            log.exception("task %s: its record could not be written", task_id)

    def stop_all(self) -> None:
        """Record the running tasks `interrupted` and terminate them (the service is stopping)."""
        with self._lock:
            live = list(self._live.values())
        for t in live:
            self._update(t.id, state=INTERRUPTED, message=STOPPED, ended=time.time())
            t.proc.terminate()

    def sweep(self) -> int:
        """Record `interrupted` every running task whose service is gone: one on this machine whose
        process no longer runs (a PID taken by a later process is told by its start mark), or any
        not seen for STALE_S; the task's own process, if it still runs here, is ended (its result
        would be recorded by nobody). Returns how many."""
        now = time.time()
        with self.Session() as s:
            gone = [r for r in s.scalars(select(TaskRecord).where(TaskRecord.state == RUNNING)) if self._gone(r, now)]
            for r in gone:
                s.execute(
                    update(TaskRecord)
                    .where(TaskRecord.id == r.id, TaskRecord.state == RUNNING)
                    .values(state=INTERRUPTED, message=STOPPED, ended=now)
                )
            s.commit()
        for r in gone:
            if r.host == self.host and r.pid and r.pid_mark and start_mark(r.pid) == r.pid_mark:
                try:
                    os.kill(r.pid, signal.SIGTERM)
                except OSError:
                    pass
        return len(gone)

    def _gone(self, row: TaskRecord, now: float) -> bool:
        if now - row.seen > STALE_S:
            return True
        if row.host != self.host or row.service == self.service:
            return False
        pid, _, mark = row.service.partition(":")
        return not pid.isdigit() or start_mark(int(pid)) != mark


def last_json(stdout: str) -> dict[str, Any]:
    """The last line of `stdout` that is a JSON object (what `--json` prints).

    Raises:
        ValueError: there is none.
    """
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise ValueError("the command printed no JSON result")


def stamp() -> str:
    """A UTC time as the eval/ files name it (`lm_eval-20260101-120000.json`)."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def fresh(path: Path) -> Path:
    """`path`, or `path` with -2, -3 ... before its suffix where it exists (two in one second)."""
    n, out = 1, path
    while out.exists() or os.path.lexists(out):
        n += 1
        out = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return out
