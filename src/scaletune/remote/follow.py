"""What `scaletune remote` does with a job over the :class:`~scaletune.remote.client.Client`: wait
for its end (the event stream), copy its log (once, or following it), download its artifacts,
and the exit code of its outcome."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from scaletune.errors import UserError
from scaletune.remote.client import Client, RemoteError, Unavailable
from scaletune.serve.jobs import states as S

Say = Callable[[str], None]
RETRY_S = 300.0  # how long a service that cannot be reached is asked again while waiting or following
LOG_CHUNK = 1 << 20  # bytes per /logs request (the API allows 8 MiB)
POLL_S = 1.0  # between two reads of a followed log


def outcome(job: dict) -> int:
    """The exit code of a job's outcome (DESIGN.md's): 0 succeeded; 2 bad input (the run itself
    refused its config or data, exit 2); 1 anything else (failed, lost, cancelled, stopped)."""
    if job.get("state") == S.SUCCEEDED:
        return 0
    if job.get("state") == S.FAILED and job.get("reason") == S.BAD_INPUT:
        return 2
    return 1


def submitted_text(answer: dict, url: str, request_id: str) -> str:
    """What `remote submit` says of the service's answer (POST /api/jobs): the job's state and
    where to follow it."""
    job_id, state = answer["id"], answer["state"]
    page = f"{url}/jobs/{job_id}"
    if answer.get("replayed"):
        return f"job {job_id} was submitted before with request id {request_id} (now {state}); no second job: {page}"
    if state == S.CHECKING:
        return (
            f"job {job_id}: the service is still checking its config (longer than --timeout); the check goes on "
            f"there and the job is queued or fails with its problems: scaletune remote status {job_id}, or {page}"
        )
    return f"job {job_id} {state}: {page}"


def describe(job: dict) -> str:
    """A job as lines for a person: its state with phase, step, reason and message."""
    head = f"job {job.get('id')} ({job.get('name')}): {job.get('state')}"
    if job.get("phase"):
        head += f", {job['phase']}"
    if job.get("reason"):
        head += f" ({job['reason']})"
    lines = [head]
    if job.get("message"):  # a failed check's message holds a problem a line
        lines.append("  message: " + "\n    ".join(str(job["message"]).splitlines()))
    for key in ("target", "target_id", "step", "exit_code", "run_dir", "created", "updated"):
        if job.get(key) not in (None, ""):
            lines.append(f"  {key}: {job[key]}")
    if job.get("last_metrics"):
        lines.append("  last metrics: " + _metrics_text(job["last_metrics"]))
    return "\n".join(lines)


def wait(client: Client, job_id: str, say: Say, *, retry_s: float = RETRY_S) -> dict:
    """Follow the job's event stream, saying its states, steps and the service's own log lines,
    until it ends; returns the ended job's summary.

    The end is the job's record, not the stream: a terminal state in the stream is checked
    against GET /api/jobs/ID (a resumed job's history holds an earlier `stopped`), and the stream
    is left then, whether or not the service closes it. A broken or silent stream is opened again
    after the last event seen (Last-Event-ID); a service that cannot be reached for `retry_s`
    raises :class:`Unavailable`.
    """
    retry = _Retry(retry_s, say)
    last, said = 0, ""
    while True:
        try:
            job = client.job(job_id)
            retry.failing_since = None
            if job["state"] in S.TERMINAL:
                return job
            for eid, kind, data in client.events(job_id, last):
                last, retry.failing_since = max(last, eid), None
                if kind == "state" and data.get("state") in S.TERMINAL:
                    job = client.job(job_id)
                    if job["state"] in S.TERMINAL:
                        return job
                text = event_text(kind, data)
                if text and not (kind == "state" and text == said):
                    say(f"{job_id}: {text}")
                    said = text if kind == "state" else said
        except Unavailable as exc:
            retry.failed(exc)
            continue
        time.sleep(POLL_S)  # the service closed the stream before the end: open it again


def event_text(kind: str, data: dict) -> str:
    """One event as a line ("" for a heartbeat)."""
    if kind == "state":
        text = str(data.get("state"))
        if data.get("phase"):
            text += f" ({data['phase']})"
        if data.get("reason"):
            text += f": {data['reason']}"
        if data.get("message"):
            text += f": {data['message']}"
        return text
    if kind == "metric":
        return _metrics_text(data)
    if kind == "checkpoint":
        return f"checkpoint step {data.get('step')} " + ("removed" if data.get("removed") else "saved")
    if kind == "log":
        return str(data.get("line", ""))
    return ""


def _metrics_text(m: dict) -> str:
    keys = ("loss", "eval_loss", "reward_accuracy", "lr", "tokens_per_s")
    parts = [f"step {m.get('step')}"] + [f"{k} {m[k]:.4g}" for k in keys if isinstance(m.get(k), int | float)]
    return ", ".join(parts)


def copy_log(
    client: Client, job_id: str, write: Callable[[bytes], None], *, follow: bool, say: Say, retry_s: float = RETRY_S
) -> None:
    """Write the job's whole log (from its first byte); with `follow`, go on writing what is
    appended until the job has ended and its log is read to the end.

    The API answers the log's bytes as written, so the offset advances by the bytes written out;
    it advances by whole lines only, so that a line still being written is printed once, whole,
    when its end arrives. Only a line longer than a whole chunk is cut.
    """
    retry = _Retry(retry_s, say)
    offset = 0
    while True:
        try:
            # Asked before the reads: a job ended then has its whole log on disk by the last read.
            ended = not follow or client.job(job_id)["state"] in S.TERMINAL
            while chunk := client.log(job_id, offset, LOG_CHUNK):
                cut = chunk.rfind(b"\n") + 1 or (len(chunk) if len(chunk) >= LOG_CHUNK else 0)
                if cut == 0:
                    break  # an unfinished line: its end, or the job's, comes later
                write(chunk[:cut])
                offset += cut
            if ended:
                rest = client.log(job_id, offset, LOG_CHUNK)
                if rest:
                    write(rest)  # the log's last line, without a line end
                return
            retry.failing_since = None
        except Unavailable as exc:
            retry.failed(exc)
            continue
        time.sleep(POLL_S)


def download(client: Client, job_id: str, artifact: str, dest: Path, say: Say) -> list[Path]:
    """The artifact (`final`, `checkpoints/step-N`, `loss.png`, ...) into `dest`: a folder's
    files at their paths inside it (`final/config.json` -> DEST/config.json), a file as
    DEST/NAME. Each file is written whole or not at all (a temporary file renamed)."""
    rel = _artifact_path(artifact)
    listing = client.artifact_listing(job_id, rel)
    files = [(rel, PurePosixPath(rel).name)] if listing is None else [(p, _inside(p, rel)) for p in listing]
    if not files:
        raise RemoteError(f"artifact {rel} of job {job_id}: the folder holds no files")
    written = []
    for src, name in files:
        target = dest.joinpath(*PurePosixPath(name).parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as f, client.artifact_file(job_id, src) as resp:
                for block in resp.iter_bytes():
                    f.write(block)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        say(f"{src} -> {target}")
        written.append(target)
    return written


def _artifact_path(artifact: str) -> str:
    p = PurePosixPath(artifact.strip().strip("/") or "final")
    if ".." in p.parts or "\\" in artifact or not p.parts:
        raise UserError(
            f"ARTIFACT {artifact!r}: a path inside the run directory, e.g. final, checkpoints/step-100, loss.png",
            title="invalid arguments",
        )
    return str(p)


def _inside(listed: str, folder: str) -> str:
    """A listed file's path inside the downloaded folder; one the service lists outside it (or with
    `..`) is refused, so an answer cannot make the client write outside DEST."""
    p = PurePosixPath(listed)
    if p.is_absolute() or ".." in p.parts or not p.is_relative_to(folder) or p == PurePosixPath(folder):
        raise RemoteError(f"the service listed {listed!r} in {folder}/: not a file inside it")
    return str(p.relative_to(folder))


class _Retry:
    """Consecutive failures to reach the service: said, waited on, and raised after `limit_s`."""

    def __init__(self, limit_s: float, say: Say) -> None:
        self.limit_s, self.say = limit_s, say
        self.failing_since: float | None = None

    def failed(self, exc: Unavailable) -> None:
        now = time.monotonic()
        self.failing_since = self.failing_since or now
        if now - self.failing_since >= self.limit_s:
            raise exc
        self.say(f"{exc}; trying again")
        time.sleep(min(10.0, 1.0 + (now - self.failing_since) / 2))
