"""The run directory (`output_dir`): whether a run may start in it, the lock that keeps a second run
out, and its preparation, in which nothing of a previous run is lost.

* Only a folder that scaletune made a run directory (its marker file, or a readable scaletune
  `config.yaml` from before the marker existed) is ever cleared by `overwrite: true`.
* One run at a time: rank 0 holds a `filelock.FileLock` on `.scaletune.lock` for the whole run
  and writes who it is (PID, host, start time) beside it, in `.scaletune.lock.holder`; a second
  run exits 2 naming that holder. The kernel releases the lock (an `flock`) when its holder dies,
  so a holder file left by a crash names a stale holder, taken over. (`flock` is reliable on local
  disks; on NFS it depends on the server: docs/security.md.)
* `overwrite: true` moves the previous run's outputs into `.replaced/` and deletes them only once
  the new run has passed every check (data built, model loaded, checkpoint resumed:
  :meth:`RunDirectory.commit`); a failure before that puts them back (:meth:`RunDirectory.rollback`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from scaletune import version_string
from scaletune.config import dump_config, read_config
from scaletune.env import print0
from scaletune.errors import UserError
from scaletune.resolve import Problem, RunSpec

MARKER = ".scaletune-run"
LOCK = ".scaletune.lock"
#: Beside the lock: who holds it, as JSON `{"pid", "host", "started"}`; removed at a clean release.
HOLDER = ".scaletune.lock.holder"
REPLACED = ".replaced"
#: Files whose presence makes a folder hold a run.
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "final")
#: What a run writes, moved aside when `overwrite: true` replaces it.
RUN_OUTPUTS = (
    *RUN_MARKERS,
    "metrics.jsonl.prev",
    "loss.png",
    "tensorboard",
    "checkpoints",
    "plan.json",
    "memory.json",
    "samples.md",
    "samples.jsonl",
    "wandb",
    "mlflow-run-id",  # trainer.tracking.MLFLOW_ID (not imported: the trainer package imports torch)
)


def is_scaletune_run(run_dir: Path) -> bool:
    """The folder is a scaletune run directory: its marker, or a valid scaletune config.yaml."""
    if (run_dir / MARKER).is_file():
        return True
    saved = run_dir / "config.yaml"
    return saved.is_file() and not read_config(saved).problems


def _read_holder(run_dir: Path) -> dict:
    """The holder file's record ({} when absent or unreadable)."""
    try:
        data = json.loads((run_dir / HOLDER).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def describe_holder(holder: dict) -> str:
    """`PID 123 on host (since 2024-05-01T12:00:00)`, `?` for what the record lacks."""
    return f"PID {holder.get('pid', '?')} on {holder.get('host', '?')} (since {holder.get('started', '?')})"


def lock_holder(run_dir: Path) -> dict | None:
    """Who holds the run directory's lock now (pid, host, started; {} when the holder has not
    written itself down yet), or None when nobody does."""
    from filelock import FileLock, Timeout

    path = run_dir / LOCK
    if not path.is_file():
        return None
    probe = FileLock(str(path))
    try:
        probe.acquire(timeout=0)
    except Timeout:
        return _read_holder(run_dir)
    probe.release()
    return None


def run_dir_problems(spec: RunSpec) -> list[Problem]:
    """Whether a run may start in `output_dir`: a writable folder (or one that can be made), not in
    use by another run, and not holding another run unless `overwrite` or `training.resume` says
    what to do with it; `overwrite` never clears a folder scaletune did not make."""
    run_dir, cfg = spec.run_dir, spec.config
    key = "output_dir"
    ancestor = run_dir
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor != run_dir and not ancestor.is_dir():
        return [Problem("run directory", key, f"output_dir {run_dir} is below {ancestor}, which is a file")]
    if not run_dir.exists():
        if not os.access(ancestor, os.W_OK | os.X_OK):
            return [
                Problem("run directory", key, f"output_dir {run_dir} cannot be created: {ancestor} is not writable")
            ]
        return []
    if not run_dir.is_dir():
        return [Problem("run directory", key, f"output_dir {run_dir} exists and is not a directory")]
    if not os.access(run_dir, os.W_OK | os.X_OK):
        return [Problem("run directory", key, f"output_dir {run_dir} is not writable")]
    holder = lock_holder(run_dir)
    if holder is not None:
        who = describe_holder(holder)
        return [
            Problem(
                "run directory",
                key,
                f"output_dir {run_dir} is in use by another run: {who}",
                "wait for it, stop it, or choose another output_dir",
            )
        ]
    held = [m for m in RUN_MARKERS if (run_dir / m).exists()]
    if cfg.overwrite and cfg.training.resume is None and any(run_dir.iterdir()) and not is_scaletune_run(run_dir):
        return [
            Problem(
                "run directory",
                "overwrite",
                f"output_dir {run_dir} holds files scaletune did not write; overwrite: true never clears such a folder",
                "choose another output_dir",
            )
        ]
    if held and not cfg.overwrite and cfg.training.resume is None:
        what = "a finished run (final/ present)" if "final" in held else f"a previous run ({', '.join(held)})"
        fix = "choose another output_dir, set overwrite: true to replace it, or training.resume: auto to continue it"
        return [Problem("run directory", key, f"output_dir {run_dir} holds {what}", fix)]
    return []


class RunDirectory:
    """Rank 0's handle on the run directory for the length of a run (see the module docstring)."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.path = spec.run_dir
        self._lock: Any = None  # a filelock.FileLock while held
        self._replaced: Path | None = None

    def acquire(self) -> None:
        """Create the folder and take the lock.

        Raises:
            UserError: another live process holds the lock (its PID, host and start time named).
        """
        from filelock import FileLock, Timeout

        self.path.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.path / LOCK))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            holder = _read_holder(self.path)
            who = describe_holder(holder) if holder else "unknown holder"
            raise UserError(
                f"output_dir {self.path} is in use by another run: {who}", title="cannot start training"
            ) from None
        stale = _read_holder(self.path)
        if stale:  # a holder that never released: the lock was free, so that process is gone
            print0(
                f"[scaletune] took over a stale lock of {self.path} ({describe_holder(stale)}: that process is gone)"
            )
        started = datetime.datetime.now().isoformat(timespec="seconds")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
        tmp = self.path / f"{HOLDER}.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path / HOLDER)  # whole or absent for a reader, never half written
        self._lock = lock

    def prepare(self) -> None:
        """Move a replaced run's outputs aside (`overwrite`), keep an earlier curve as
        `metrics.jsonl.prev` (a fresh start under `resume: auto`), write the marker and config.yaml."""
        cfg = self.spec.config
        resuming = self.spec.resume_from is not None
        metrics = self.path / "metrics.jsonl"
        if not resuming and cfg.training.resume == "auto" and metrics.exists():
            os.replace(metrics, self.path / "metrics.jsonl.prev")
        present = [m for m in RUN_OUTPUTS if (self.path / m).exists()]
        if cfg.overwrite and cfg.training.resume is None and present:
            self._replaced = self.path / REPLACED
            if self._replaced.exists():
                shutil.rmtree(self._replaced)  # a previous replacement that was never committed or rolled back
            self._replaced.mkdir()
            for m in present:
                os.replace(self.path / m, self._replaced / m)
        (self.path / MARKER).write_text(json.dumps({"format": 1}) + "\n")
        tmp = self.path / ".config.yaml.tmp"
        # Which scaletune wrote it, as a comment: the file still loads as a config (resume, `train`).
        tmp.write_text(f"# written by scaletune {version_string()}\n{dump_config(cfg)}")
        os.replace(tmp, self.path / "config.yaml")

    def commit(self) -> None:
        """The new run passed every check: delete the replaced run for good."""
        if self._replaced is not None:
            shutil.rmtree(self._replaced, ignore_errors=True)
            self._replaced = None

    def rollback(self) -> None:
        """The new run failed before it passed its checks: put the replaced run back."""
        if self._replaced is None:
            return
        for item in self._replaced.iterdir():
            target = self.path / item.name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
            os.replace(item, target)
        self._replaced.rmdir()
        self._replaced = None

    def release(self) -> None:
        if self._lock is not None:
            with contextlib.suppress(OSError):
                (self.path / HOLDER).unlink(missing_ok=True)  # no holder: released cleanly, not stale
            self._lock.release()
            self._lock = None

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Around the last checks of a run (model wrapped, checkpoint resumed): commit when they
        pass, roll a replaced run back when they fail."""
        try:
            yield
        except BaseException:
            self.rollback()
            raise
        self.commit()


class _OtherRank(RunDirectory):
    """Ranks other than 0 leave the run directory to rank 0."""

    def __init__(self, spec: RunSpec) -> None:
        super().__init__(spec)

    def acquire(self) -> None: ...
    def prepare(self) -> None: ...


@contextlib.contextmanager
def opened(spec: RunSpec) -> Iterator[RunDirectory]:
    """The run directory for a run, locked and prepared on rank 0 (a no-op on other ranks), the lock
    released at exit.

    Raises:
        UserError: another run holds the lock.
    """
    run_dir = RunDirectory(spec) if spec.env.is_main else _OtherRank(spec)
    run_dir.acquire()
    try:
        run_dir.prepare()
        yield run_dir
    finally:
        run_dir.release()
