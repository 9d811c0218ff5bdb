"""Small tasks on a finished job (evaluate on a data set, export): the scaletune command run as a
child process (an argv list, no shell), watched by a thread, so the page never waits on it. At most
one task per job at a time. The records are kept in memory (a restarted service lists none); each
task's output is a log file in the job's own folder."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scaletune.report import TOKEN_ENV, URL_ENV
from scaletune.serve.jobs.dispatch.base import job_environment

log = logging.getLogger(__name__)
LOG_TAIL = 4000  # characters of a failed task's output shown


class Busy(Exception):
    """The job has a task running (the API answers 409)."""


@dataclass
class Task:
    """One child process and what it is for. `finish(task, stdout)` runs once it exited 0 and
    returns the task's result (a dict shown with it); an exception there fails the task."""

    id: str
    job_id: str
    kind: str
    what: str
    argv: list[str]
    out: Path
    err: Path
    finish: Callable[[Task, str], dict[str, Any]] | None = None
    state: str = "running"
    started: float = field(default_factory=time.time)
    ended: float | None = None
    result: dict[str, Any] | None = None
    message: str = ""
    proc: subprocess.Popen | None = None

    def tail(self) -> str:
        text = ""
        for p in (self.err, self.out):
            try:
                text += p.read_text(errors="replace")
            except OSError:
                pass
        return text[-LOG_TAIL:]

    def public(self) -> dict[str, Any]:
        """What the API lists: the log's tail only for a failed task."""
        return {
            "id": self.id,
            "kind": self.kind,
            "what": self.what,
            "state": self.state,
            "started": self.started,
            "ended": self.ended,
            "result": self.result,
            "message": self.message,
            "log_tail": self.tail() if self.state == "failed" else None,
        }


class Tasks:
    """The tasks of every job of one service (newest first per job)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_job: dict[str, list[Task]] = {}

    def list(self, job_id: str) -> list[dict[str, Any]]:
        with self._lock:
            return [t.public() for t in reversed(self._by_job.get(job_id, []))]

    def start(
        self,
        files: Any,
        kind: str,
        what: str,
        args: list[str],
        finish: Callable[[Task, str], dict[str, Any]] | None = None,
    ) -> Task:
        """Start `python -m scaletune ARGS` for the job (`files`: its `JobFiles`) in the service's
        working directory (relative paths read as a submitted config's are), with the job's
        environment less its report URL and token (a task reports nothing into the job).

        Raises:
            Busy: the job has a task running.
            OSError: the process cannot be started.
        """
        folder = Path(files.job_dir) / "tasks"
        folder.mkdir(parents=True, exist_ok=True)
        task_id = uuid.uuid4().hex[:10]
        argv = [sys.executable, "-m", "scaletune", *args]
        task = Task(
            task_id, files.job_id, kind, what, argv, folder / f"{task_id}.out", folder / f"{task_id}.log", finish
        )
        env = {k: v for k, v in job_environment(files, PYTHONUNBUFFERED="1").items() if k not in (URL_ENV, TOKEN_ENV)}
        with self._lock:
            if any(t.state == "running" for t in self._by_job.get(files.job_id, [])):
                raise Busy(f"job {files.job_id} has a task running; wait for it to end")
            with open(task.out, "wb") as out, open(task.err, "wb") as err:
                task.proc = subprocess.Popen(
                    argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=files.workdir, env=env
                )
            self._by_job.setdefault(files.job_id, []).append(task)
        threading.Thread(target=self._watch, args=(task,), name=f"task-{task_id}", daemon=True).start()
        return task

    def _watch(self, task: Task) -> None:
        assert task.proc is not None
        code = task.proc.wait()
        state, result, message = "failed", None, f"exit code {code}"
        if code == 0:
            try:
                stdout = task.out.read_text(errors="replace")
                result = task.finish(task, stdout) if task.finish else None
                state, message = "succeeded", ""
            except Exception as exc:  # noqa: BLE001 - the task fails with the reason, the service goes on
                log.exception("task %s (%s) could not be finished", task.id, task.kind)
                message = f"its result could not be read: {exc}"
        with self._lock:
            task.state, task.result, task.message, task.ended = state, result, message, time.time()

    def stop_all(self) -> None:
        """Terminate the running tasks (the service is stopping)."""
        with self._lock:
            running = [t for ts in self._by_job.values() for t in ts if t.state == "running" and t.proc]
        for t in running:
            assert t.proc is not None
            t.proc.terminate()


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
