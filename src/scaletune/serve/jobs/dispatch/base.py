"""The interface every dispatcher implements, and what a job hands it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

from scaletune.errors import UserError

STOP_FILE = "stop-request"  # in the job folder; the trainer checks it at each step boundary
EXIT_FILE = "exit-code"  # written by the wrapper when the run's process ends
LOG_FILE = "train.log"
# The service's own secrets, read from its environment to run it: the database URL (password
# included), the admin token, a client token, Modal's credentials. A job inherits the service's
# environment (PATH, CUDA and NCCL settings; its Hugging Face places are its own: HF_PLACES)
# except these and every other credential the service holds (a variable the secret rule of
# `config/secrets.py` names: HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, ...): a submitted
# config's code (an allowed factory, remote code), a hub or W&B call made for one user, and SLURM's
# record of the job (`sbatch --export=ALL`) would otherwise hold them. A job's credentials are its
# own (submitted as secrets) or mapped to its owner by the operator (`scaletune serve --job-secret`).
SERVICE_SECRETS = frozenset(
    {
        "SCALETUNE_ADMIN_TOKEN",
        "SCALETUNE_DB",
        "DATABASE_URL",
        "SCALETUNE_TOKEN",
        "SCALETUNE_SECRETS_KEY",  # the key the jobs' stored secrets are sealed with (`jobs/vault.py`)
        "MODAL_TOKEN_ID",
        "MODAL_TOKEN_SECRET",
    }
)


# Hugging Face's variables that name a place: its home, its caches (hub, datasets, Xet, assets,
# remote-code modules) and its token files. A job gets its own (below), never the service's: what a
# hub answers one job is written into that job's folder alone, and the token `hf auth login` stored
# for the service is not read (huggingface_hub sends it to every download, to the job's endpoint).
HF_PLACES = frozenset(
    {
        "HF_HOME",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_DATASETS_CACHE",
        "HF_XET_CACHE",
        "HF_ASSETS_CACHE",
        "HF_MODULES_CACHE",
        "TRANSFORMERS_CACHE",
        "HF_TOKEN_PATH",
        "HF_STORED_TOKENS_PATH",
    }
)
JOB_HF_HOME = "hf"  # in the job folder


def job_environment(job: JobFiles, **extra: str) -> dict[str, str]:
    """The environment a job's process (or sbatch), its config check and its tasks start with: the
    service's, less `SERVICE_SECRETS`, every secret-named variable and `HF_PLACES`; the job's own
    Hugging Face home (`JOB_HF_HOME` in its folder) and the service's hub cache to read from
    (`SCALETUNE_SHARED_HUB_CACHE`: a model the operator downloaded there is used in place, never
    written); the job's own variables (report URL and token, secret values submitted with its
    config or mapped to its owner) and `extra`; PYTHONSAFEPATH set."""
    from huggingface_hub import constants

    from scaletune.config.secrets import is_secret_name
    from scaletune.models.hub import SHARED_HUB_CACHE_ENV

    inherited = {
        k: v for k, v in os.environ.items() if k not in SERVICE_SECRETS and not is_secret_name(k) and k not in HF_PLACES
    }
    own = {"HF_HOME": str(job.job_dir / JOB_HF_HOME), SHARED_HUB_CACHE_ENV: constants.HF_HUB_CACHE}
    # PYTHONSAFEPATH: `python -m scaletune` (and torchrun's workers) put no working directory first
    # on sys.path, so a file written there (a hub download into a cache named by a job, an
    # upload) is never imported in place of scaletune, torch or transformers.
    return {**inherited, **own, **job.env, **extra, "PYTHONSAFEPATH": "1"}


@dataclass(frozen=True)
class JobFiles:
    """A job as a dispatcher sees it.

    `env` holds the job's report URL and token: given to the process environment only (never
    written into the job folder, a script or a log).
    """

    job_id: str
    job_dir: Path
    config_path: Path  # the YAML written into job_dir
    overrides: tuple[str, ...]
    resources: dict
    workdir: Path  # where relative paths of the config are read from
    env: dict[str, str] = field(default_factory=dict)

    @property
    def stop_file(self) -> Path:
        return self.job_dir / STOP_FILE


def checked_options(job: JobFiles, build: Callable[[JobFiles], Any], counts: tuple[str, ...]) -> Any:
    """`build(job)` (a target's options from the job's resources), with every problem at once: the
    resources named in `counts` must be whole numbers (`build` converts with int(), which would
    take 8.7 as 8), and `build`'s own refusals (unknown keys) come with them.

    Raises:
        UserError: titled "invalid resources", listing every problem.
    """
    r = job.resources
    problems = [
        f"resources.{k}: must be a whole number, got {r[k]!r}" for k in counts if k in r and type(r[k]) is not int
    ]
    try:
        opts = build(job)
    except UserError as exc:  # unknown keys, named with the counts
        raise UserError(exc.problems + problems, title="invalid resources") from None
    except (TypeError, ValueError):  # int() of a count named above
        if not problems:
            raise
    if problems:
        raise UserError(problems, title="invalid resources")
    return opts


@dataclass(frozen=True)
class Status:
    """`queued` (waiting at the target), `running`, `ending` (gone, how it ended not known yet:
    its exit code may still appear), `exited` (with its code, None when unknown) or `lost` (no
    trace of it any more). `final`: whether the run wrote `final/`, where the target says so (a
    Modal call's result); None: the service looks in the run directory."""

    state: Literal["queued", "running", "ending", "exited", "lost"]
    exit_code: int | None = None
    final: bool | None = None


class SubmitUnknown(Exception):
    """Whether the target accepted the job is not known (its answer to the submit was an error
    after the request may have reached it, or the last service stopped during the submit): the job
    waits `starting` with reason `submit unknown` while `Dispatcher.reconcile` asks the target."""


class NotAccepted(UserError):
    """The target has no run of this submission: the submit failed (reason `submit failed`)."""


class ArtifactMissing(Exception):
    """An artifact the run has not written (the API answers 404 with the message)."""


class ArtifactUnreachable(Exception):
    """Where the artifact is cannot be asked now (the API answers 502 with the message, which says
    how to fetch it by hand and holds no secret)."""


@dataclass(frozen=True)
class Download:
    """One artifact file: on this machine (`path`), or streamed from the target (`chunks`, `size`
    bytes in all, sent as the Content-Length so a download cut short is seen as one)."""

    name: str
    path: Path | None = None
    chunks: Iterator[bytes] | None = None
    size: int | None = None


class Dispatcher:
    """submit, poll, stop, cancel, logs, artifact, adopt, reconcile, reattach. `target_id` is what the
    job record keeps: a PID, a SLURM job id, a Modal call id."""

    name = "base"
    max_concurrent: int | None = None  # jobs running at once; None: the target queues them itself
    # Its calls run commands or ask the network (seconds): the watcher makes them in a worker
    # thread, never under the service's lock (watch.py says why).
    slow = False

    def submit(self, job: JobFiles) -> str:
        """Start the job; returns its target id. Raises UserError when the target refuses it,
        SubmitUnknown when whether it accepted the job is not known."""
        raise NotImplementedError

    def poll(self, target_id: str, job: JobFiles) -> Status:
        raise NotImplementedError

    def running(self) -> int:
        """How many jobs this dispatcher knows to run now, whatever their records say (0: it keeps
        no such count; the records' count stands)."""
        return 0

    def stop(self, target_id: str, job: JobFiles) -> None:
        """Ask for a checkpoint at the next step boundary and a clean end (the stop file)."""
        job.stop_file.write_text("stop\n")

    def cancel(self, target_id: str, job: JobFiles) -> None:
        """End the job now."""
        raise NotImplementedError

    def log_bytes(self, job: JobFiles, offset: int | None = None, limit: int = 1 << 20) -> bytes:
        """At most `limit` bytes of the job's output (its logs one after another) from byte
        `offset`, or its last `limit` bytes; never the whole of a long log. The ranks share one log
        (the API refuses a `rank` filter: api/jobs.py says why). Bytes, as written: a client's next
        offset is this offset plus their count (text decoded and encoded again would not be, where
        the log holds invalid UTF-8 or a read cuts a character)."""
        return read_range(log_files(job), offset, limit)[0]

    def logs(self, job: JobFiles, offset: int | None = None, limit: int = 1 << 20) -> str:
        """:meth:`log_bytes` as text (invalid UTF-8 replaced): what the watcher reads a failure from."""
        return self.log_bytes(job, offset, limit).decode(errors="replace")

    def artifact(self, job: JobFiles, run_dir: str, rel: str) -> list[str] | Download:
        """The run's artifact `rel` (normalized, on the API's allow-list: api/artifacts.py checks it, once,
        before any dispatcher is asked): a file, or the files under a folder (paths from the run
        directory). This default reads the run directory on this machine (local, SLURM's shared file
        system); links are followed only while they stay inside the allowed entry.

        Raises:
            ArtifactMissing: not written (yet), or a link out of the allowed entry.
            ArtifactUnreachable: where it is cannot be asked now (a remote target's).
        """
        root = Path(run_dir).resolve()
        allowed = (root / rel.split("/")[0]).resolve()
        target = (root / rel).resolve()
        if not (target == allowed or target.is_relative_to(allowed)) or not allowed.is_relative_to(root):
            raise ArtifactMissing("not an artifact of this run")
        if target.is_dir():
            return sorted(str(p.relative_to(root)) for p in target.rglob("*") if p.is_file() and not p.is_symlink())
        if not target.is_file():
            raise ArtifactMissing(f"{rel}: not written (yet)")
        return Download(target.name, path=target)

    def adopt(self, job: JobFiles) -> str | None:
        """After a service stopped while starting `job`: its target id if it was started, else None
        (it is queued and started again).

        Raises:
            SubmitUnknown: whether it was started is asked of the target (`reconcile`).
            UserError: whether it was started cannot be known (the job fails with the message
                rather than being started a second time).
        """
        return None

    def reconcile(self, job: JobFiles) -> str:
        """The target id of a submission whose outcome was not known (`SubmitUnknown`), asked of
        the target again.

        Raises:
            SubmitUnknown: still not known (asked again later).
            NotAccepted: the target has no run of it.
            UserError: it cannot be told (the job fails rather than being started a second time).
        """
        raise UserError(f"{self.name}: whether the job was started cannot be told")

    def reattach(self, target_id: str, job: JobFiles) -> bool:
        """After a service restart: whether the job is still known to the target (then polled)."""
        return self.poll(target_id, job).state != "lost"


def exit_code(job: JobFiles) -> int | None:
    p = job.job_dir / EXIT_FILE
    try:
        return int(p.read_text().strip())
    except (OSError, ValueError):
        return None


def start_mark(pid: int) -> str | None:
    """What tells process `pid` from a later one given the same PID: its start time in clock
    ticks since boot (/proc/PID/stat, fixed for the life of the process, readable from the moment
    it exists, unlike its command line), or psutil's create time where /proc has none. None when
    `pid` does not run (a zombie, ended but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # the name before ")" may hold spaces
        return None if fields[0] in (b"Z", b"X") else f"t{int(fields[19])}"
    except FileNotFoundError:
        pass
    except (OSError, IndexError, ValueError):
        return None
    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else f"c{proc.create_time():.3f}"
    except psutil.Error:
        return None


def pid_alive(pid: int, marker: str) -> bool:
    """Whether `pid` runs and its command line names `marker` (a check against PID reuse for a
    process whose start mark was not recorded). An empty command line is one not set up yet (a
    process in the middle of its exec): alive, never taken for gone."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        cmd = proc.cmdline()
    except psutil.Error:
        return False
    return not cmd or any(marker in arg for arg in cmd)


def log_files(job: JobFiles) -> list[Path]:
    return sorted(job.job_dir.glob("*.log")) + sorted(job.job_dir.glob("slurm-*.out"))


def read_range(paths: list[Path], offset: int | None, limit: int) -> tuple[bytes, int]:
    """(at most `limit` bytes from `offset` of the files read as one, their total size); without
    `offset`, the last `limit` bytes. Reads only the bytes returned."""
    sizes = []
    for p in paths:
        try:
            sizes.append(p.stat().st_size)
        except OSError:
            sizes.append(0)
    total = sum(sizes)
    start = max(0, total - limit) if offset is None else min(offset, total)
    out, base = bytearray(), 0
    for p, size in zip(paths, sizes, strict=True):
        if len(out) >= limit:
            break
        if start < base + size:
            try:
                with open(p, "rb") as f:
                    f.seek(max(0, start - base))
                    out += f.read(min(limit - len(out), base + size - max(start, base)))
            except OSError:
                pass
        base += size
    return bytes(out), total
