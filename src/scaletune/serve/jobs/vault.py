"""A job's submitted secrets across a restart, never in plain text (issue 39, item 13).

The secret values taken out of a submission (`submission.py`) are held in the memory of the service
that took them, for the job's processes only. With `SCALETUNE_SECRETS_KEY` set (a Fernet key of the
`cryptography` package; several, comma-separated: the first seals, each one opens, for a rotation)
they are also sealed with it onto the job's record (`jobs.sealed_secrets`) as the job is recorded,
opened when the job starts (by whichever service on the database starts it) and deleted when it ends
(succeeded, failed, cancelled: `records.set_state`; the copy in memory too, when the job is next asked
about; a stopped job keeps them for its resume). A clone takes its job's secrets while they are held,
for the job's owner only (`JobService.clone`). The key
is read from the service's environment only: never stored, printed or given to a job.

A queued job whose secrets this service cannot give it is never started without them. At a service's
start (`recover`) it becomes `needs_secrets`, its reason naming the cause: `secrets not kept` (no key
when it was submitted: they were in the stopped service's memory), `no secrets key` (sealed, and this
service has no key), `wrong secrets key` (the key does not open them: it changed). The message names
the variables, never a value. Its owner or an admin gives them again (`give`, PUT /api/jobs/ID/secrets)
and the job is queued; a restart with the right key queues it again too.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from sqlalchemy import select

from scaletune.errors import UserError
from scaletune.serve.jobs import states as S
from scaletune.serve.jobs.db import Job
from scaletune.serve.jobs.records import event, set_state

KEY_ENV = "SCALETUNE_SECRETS_KEY"
MAX_VALUE_CHARS = 16384  # one secret value given again (an API token, a key file's text)
MAKE_KEY = "python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'"
# `svc` below is the `service.JobService` that owns the job (typed Any: that module imports this one).
JobService = Any

log = logging.getLogger(__name__)


class NotWaiting(UserError):
    """Secrets given for a job that is not waiting for them (the API answers 409)."""


class Vault:
    """The submitted secrets of the jobs this service knows: held in memory (job id -> name -> value)
    and, with a key in `environ[KEY_ENV]`, sealed onto their records.

    Raises:
        UserError: the key is not a Fernet key, or `cryptography` is not installed (the start stops;
            the message never holds the key).
    """

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        self._held: dict[str, dict[str, str]] = {}
        raw = environ.get(KEY_ENV, "").strip()
        self._fernet = _fernet(raw) if raw else None

    @property
    def keyed(self) -> bool:
        return self._fernet is not None

    def hold(self, job_id: str, values: dict[str, str]) -> None:
        self._held.setdefault(job_id, {}).update(values)

    def held(self, job_id: str) -> dict[str, str]:
        return dict(self._held.get(job_id, {}))

    def drop(self, job_id: str) -> None:
        self._held.pop(job_id, None)

    def seal(self, job: Job, values: Mapping[str, str]) -> None:
        """`values` sealed onto `job`'s record when this service has a key (the caller commits); the
        job's id is sealed with them, so a copy moved onto another record does not open there."""
        if values and self._fernet is not None:
            plain = json.dumps({"job": job.id, "values": dict(values)}, sort_keys=True).encode()
            job.sealed_secrets = self._fernet.encrypt(plain).decode("ascii")

    def values(self, job: Job) -> dict[str, str] | None:
        """The secret values `job` was submitted with, when this service can give them (held in
        memory, or sealed and opened now; nothing is held by asking); None otherwise."""
        self._forget_ended(job)
        if job.id in self._held:
            return dict(self._held[job.id])
        if job.sealed_secrets is None or self._fernet is None:
            return None
        return self._open(job)

    def missing(self, job: Job, *, hold: bool = True) -> tuple[str, str] | None:
        """None when this service can give `job` the secrets it was submitted with: none, held in
        memory, or sealed and opened now (with `hold`, then held for its start; without, forgotten
        at once). Else (reason, message): why not, naming the variables and never a value. A copy
        held but no longer stored (a job resumed after it ended) is sealed again (the caller commits)."""
        if not job.secret_refs:
            return None
        self._forget_ended(job)
        if job.id in self._held:
            if job.sealed_secrets is None:
                self.seal(job, self._held[job.id])
            return None
        names = ", ".join(job.secret_refs)
        if job.sealed_secrets is None:
            why = f"its secrets ({names}) were held in the memory of the service that took them, which had no {KEY_ENV} and stopped"
            return S.SECRETS_NOT_KEPT, why
        if self._fernet is None:
            return (
                S.NO_SECRETS_KEY,
                f"its secrets ({names}) are stored encrypted and this service has no {KEY_ENV} to open them",
            )
        values = self._open(job)
        if values is None:
            why = f"{KEY_ENV} does not open the copy of its secrets ({names}) stored with it: the key changed since it was submitted"
            return S.WRONG_SECRETS_KEY, why
        if hold:
            self._held[job.id] = values
        return None

    def _forget_ended(self, job: Job) -> None:
        """A job that ended (not stopped) has no secrets: its stored copy went with its last state
        (`records.set_state`), its copy in memory goes when it is next asked about."""
        if job.state in S.SECRETS_DROPPED:
            self._held.pop(job.id, None)

    def _open(self, job: Job) -> dict[str, str] | None:
        from cryptography.fernet import InvalidToken

        assert self._fernet is not None and job.sealed_secrets is not None
        try:
            data = json.loads(self._fernet.decrypt(job.sealed_secrets.encode("ascii")))
        except (InvalidToken, ValueError):
            return None
        if not isinstance(data, dict) or data.get("job") != job.id or not isinstance(data.get("values"), dict):
            return None
        return {str(k): str(v) for k, v in data["values"].items()}


