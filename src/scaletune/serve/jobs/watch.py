"""The watcher: a thread that, every `poll_s`, starts queued jobs within each target's limit, polls
the active ones at their target, reads what their runs append to their files (`metrics.jsonl`,
the log's event lines) and settles how each ended; and, when the service starts, the re-attach to
the jobs a previous service left running. How far each file was read is kept on the job record
(`Job.offsets`), so a restarted service, and a resumed run appending to the same log, read on
where the last read stopped; the checkpoints offered follow the run directory (`sync_checkpoints`).

A dispatcher marked `slow` (SLURM: sbatch/squeue commands; Modal: deploy and calls over the
network) is called in a worker thread, never under the service's lock nor in a tick or a request:
one slow sbatch or Modal answer would otherwise hold every other job's reports and reads. A worker
takes the lock only to store what the target answered; one job has at most one call in flight."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from scaletune.errors import UserError
from scaletune.report import PREFIX, json_lines, parse_event_line
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs.db import Job, now
from scaletune.serve.jobs.dispatch import Dispatcher, JobFiles, Status
from scaletune.serve.jobs.dispatch.base import LOG_FILE, NotAccepted, SubmitUnknown
from scaletune.serve.jobs.records import add_metric, apply_report, checkpoint_events, event, set_state

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"  # in the run directory; the other files are in the job folder
# Lines of a run's log that are scaletune's own (shown as log events; the rest via /logs).
_OWN_LINES = (PREFIX, "error:", "Traceback", "scaletune:")
LOST_RECHECK_S = 600  # how long after a job was settled lost its target is still asked about it
LOST_RECHECK_EVERY_S = 2.0  # and how often
SUBMIT_ERRORS = (UserError, OSError, ImportError, RuntimeError)  # a target's refusal: the job fails
RECONCILE_EVERY_S = 2.0  # how often a job whose submit's outcome is not known is asked about


def ask(call: Callable[[JobFiles], str], files: JobFiles) -> tuple[str | None, BaseException | None]:
    """(the target id, None) of a dispatcher's submit or reconcile, or (None, why not): the
    target's refusal, or `SubmitUnknown`."""
    try:
        return call(files), None
    except (SubmitUnknown, *SUBMIT_ERRORS) as exc:
        return None, exc


def sync_checkpoints(s: Session, job: Job) -> None:
    """The job's offered checkpoints made to match its run directory: `keep_last` removes old
    ones while the run goes on, so one whose folder is gone gets a `removed` event (the page drops
    it), and one removed and saved again (a resume) is offered again."""
    if job.target == "modal":
        return  # its checkpoints are on the Modal volume, not in a folder this service can see
    root = (Path(job.run_dir) / "checkpoints").resolve()
    for path, data in checkpoint_events(s, job).items():
        p = Path(path).resolve()
        # Only the run's own checkpoints/step-N: a reported path elsewhere is not looked at.
        there = p.parent == root and p.is_dir()
        if there == bool(data.get("removed")):
            event(s, job, "checkpoint", {"step": data.get("step"), "path": path, "removed": not there})


def claim(s: Session, job: Job) -> bool:
    """Whether this service won the queued `job`: a conditional UPDATE from `queued` to `starting`,
    committed at once. Two services on one database both read the job queued; the database lets
    one UPDATE match (Postgres re-reads the row after the other's commit, SQLite writes one at a
    time), so exactly one starts it. The loser's copy is expired (the next tick reads it again)."""
    won = s.execute(
        update(Job)
        .where(Job.id == job.id, Job.state == S.QUEUED, Job.target_id.is_(None))
        .values(state=S.STARTING)
        .execution_options(synchronize_session=False)
    ).rowcount
    s.commit()
    if won != 1:
        s.expire(job)
        return False
    return True


