"""The job service: the job records and what the API does with them (submit, stop, cancel,
resume, clone, the run's reports, metrics and events). The watcher (`watch.Watcher`) runs the
jobs; record updates are `records`'. One instance per `scaletune serve`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import threading
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from scaletune.errors import UserError
from scaletune.report import TOKEN_ENV, URL_ENV
from scaletune.serve.edge import policy as P
from scaletune.serve.edge.auth import digest
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs import submission
from scaletune.serve.jobs.checking import in_child, remove_job_folder, submit_checked
from scaletune.serve.jobs.db import Event, Job, Metric, Setting, open_db, sqlite_file
from scaletune.serve.jobs.dispatch import Dispatcher, JobFiles, make_dispatchers
from scaletune.serve.jobs.records import apply_report, set_state
from scaletune.serve.jobs.vault import Vault, needs_secrets, recover
from scaletune.serve.jobs.watch import Watcher

TARGETS = ("local", "slurm", "modal")
POLICY_SETTING = "policy"  # the admin's changes to the policy (PUT /api/admin/policy), as JSON
log = logging.getLogger(__name__)


class JobNotFound(LookupError):
    """No job has this id (the API answers 404)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"no job {job_id}")
        self.job_id = job_id


class JobService:
    """Args:
    db_url: SQLAlchemy URL of the job records.
    home: folder of the job folders (config, log, exit code, stop request).
    base_url: how a local job reaches this service (its report endpoint), e.g. http://127.0.0.1:8000.
    public_url: how a job on another machine reaches it (`--public-url`, e.g. https://jobs.example.com);
        SLURM jobs use `base_url` without it, Modal jobs are refused (loopback is not reachable there).
    max_concurrent: local jobs running at once.
    policy: what a submitted config may do (the admin settings); default: `policy.Policy()`.

    Raises:
        UserError: SCALETUNE_SECRETS_KEY is set and is no Fernet key (`vault.Vault`).
    """

    def __init__(
        self,
        db_url: str,
        home: Path,
        base_url: str,
        max_concurrent: int = 1,
        poll_s: float = 0.5,
        policy: P.Policy | None = None,
        public_url: str | None = None,
    ) -> None:
        self.engine, self.Session = open_db(db_url)
        self.db_file = sqlite_file(db_url)
        self.policy = self._kept_policy(policy or P.Policy())
        self.home = home
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.base_url = base_url.rstrip("/")
        self.public_url = public_url.rstrip("/") if public_url else None
        self.workdir = Path.cwd()
        self.dispatchers: dict[str, Dispatcher] = make_dispatchers(max_concurrent)
        self.lock = threading.RLock()  # one writer at a time (SQLite)
        self._tokens: dict[str, str] = {}  # job id -> report token, in memory only
        # The jobs' submitted secret values: in memory, and sealed onto their records with a key.
        self.vault = Vault(os.environ)
        self.posted: dict[str, int] = {}  # job id -> events the run posted (the report path, not the file)
        self.watcher = Watcher(
            self.Session, self.lock, self.dispatchers, self.files, self.new_token, poll_s, ready=self._secrets_ready
        )

    # -- the policy ------------------------------------------------------------------------
    def _kept_policy(self, given: P.Policy) -> P.Policy:
        """`given` (the serve options) with the changes admins made with `PUT /api/admin/policy`,
        kept in the database: they outlast a restart, and every service started on the database
        applies them. A name this version has no setting for (a newer service's) is left out."""
        with self.Session() as s:
            row = s.get(Setting, POLICY_SETTING)
        kept = json.loads(row.value) if row is not None else {}
        known = {f.name for f in dataclasses.fields(P.Policy)}
        kept = {k: v for k, v in kept.items() if k in known}
        if kept:
            # Said at start: the serve options no longer decide these (a PUT changes them again).
            log.warning("policy: kept from PUT /api/admin/policy over the serve options: %s", ", ".join(sorted(kept)))
        return given.updated(**kept)

    def update_policy(self, change: dict[str, Any]) -> P.Policy:
        """The policy with the admin's `change` (setting name -> value), kept in the database beside
        the earlier changes so that it outlasts a restart; returns the new policy."""
        for _ in range(2):  # two services inserting the first change at once: the loser updates
            with self.lock, self.Session() as s:
                row = s.get(Setting, POLICY_SETTING)
                kept = {**(json.loads(row.value) if row is not None else {}), **change}
                if row is None:
                    s.add(Setting(name=POLICY_SETTING, value=json.dumps(kept, sort_keys=True)))
                else:
                    row.value = json.dumps(kept, sort_keys=True)
                try:
                    s.commit()
                    break
                except IntegrityError:
                    s.rollback()
        self.policy = self.policy.updated(**change)
        return self.policy

    # -- records ---------------------------------------------------------------------------
    def files(self, job: Job) -> JobFiles:
        """The job as its dispatcher sees it: the run directory the service assigned is always
        the last override; secrets (the job's own, and the service's variables the operator maps to
        its owner) and the report token are in `env` (the process environment)."""
        env = {**P.job_secrets_for(self.policy, job.owner, os.environ), **self.vault.held(job.id)}
        token = self._tokens.get(job.id)
        if token:
            base = self.public_url if job.target != "local" and self.public_url else self.base_url
            env |= {URL_ENV: f"{base}/api/jobs/{job.id}/report", TOKEN_ENV: token}
        return JobFiles(
            job_id=job.id,
            job_dir=Path(job.job_dir),
            config_path=Path(job.job_dir) / "config.yaml",
            overrides=(*job.overrides, f"output_dir={json.dumps(job.run_dir)}"),
            resources=dict(job.resources or {}),
            workdir=self.workdir,
            env=env,
        )

    def hold_secrets(self, job_id: str, values: dict[str, str]) -> None:
        """Keep a job's submitted secret values for its start (in memory; sealed on the record at submission)."""
        self.vault.hold(job_id, values)

    def drop_secrets(self, job_id: str) -> None:
        self.vault.drop(job_id)

    def _secrets_ready(self, job: Job) -> bool:
        """Whether the watcher may start `job`: its secrets are here (opened from its record now)."""
        return self.vault.missing(job) is None

    def get(self, job_id: str) -> Job | None:
        with self.Session() as s:
            return s.get(Job, job_id)

    def list(self) -> list[Job]:
        with self.Session() as s:
            return list(s.scalars(select(Job).order_by(Job.created.desc())))

    # -- submit ----------------------------------------------------------------------------
    def prepare_job(
        self,
        config: str,
        overrides: list[str],
        target: str,
        resources: dict,
        *,
        job_id: str | None = None,
        dry_run: bool = False,
    ) -> tuple[Job, dict | None]:
        """A job folder with the config written (secrets taken out), checked against the policy
        on the raw mapping first, then as the CLI checks it (not yet stored); with `dry_run`, the
        plan too.

        Raises:
            UserError: every problem of the request, the policy or the config (the API answers 422).
        """
        from scaletune.serve.jobs.validate import ChecksBusy, check

        job, fresh, child, secrets_ = self.draft_job(config, overrides, target, resources, job_id=job_id)
        try:
            plan = check(self.files(job), self.dispatchers[target], in_child=child, dry_run=dry_run)
        except (UserError, ChecksBusy):
            if fresh:
                remove_job_folder(Path(job.job_dir))
            raise
        if secrets_:
            self.hold_secrets(job.id, secrets_)
        return job, plan

    def draft_job(
        self,
        config: str,
        overrides: list[str],
        target: str,
        resources: dict,
        *,
        job_id: str | None = None,
        extra_secrets: Mapping[str, str] | None = None,
    ) -> tuple[Job, bool, bool, dict[str, str]]:
        """What is checked before the config's own check: the request, the policy on the raw
        mapping; then the job folder with the config written (secrets taken out) and the record
        (not stored). Returns (job, whether its folder is new, whether its check runs in a child
        process, its submitted secrets).

        Raises:
            UserError: every problem of the request or the policy.
        """
        problems = []
        if target not in TARGETS:
            problems.append(f"target {target!r}: one of {', '.join(TARGETS)}")
        elif target in self.policy.disabled_targets:
            on = [t for t in TARGETS if t not in self.policy.disabled_targets]
            problems.append(
                f"target {target}: turned off on this service (admin setting --disable-target); "
                f"targets here: {', '.join(on) or 'none'}"
            )
        if not isinstance(resources, dict):
            problems.append("resources: must be a mapping")
        if target == "modal" and not self.public_url:
            problems.append(
                "target modal: this service has no --public-url, the address a Modal job posts its reports to "
                f"({self.base_url} cannot be reached from Modal); start it with --public-url https://..."
            )
        if problems:
            raise UserError(problems, title="invalid job")
        job_id = job_id or uuid.uuid4().hex[:12]
        job_dir = self.home / job_id
        sub = submission.read(config, overrides, self.policy.max_depth)
        places = P.Places(self.home, job_dir, self.db_file, self._other_runs(job_id), self.workdir)
        problems, run_dir = P.check(sub.data, self.policy, places)
        if problems:
            raise UserError(problems, title="refused by this service's policy")
        assert run_dir is not None
        fresh = not job_dir.exists()
        job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_private(job_dir / "config.yaml", sub.text)
        job = Job(
            id=job_id,
            name=run_dir.name,
            state=S.CHECKING,
            step=0,
            target=target,
            config_yaml=sub.text,
            overrides=list(sub.overrides),
            resources=dict(resources),
            secret_refs=sorted({*sub.secret_names, *(extra_secrets or {})}),
            job_dir=str(job_dir),
            run_dir=str(run_dir),
            token_hash="",
            stop_requested=0,
        )
        return job, fresh, in_child(sub.data), dict(extra_secrets or {}) | dict(sub.secrets)

    def _other_runs(self, job_id: str) -> list[Path]:
        with self.Session() as s:
            return [Path(r) for r in s.scalars(select(Job.run_dir).where(Job.id != job_id))]

    def submit(
        self,
        config: str,
        overrides: list[str],
        target: str,
        resources: dict,
        dry_run: bool = False,
        owner: str = "",
        *,
        request_id: str | None = None,
        wait_s: float | None = None,
        extra_secrets: Mapping[str, str] | None = None,
    ) -> dict:
        """Record a job owned by `owner` (the submitting token's name) as `checking` and check it
        (`checking.submit_checked`): `{id, state}`, the state `queued`, or `checking` when the check
        outlasts `wait_s` (None: wait for it). The same `request_id` from the same owner again
        answers that job, with `replayed`. A dry run returns the plan and keeps nothing.
        `extra_secrets` (name -> value) join those the config and overrides hold (a clone's).

        Raises:
            UserError: every problem of the config, the policy or the target, at once (found inside
                the wait: the job is not kept).
            ChecksBusy: every check slot stayed busy (nothing kept).
        """
        if dry_run:
            job, plan = self.prepare_job(config, overrides, target, resources, dry_run=True)
            self.drop_secrets(job.id)
            remove_job_folder(Path(job.job_dir))
            return {"id": None, "state": "dry_run", "plan": plan}
        if request_id is not None and (known := self._requested(owner, request_id)) is not None:
            return known
        job, fresh, child, secrets_ = self.draft_job(config, overrides, target, resources, extra_secrets=extra_secrets)
        job.owner, job.request_id = owner, request_id
        self.vault.seal(job, secrets_)  # with a key: stored encrypted from the start (a restart mid-check keeps them)
        with self.lock, self.Session() as s:
            s.add(job)
            try:
                s.flush()
            except IntegrityError:  # the same request id, recorded by a request that came first
                s.rollback()
                if fresh:
                    remove_job_folder(Path(job.job_dir))
                known = self._requested(owner, request_id or "")
                assert known is not None, "a unique constraint failed without its row"
                return known
            set_state(s, job, S.CHECKING)
            s.commit()
        return submit_checked(self, job, child, secrets_, wait_s)

    def _requested(self, owner: str, request_id: str) -> dict | None:
        """The job `owner` submitted with `request_id`, as a replayed answer (None: none)."""
        with self.Session() as s:
            job = s.scalars(select(Job).where(Job.owner == owner, Job.request_id == request_id)).first()
            return None if job is None else {"id": job.id, "state": job.state, "replayed": True}

    # -- control ---------------------------------------------------------------------------
    def stop(self, job_id: str) -> Job:
        with self.lock, self.Session() as s:
            job = self._need(s, job_id)
            if job.state in (S.QUEUED, S.CHECKING, S.NEEDS_SECRETS):  # a check that ends later leaves it stopped
                set_state(s, job, S.STOPPED)
            elif job.state in (S.STARTING, S.RUNNING):
                job.stop_requested = 1
                self._call(job, "stop")
                set_state(s, job, S.STOPPING)
            else:
                raise UserError(
                    f"job {job_id} is {job.state}: only a checking, queued, waiting (needs_secrets) or running job can be stopped"
                )
            s.commit()
            return job

    def cancel(self, job_id: str) -> Job:
        with self.lock, self.Session() as s:
            job = self._need(s, job_id)
            if job.state in S.TERMINAL:
                raise UserError(f"job {job_id} is already {job.state}")
            if job.state in S.ACTIVE and job.target_id:
                self._call(job, "cancel")
            set_state(s, job, S.CANCELLED)
            s.commit()
            return job

    def _call(self, job: Job, verb: str) -> None:
        """The target's stop or cancel of `job`: a slow target's (scancel, Modal) in a worker, off
        the request and the lock (the record says stopping / cancelled at once; the watcher sees
        the end); a local process's now."""
        d, target_id, files = self.dispatchers[job.target], job.target_id or "", self.files(job)
        call = getattr(d, verb)
        if not d.slow or not self.watcher.later(lambda: call(target_id, files)):
            call(target_id, files)

    def resume(
        self,
        job_id: str,
        checkpoint: str | None,
        target: str | None,
        resources: dict | None,
        overrides: list[str] = (),  # type: ignore[assignment]
    ) -> Job:
        """Queue a stopped / failed / cancelled job again from `checkpoint` (default: its latest),
        possibly on another target or world size (`resources`, or `overrides` such as
        distributed.num_processes=2: the checkpoint is resharded as `scaletune train` does).

        Raises:
            UserError: the job is not resumable, or the resumed run does not pass the checks.
        """
        with self.lock, self.Session() as s:
            job = self._need(s, job_id)
            if job.state not in S.RESUMABLE:
                raise UserError(f"job {job_id} is {job.state}: only a stopped, failed or cancelled job resumes")
            added = list(overrides)
            overrides = [o for o in job.overrides if not o.startswith("training.resume=")] + added
            overrides.append(f"training.resume={checkpoint or 'auto'}")
            again, _ = self.prepare_job(
                job.config_yaml, overrides, target or job.target, resources or job.resources, job_id=job.id
            )
            job.run_dir = again.run_dir
            job.overrides, job.target = again.overrides, target or job.target
            job.resources = resources if resources is not None else job.resources
            job.stop_requested, job.target_id, job.exit_code = 0, None, None
            if (why := self.vault.missing(job, hold=False)) is not None:
                needs_secrets(s, job, why)  # its secrets ended with it, or with the service that held them
            else:
                set_state(s, job, S.QUEUED, reason=None, message=None, phase=None)
            s.commit()
        self.kick()
        return job

    def clone(self, job_id: str, overrides: list[str], owner: str = "") -> dict:
        """A new job of `job_id`'s config and overrides (a resume's dropped) plus `overrides`, owned
        by `owner`, submitted as :meth:`submit` does. The secrets the job was submitted with (its
        stored config holds none) go with the clone when `owner` submitted the job and this service
        still holds them (a stopped job keeps them; one that ended does not); a secret given as an
        override (`distributed.env.NAME=VALUE`) replaces its. A clone never starts without them.

        Raises:
            JobNotFound: no such job.
            UserError: a secret the clone cannot take (another token's, or no longer held), naming
                each and how to give it; or any problem :meth:`submit` finds.
        """
        job = self.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        added = [o for o in job.overrides if not o.startswith("training.resume=")] + list(overrides)
        carried: dict[str, str] = {}
        if job.secret_refs:
            given = submission.read(job.config_yaml, added, self.policy.max_depth).secret_names
            wanted = [n for n in job.secret_refs if n not in given]
            held = self.vault.values(job) if wanted and owner == job.owner else None
            if wanted and (held is None or not set(wanted) <= set(held)):
                why = (
                    f"they are {job.owner or 'another token'}'s"
                    if owner != job.owner
                    else "this service no longer holds them (a job that ended drops them)"
                )
                raise UserError(
                    f"job {job_id} was submitted with secrets ({', '.join(wanted)}) its clone cannot take: {why}; "
                    f"give each as an override of the clone: {' '.join(f'distributed.env.{n}=VALUE' for n in wanted)}",
                    title="invalid clone",
                )
            carried = {n: held[n] for n in wanted} if held else {}
        return self.submit(job.config_yaml, added, job.target, dict(job.resources), owner=owner, extra_secrets=carried)

    def _need(self, s: Any, job_id: str) -> Job:
        job = s.get(Job, job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    # -- reports from the run --------------------------------------------------------------
    def check_job_token(self, job_id: str, token: str) -> bool:
        """Whether `token` is the report token of `job_id` while the job runs (it ends with it)."""
        job = self.get(job_id)
        if job is None or job.state in S.TERMINAL:
            self._tokens.pop(job_id, None)
            return False
        return bool(job.token_hash) and secrets.compare_digest(job.token_hash, digest(token))

    def ingest(self, job_id: str, events: list[dict]) -> int:
        """Store what a run reported (metric lines, phases, checkpoints); returns how many were new.

        Raises:
            JobNotFound: no such job.
        """
        with self.lock, self.Session() as s:
            job = self._need(s, job_id)
            n = sum(apply_report(s, job, e.get("kind", ""), e.get("data") or {}) for e in events)
            s.commit()
            self.posted[job_id] = self.posted.get(job_id, 0) + len(events)
            return n

    def metrics(self, job_id: str, since_step: int | None = None) -> list[dict]:
        """The job's metrics lines, all of them (step 0's evaluation before training included) or
        those after `since_step` (a bounded integer: the API checks it)."""
        query = select(Metric).where(Metric.job_id == job_id)
        if since_step is not None:
            query = query.where(Metric.step > since_step)
        with self.Session() as s:
            return [r.data for r in s.scalars(query.order_by(Metric.step, Metric.id))]

    def events_after(self, job_id: str, last_id: int) -> list[tuple[int, str, dict]]:
        with self.Session() as s:
            rows = s.scalars(select(Event).where(Event.job_id == job_id, Event.id > last_id).order_by(Event.id))
            return [(e.id, e.kind, e.data) for e in rows]

    # -- the watcher -----------------------------------------------------------------------
    def start(self) -> None:
        """Start the watcher (after re-attaching to the jobs a previous service left running, and
        telling the queued jobs whose secrets are not here: `vault.recover`) and check again the jobs
        a previous service left `checking`."""
        from scaletune.serve.jobs.checking import recheck_orphans

        self.watcher.reattach_all()
        recover(self)  # a queued job whose secrets this service cannot give: needs_secrets, never started without
        self.watcher.run()
        recheck_orphans(self)

    def shutdown(self) -> None:
        self.watcher.shutdown()
        self.engine.dispose()

    def kick(self) -> None:
        """One watcher tick now (a job was queued: start it without waiting for the next poll)."""
        self.watcher.tick()

    def new_token(self, job: Job) -> str:
        token = "stj_" + secrets.token_urlsafe(24)
        self._tokens[job.id] = token
        job.token_hash = digest(token)
        return token


def _write_private(path: Path, text: str) -> None:
    """Write `text` readable by the service's user only (0600), whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