def _fernet(raw: str) -> Any:
    """The MultiFernet of the comma-separated keys in `raw` (the first one seals)."""
    try:
        from cryptography.fernet import Fernet, MultiFernet
    except ImportError:
        raise UserError(
            f"{KEY_ENV} is set and the cryptography package is not installed: pip install 'scaletune[serve]'",
            title="invalid secrets key",
        ) from None
    keys, problems = [], []
    parts = [p.strip() for p in raw.split(",")]
    for i, part in enumerate(parts, 1):
        try:
            keys.append(Fernet(part))
        except (ValueError, TypeError):  # never chained nor quoted: the message must not hold the key
            which = f"key {i} of {len(parts)}" if len(parts) > 1 else "its value"
            problems.append(
                f"{KEY_ENV}: {which} is not a Fernet key (32 url-safe base64-encoded bytes); make one with {MAKE_KEY}"
            )
    if problems:
        raise UserError(problems, title="invalid secrets key")
    return MultiFernet(keys)


def how_to_give(job_id: str) -> str:
    return (
        f'give them again with PUT /api/jobs/{job_id}/secrets and {{"secrets": {{"NAME": "value", ...}}}} '
        "(the job's owner or an admin), or cancel the job"
    )


def needs_secrets(s: Any, job: Job, why: tuple[str, str]) -> None:
    """`job` put in `needs_secrets` for `why` (reason, message), said in its log events too."""
    reason, message = why
    set_state(s, job, S.NEEDS_SECRETS, reason=reason, message=f"{message}; {how_to_give(job.id)}", phase=None)
    event(s, job, "log", {"line": f"[scaletune serve] not started: {message}"})


def recover(svc: JobService) -> list[str]:
    """At a service's start, before its watcher starts jobs: each queued job not yet at its target
    whose secrets this service cannot give it becomes `needs_secrets`; each `needs_secrets` job whose
    stored copy the key opens now is queued again. Nothing is held in memory here. Returns the ids
    of the jobs that need their secrets."""
    waiting: list[str] = []
    with svc.lock, svc.Session() as s:
        queued = (Job.state == S.QUEUED) & Job.target_id.is_(None)
        for job in s.scalars(select(Job).where(queued | (Job.state == S.NEEDS_SECRETS))):
            why = svc.vault.missing(job, hold=False)
            if why is not None and job.state == S.QUEUED:
                needs_secrets(s, job, why)
            elif why is None and job.state == S.NEEDS_SECRETS:
                set_state(s, job, S.QUEUED, reason=None, message=None)
                event(s, job, "log", {"line": f"[scaletune serve] {KEY_ENV} opens its stored secrets: queued again"})
            if job.state == S.NEEDS_SECRETS:
                waiting.append(job.id)
        s.commit()
    if waiting:
        log.warning("jobs that need their secrets again (PUT /api/jobs/ID/secrets): %s", ", ".join(waiting))
    return waiting


def give(svc: JobService, job_id: str, values: Mapping[str, str]) -> Job:
    """The secrets of a `needs_secrets` job given again: every name it was submitted with and no
    other, held (and sealed, with a key) for its start; the job queued. The caller checked who asks.

    Raises:
        NotWaiting: the job is not `needs_secrets` (or no longer there).
        UserError: a name missing or not the job's, a value no environment can hold.
    """
    with svc.lock, svc.Session() as s:
        job = s.get(Job, job_id)
        if job is None:
            raise NotWaiting(f"no job {job_id}", title="not waiting for secrets")
        if job.state != S.NEEDS_SECRETS:
            raise NotWaiting(
                f"job {job_id} is {job.state}: only a job that needs its secrets takes them",
                title="not waiting for secrets",
            )
        wanted = list(job.secret_refs)
        problems = [
            f"{n}: missing (this job was submitted with {', '.join(wanted)})" for n in wanted if n not in values
        ]
        problems += [
            f"{n}: not a secret this job was submitted with ({', '.join(wanted)})" for n in values if n not in wanted
        ]
        problems += [
            f"{n}: holds a NUL character, which no environment variable can" for n, v in values.items() if "\0" in v
        ]
        if problems:
            raise UserError(problems, title="secrets refused")
        svc.vault.drop(job_id)
        svc.vault.hold(job_id, dict(values))
        svc.vault.seal(job, values)
        set_state(s, job, S.QUEUED, reason=None, message=None)
        event(s, job, "log", {"line": f"[scaletune serve] its secrets were given again ({', '.join(wanted)}): queued"})
        s.commit()
    svc.kick()
    return job