class Watcher:
    """Args:
    Session: the job database's session factory.
    lock: held while the watcher writes (SQLite takes one writer at a time); the service's too.
    dispatchers: target name -> dispatcher.
    files: a job as its dispatcher sees it (with the report URL and token in its environment).
    issue_token: a new report token for a job about to start (its hash goes on the record).
    poll_s: seconds between ticks.
    ready: whether a queued job may start here: the service has the secrets it was submitted with
        (`vault.Vault.missing`); one that is not waits, never started without them.
    """

    def __init__(
        self,
        Session: sessionmaker,  # noqa: N803 - the factory, named as SQLAlchemy names it
        lock: threading.RLock,
        dispatchers: dict[str, Dispatcher],
        files: Callable[[Job], JobFiles],
        issue_token: Callable[[Job], str],
        poll_s: float = 0.5,
        ready: Callable[[Job], bool] = lambda job: True,
    ) -> None:
        self.Session, self.lock, self.dispatchers = Session, lock, dispatchers
        self.files, self.issue_token, self.poll_s, self.ready = files, issue_token, poll_s, ready
        self._stop = threading.Event()
        self._rechecked: dict[str, float] = {}  # job id -> when a lost job's target was last asked
        self._reconciled: dict[str, float] = {}  # job id -> when a `submit unknown` job's target was asked
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="scaletune-serve-target")
        self._busy: set[str] = set()  # jobs with a call to a slow target in flight
        self._busy_lock = threading.Lock()

    # -- the thread ------------------------------------------------------------------------
    def start(self) -> None:
        """Re-attach to what a previous service left running, then tick every `poll_s`."""
        self.reattach_all()
        self.run()

    def run(self) -> None:
        """Tick every `poll_s` in a thread (what `start` does after the re-attach)."""
        self._thread = threading.Thread(target=self._loop, name="scaletune-serve-watch", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
        # Not waited for: an sbatch may take minutes; its answer is learned again at the next start.
        self._pool.shutdown(wait=False, cancel_futures=True)

    def later(self, fn: Callable[[], object], job_id: str | None = None) -> bool:
        """Run `fn` (a call to a slow target) in a worker thread; with `job_id`, not while another
        call for that job is in flight (then False: the next tick asks again)."""

        def run() -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - a worker outlives one bad call
                if not self._stop.is_set():  # after shutdown the database may be gone: nothing to tell
                    log.warning(
                        "watcher worker: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG)
                    )
            finally:
                if job_id is not None:
                    with self._busy_lock:
                        self._busy.discard(job_id)

        if job_id is not None:
            with self._busy_lock:
                if job_id in self._busy:
                    return False
                self._busy.add(job_id)
        try:
            self._pool.submit(run)
        except RuntimeError:  # shut down
            with self._busy_lock:
                self._busy.discard(job_id or "")
            return False
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.tick()
            except Exception as exc:  # noqa: BLE001 - the watcher outlives one bad poll
                log.warning("watcher: %s: %s", type(exc).__name__, exc, exc_info=log.isEnabledFor(logging.DEBUG))

    def tick(self) -> None:
        """Start what may start, then poll and read every active job; one transaction."""
        with self.lock, self.Session() as s:
            self.start_queued(s)
            self.poll_active(s)
            self.reconcile_unknown(s)
            s.commit()

    # -- one tick --------------------------------------------------------------------------
    def start_queued(self, s: Session) -> None:
        # Every live process takes a slot: an active job's, a cancelled one's not yet seen ended,
        # and any the dispatcher itself still runs whatever its record says.
        running: dict[str, int] = {}
        ending = (Job.state == S.CANCELLED) & Job.exit_code.is_(None) & Job.target_id.is_not(None)
        for job in s.scalars(select(Job).where(Job.state.in_(list(S.ACTIVE)) | ending)):
            running[job.target] = running.get(job.target, 0) + 1
        for name, d in self.dispatchers.items():
            running[name] = max(running.get(name, 0), d.running())
        for job in s.scalars(select(Job).where(Job.state == S.QUEUED).order_by(Job.created)):
            if job.target_id:  # submitted, waiting in the target's own queue
                continue
            d = self.dispatchers[job.target]
            if d.max_concurrent is not None and running.get(job.target, 0) >= d.max_concurrent:
                continue
            if not self.ready(job):  # its secrets are with another service, or gone (`vault.recover` tells)
                continue
            if not claim(s, job):
                continue  # another service on this database started it
            self.issue_token(job)
            # A resumed job's log is appended to (the dispatcher opens it O_APPEND; a SLURM run
            # writes a new slurm-ID.out): read on after what is stored, never from the start again.
            # metrics.jsonl is read again (a resume truncates it; its lines are stored once a step).
            job.offsets = {k: v for k, v in (job.offsets or {}).items() if k != METRICS_FILE}
            # Recorded before the start: a service that dies before it learns the target id
            # finds the job `starting` and adopts its process (reattach_all), never starts it twice.
            set_state(s, job, S.STARTING, phase=None)
            s.commit()
            running[job.target] = running.get(job.target, 0) + 1
            files = self.files(job)
            if d.slow:
                self.later(lambda job_id=job.id, d=d, files=files: self._submit(job_id, d, files), job.id)
                continue
            self.submitted(s, job, *ask(d.submit, files))
            s.commit()

    def _submit(self, job_id: str, d: Dispatcher, files: JobFiles) -> None:
        """A slow target's submit, in a worker: the call off the lock, its answer stored under it."""
        target_id, error = ask(d.submit, files)
        with self.lock, self.Session() as s:
            job = s.get(Job, job_id)
            cancelled = job is not None and job.state == S.CANCELLED
            if job is not None:
                self.submitted(s, job, target_id, error)
                s.commit()
        if cancelled and target_id:  # cancelled while sbatch / deploy ran: it must not run on
            d.cancel(target_id, files)

    def submitted(self, s: Session, job: Job, target_id: str | None, error: BaseException | None) -> None:
        """What a submit answered: the target id, or the target's refusal (the job failed, unless it
        was cancelled meanwhile), or no outcome known (`submit unknown`: asked again)."""
        if isinstance(error, SubmitUnknown):
            self.unknown(s, job, error)
            return
        if error is not None:
            if job.state == S.STARTING:
                set_state(s, job, S.FAILED, reason=S.SUBMIT, message=str(error)[:2000])
            return
        job.target_id = target_id
        if job.state == S.STARTING and job.target != "local":
            set_state(s, job, S.QUEUED, phase=None)

    def unknown(self, s: Session, job: Job, error: SubmitUnknown) -> None:
        """Whether the target took the job is not known: it stays `starting` (or stopping or
        cancelled, as the user left it) with reason `submit unknown` and why, until `reconcile_unknown`
        learns it; never submitted again meanwhile."""
        message = str(error)[:2000]
        if job.state == S.STARTING and job.reason != S.SUBMIT_UNKNOWN:
            set_state(s, job, S.STARTING, reason=S.SUBMIT_UNKNOWN, message=message)
            event(s, job, "log", {"line": f"[scaletune serve] {message}"})
        elif job.state in (S.STARTING, S.STOPPING, S.CANCELLED):
            job.reason, job.message = S.SUBMIT_UNKNOWN, message

    def reconcile_unknown(self, s: Session) -> None:
        """Each job whose submit's outcome is not known, its target asked again (`reconcile`) in a
        worker, every RECONCILE_EVERY_S."""
        waiting = select(Job).where(
            Job.reason == S.SUBMIT_UNKNOWN,
            Job.target_id.is_(None),
            Job.state.in_([S.STARTING, S.STOPPING, S.CANCELLED]),
        )
        jobs = s.scalars(waiting).all()
        self._reconciled = {j.id: self._reconciled.get(j.id, 0.0) for j in jobs}
        for job in jobs:
            if time.monotonic() < self._reconciled[job.id] + RECONCILE_EVERY_S:
                continue
            self._reconciled[job.id] = time.monotonic()
            d, files = self.dispatchers[job.target], self.files(job)
            self.later(lambda i=job.id, d=d, f=files: self._reconcile(i, d, f), job.id)

    def _reconcile(self, job_id: str, d: Dispatcher, files: JobFiles) -> None:
        """What the target says of a submission whose outcome was not known, stored under the lock;
        a call it took for a job stopped or cancelled meanwhile is cancelled."""
        target_id, error = ask(d.reconcile, files)
        with self.lock, self.Session() as s:
            job = s.get(Job, job_id)
            if job is None or job.target_id is not None or job.reason != S.SUBMIT_UNKNOWN:
                return
            ended = job.state in (S.STOPPING, S.CANCELLED)
            if isinstance(error, SubmitUnknown):
                job.message = str(error)[:2000]
            elif error is not None:
                reason = S.SUBMIT if isinstance(error, NotAccepted) else S.LOST
                event(s, job, "log", {"line": f"[scaletune serve] {error}"})
                if job.state == S.STOPPING:
                    set_state(s, job, S.STOPPED, reason=None, message=None)
                elif ended:
                    job.reason = None
                else:
                    set_state(s, job, S.FAILED, reason=reason, message=str(error)[:2000])
            else:
                job.target_id, job.reason, job.message = target_id, None, None
                line = f"[scaletune serve] {job.target} took the submission: {target_id}, adopted"
                event(s, job, "log", {"line": line})
                if not ended:
                    set_state(s, job, S.QUEUED, phase=None)
            s.commit()
        if target_id and ended:  # stopped or cancelled before the call was known: it must not run on
            d.cancel(target_id, files)

    def poll_active(self, s: Session) -> None:
        jobs = s.scalars(
            select(Job).where(Job.state.in_([*S.ACTIVE, S.QUEUED, S.CANCELLED]), Job.target_id.is_not(None))
        ).all()
        self.recheck_lost(s)
        for job in jobs:
            if job.state == S.CANCELLED and job.exit_code is not None:
                continue
            d = self.dispatchers[job.target]
            if d.slow:  # asked in a worker; the files a SLURM job shares are read here meanwhile
                target_id, files = job.target_id, self.files(job)
                self.later(lambda i=job.id, d=d, t=target_id, f=files: self._poll(i, d, t, f), job.id)
                self.read_outputs(s, job)
                continue
            status = d.poll(job.target_id, self.files(job))
            self.read_outputs(s, job)
            self.apply(s, job, status)

    def _poll(self, job_id: str, d: Dispatcher, target_id: str, files: JobFiles, lost: bool = False) -> None:
        """A slow target's poll, in a worker: asked off the lock (with the log tail a failure's
        reason is read from), stored under it if the job is still that target's (`lost`: a job
        settled lost, `recheck_lost`'s)."""
        status = d.poll(target_id, files)
        tail = d.logs(files, limit=4000) if status.state in ("exited", "lost") else None
        with self.lock, self.Session() as s:
            job = s.get(Job, job_id)
            if job is None or job.target_id != target_id:
                return
            if lost and (job.state, job.reason) == (S.FAILED, S.LOST):
                self.relive(s, job, status, tail)
            elif not lost and job.state in (*S.ACTIVE, S.QUEUED, S.CANCELLED):
                self.read_outputs(s, job)
                self.apply(s, job, status, tail)
            s.commit()

    def apply(self, s: Session, job: Job, status: Status, tail: str | None = None) -> None:
        """An active (or cancelled, not yet ended) job's record after its target answered `status`."""
        if job.state == S.CANCELLED:
            if status.state in ("exited", "lost") and job.exit_code is None:
                job.exit_code = status.exit_code if status.exit_code is not None else -1
            return
        if status.state in ("queued", "ending"):
            return
        if status.state == "running":
            if job.state == S.QUEUED:
                set_state(s, job, S.RUNNING, phase=job.phase)
            return
        self.settle(s, job, status.exit_code, status.final, tail)

    def recheck_lost(self, s: Session) -> None:
        """Jobs settled `lost` in the last LOST_RECHECK_S (e.g. by a restart that could not see
        their process) polled again: one whose process runs is running again, one that left an
        exit code is settled by it. A lost verdict is the absence of news, so news overrules it."""
        since = now() - dt.timedelta(seconds=LOST_RECHECK_S)
        lost = select(Job).where(
            Job.state == S.FAILED,
            Job.reason == S.LOST,
            Job.exit_code.is_(None),
            Job.target_id.is_not(None),
            Job.updated >= since,
        )
        jobs = s.scalars(lost).all()
        self._rechecked = {j.id: self._rechecked.get(j.id, 0.0) for j in jobs}  # only those still lost
        for job in jobs:
            # Not every tick: a SLURM or Modal poll asks the target (a command, the network).
            if time.monotonic() < self._rechecked.get(job.id, 0) + LOST_RECHECK_EVERY_S:
                continue
            self._rechecked[job.id] = time.monotonic()
            d = self.dispatchers[job.target]
            if d.slow:
                target_id, files = job.target_id, self.files(job)
                self.later(lambda i=job.id, d=d, t=target_id, f=files: self._poll(i, d, t, f, lost=True), job.id)
                continue
            self.relive(s, job, d.poll(job.target_id, self.files(job)))

    def relive(self, s: Session, job: Job, status: Status, tail: str | None = None) -> None:
        """A job settled lost whose target now answers: running again, or settled by its exit code."""
        if status.state == "running":
            event(s, job, "log", {"line": f"[scaletune serve] {job.target} {job.target_id} runs: not lost"})
            set_state(s, job, S.RUNNING, reason=None, message=None)
        elif status.state == "exited" and status.exit_code is not None:
            event(s, job, "log", {"line": f"[scaletune serve] {job.target} {job.target_id} exited {status.exit_code}"})
            job.reason = job.message = None
            self.read_outputs(s, job)
            self.settle(s, job, status.exit_code, status.final, tail)

    def read_outputs(self, s: Session, job: Job) -> None:
        """What the run wrote to its files (the fallback of its posts; shared file system: local,
        SLURM): metrics lines, and the log's event lines (`report.parse_event_line`)."""
        for record in json_lines(self.read_new(job, METRICS_FILE)):
            add_metric(s, job, record)
        for name in (LOG_FILE, *(p.name for p in sorted(Path(job.job_dir).glob("slurm-*.out")))):
            for line in self.read_new(job, name).splitlines():
                text = line.split("]: ", 1)[-1] if line.startswith("[rank") else line
                if text.startswith(_OWN_LINES):
                    event(s, job, "log", {"line": line})
                parsed = parse_event_line(line)
                if parsed is not None:
                    apply_report(s, job, *parsed)
        sync_checkpoints(s, job)

    def read_new(self, job: Job, name: str) -> str:
        """What was appended to a file of the job since the last read (whole lines only); the new
        offset goes on the record, committed with what the lines were turned into."""
        path = (Path(job.run_dir) if name == METRICS_FILE else Path(job.job_dir)) / name
        offsets = dict(job.offsets or {})
        pos = offsets.get(name, 0)
        try:
            with open(path, "rb") as f:
                if f.seek(0, 2) < pos:  # replaced by a shorter file: read it from the start
                    pos = 0
                f.seek(pos)
                chunk = f.read()
        except OSError:
            return ""
        end = chunk.rfind(b"\n") + 1
        if pos + end != offsets.get(name, 0):
            offsets[name] = pos + end
            job.offsets = offsets  # a new dict: a JSON column is saved on assignment only
        return chunk[:end].decode(errors="replace")

    def settle(
        self, s: Session, job: Job, code: int | None, final: bool | None = None, tail: str | None = None
    ) -> None:
        """The final state of a job whose process / SLURM job / Modal call ended with `code`;
        `final`: whether the run wrote `final/` where its target says so (a Modal call's result:
        its run directory is on the volume), else looked for in the run directory; `tail`: the
        end of its log, when a worker read it already (a slow target's logs are not read here)."""
        job.exit_code = code
        if job.state == S.CANCELLED:
            return
        if final is None:
            final = (Path(job.run_dir) / "final").is_dir()
        if code == 0 and final:
            set_state(s, job, S.SUCCEEDED, phase=None)
        elif job.stop_requested and (code == 0 or job.target == "modal"):  # Modal's stop is a cancel
            set_state(s, job, S.STOPPED, phase=None)
        else:
            if tail is None:
                tail = self.dispatchers[job.target].logs(self.files(job), limit=4000)
            reason = S.failure_reason(code, tail)
            lines = [ln for ln in tail.splitlines() if ln.strip()]
            set_state(s, job, S.FAILED, reason=reason, message=lines[-1][:500] if lines else None, phase=None)

    def reattach_all(self) -> None:
        """After a restart: every job the previous service left active is looked up at its target;
        one no longer known there is settled from what it left (exit code file, `final/`) or `lost`."""
        with self.lock, self.Session() as s:
            for job in s.scalars(select(Job).where(Job.state == S.STARTING, Job.target_id.is_(None))):
                self.adopt(s, job)
            active = select(Job).where(Job.state.in_([*S.ACTIVE, S.QUEUED]), Job.target_id.is_not(None))
            for job in s.scalars(active):
                status = self.dispatchers[job.target].poll(job.target_id, self.files(job))
                line = f"[scaletune serve] re-attached: {job.target} {job.target_id} {status.state}"
                event(s, job, "log", {"line": line})
                if status.state == "exited":
                    self.read_outputs(s, job)
                    self.settle(s, job, status.exit_code, status.final)
                elif status.state == "lost":
                    set_state(s, job, S.FAILED, reason=S.LOST, message=f"{job.target} {job.target_id} is gone")
            s.commit()

    def adopt(self, s: Session, job: Job) -> None:
        """A job the last service was starting when it stopped: its process (or SLURM job) if the
        target has one, else it never started and is queued again; failed when it cannot tell."""
        try:
            target_id = self.dispatchers[job.target].adopt(self.files(job))
        except SubmitUnknown as exc:
            self.unknown(s, job, exc)
            return
        except UserError as exc:
            set_state(s, job, S.FAILED, reason=S.LOST, message=str(exc)[:2000])
            event(s, job, "log", {"line": f"[scaletune serve] {exc}"})
            return
        if target_id is None:
            set_state(s, job, S.QUEUED, phase=None)
            event(s, job, "log", {"line": "[scaletune serve] the last service stopped before starting it: queued"})
            return
        job.target_id = target_id
        event(
            s, job, "log", {"line": f"[scaletune serve] adopted {job.target} {target_id}, started by the last service"}
        )
