"""Talk to the result and ship it: chat with a run's model (`api/chat.py`), evaluate and export it
as small tasks (`api/tasks.py`), download final/ or a checkpoint as one archive (here, with the
models offered, the samples, and the rules the three share: the job has ended, its files are here).

Who may do what: reading (the models offered, samples, tasks, archives) needs a read token;
chatting needs submit (it costs compute) but not the job's ownership (it changes nothing);
evaluating and exporting write into the run's folder (eval/, exports/), so they need its owner or
an admin, as stop and resume do. A model is talked to only once its job no longer runs, and only
where its files are on this machine."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
import contextlib
import json
import os
import posixpath
import re
from pathlib import Path
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from scaletune.serve.api.jobs import job_or_404
from scaletune.serve.api.schemas import E409_422, E422, refusal
from scaletune.serve.edge.access import Reader, Svc
from scaletune.serve.jobs.archive import members, tar_stream
from scaletune.serve.jobs.states import ACTIVE, CHECKING, NEEDS_SECRETS, QUEUED, STARTING

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# A job in these states has run nothing yet (unless resumed: then its run directory is there).
NOT_STARTED = (CHECKING, QUEUED, NEEDS_SECRETS, STARTING)
router = APIRouter()


class Refused(Exception):
    """A request the job's state or files refuse: answered as `schemas.refusal`."""

    def __init__(self, title: str, problems: list[str], status: int = 409) -> None:
        super().__init__(title)
        self.title, self.problems, self.status = title, problems, status


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


def run_dir_here(job) -> Path:
    """The job's run directory on this machine.

    Raises:
        Refused: it is not there yet (the job has not started), or not here (a Modal job's files
            are on its volume).
    """
    run_dir = Path(job.run_dir)
    if not run_dir.is_dir() and job.state in NOT_STARTED:
        raise Refused(
            f"job {job.id} has not started yet",
            [f"job {job.id} is {job.state}: it has not started yet; its models are here once it has run"],
        )
    if not run_dir.is_dir():
        where = "on Modal's volume, not on this machine" if job.target == "modal" else "not on this machine"
        raise Refused("the run's files are not here", [f"job {job.id}: its run directory {run_dir} is {where}"])
    return run_dir


def not_running(job) -> None:
    if job.state in ACTIVE or job.state == QUEUED:
        raise Refused(
            f"job {job.id} is {job.state}",
            [
                f"job {job.id} is {job.state}: its model is talked to, evaluated and exported once it has ended (stop it or wait)"
            ],
        )


def entry(run_dir: Path, name: str, tops: tuple[str, ...]) -> Path:
    """The folder `name` names (`final`, or `TOP/NAME` for TOP in `tops`) inside the run directory.

    Raises:
        Refused: anything else (another job's folder, `..`, a link out of the run), or missing.
    """
    rel = posixpath.normpath(name) if name and "\x00" not in name and "\\" not in name else ""
    parts = rel.split("/")
    ok = rel == "final" or (len(parts) == 2 and parts[0] in tops and NAME.fullmatch(parts[1]) and parts[1] != "latest")
    if not ok:
        raise Refused(
            "not one of this job's models",
            [f"{name!r}: give final or {' / '.join(t + '/NAME' for t in tops)} of this job"],
        )
    folder, top = run_dir / rel, _real(run_dir / parts[0])
    real = _real(folder)
    if not (top.is_relative_to(_real(run_dir)) and real.is_relative_to(top)) or not real.is_dir():
        raise Refused("not one of this job's models", [f"{name}: no such folder in this job's run directory"], 404)
    if parts[0] == "checkpoints" and not (folder / "progress.json").is_file():
        raise Refused("not one of this job's models", [f"{name}: not a checkpoint (no progress.json)"])
    return folder


def offered(run_dir: Path) -> dict:
    """The job's models (final, each checkpoint) and exports, by their names in the run directory."""
    models = ["final"] if (run_dir / "final").is_dir() else []
    ck, ex = run_dir / "checkpoints", run_dir / "exports"
    steps = [p for p in ck.iterdir() if p.is_dir() and (p / "progress.json").is_file()] if ck.is_dir() else []
    steps.sort(key=lambda p: int(p.name.rsplit("-", 1)[-1]) if p.name.rsplit("-", 1)[-1].isdigit() else -1)
    models += [f"checkpoints/{p.name}" for p in steps if NAME.fullmatch(p.name)]
    exports = (
        sorted(f"exports/{p.name}" for p in ex.iterdir() if p.is_dir() and NAME.fullmatch(p.name))
        if ex.is_dir()
        else []
    )
    return {"models": models, "exports": exports}


async def refused(request: Request, exc: Refused) -> JSONResponse:
    """The app's handler of :class:`Refused`."""
    return refusal(exc.title, exc.problems, exc.status)


def model_target(job, checkpoint: str) -> tuple[Path, Path]:
    """(what scaletune.inference loads: the run directory for final/, else the checkpoint; the run directory)."""
    not_running(job)
    run_dir = run_dir_here(job)
    folder = entry(run_dir, checkpoint, ("checkpoints",))
    return (run_dir if checkpoint == "final" else folder), run_dir


@router.get("/api/jobs/{job_id}/models", tags=["results"], responses=E422)
def models(job_id: str, c: Reader, svc: Svc):
    """The models of the job to chat with, evaluate or export (`final`, `checkpoints/step-N`), its
    exports, and why none can be used now (`refused`: not started yet, running, files not here),
    or null."""
    job = job_or_404(svc, job_id)
    try:
        run_dir = run_dir_here(job)
    except Refused as exc:
        return {"models": [], "exports": [], "refused": exc.problems[0]}
    try:
        not_running(job)
        why = None
    except Refused as exc:
        why = exc.problems[0]
    return {**offered(run_dir), "refused": why}


@router.get("/api/jobs/{job_id}/samples", tags=["results"], responses=E422)
def samples(job_id: str, c: Reader, svc: Svc):
    """samples.jsonl of the run (training.sample_prompts answered before and after training):
    `{prompt, base, trained}` rows; [] when the run has none (or its files are not here)."""
    job = job_or_404(svc, job_id)
    path = Path(job.run_dir) / "samples.jsonl"
    if not path.is_file() or not _real(path).is_relative_to(_real(Path(job.run_dir))):
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append({k: str(row[k]) for k in ("prompt", "base", "trained") if k in row})
    return rows


@router.get("/api/jobs/{job_id}/archive/{path:path}", tags=["results"], responses=E409_422)
def archive(job_id: str, path: str, c: Reader, svc: Svc):
    """final/, checkpoints/NAME or exports/NAME of the run as one tar file, streamed as it is
    read (named JOB-PATH.tar); links inside are followed only where they stay in the run."""
    job = job_or_404(svc, job_id)
    run_dir = run_dir_here(job)
    folder = entry(run_dir, path, ("checkpoints", "exports"))
    name = f"{job.id}-{posixpath.normpath(path).replace('/', '-')}.tar"
    headers = {"content-disposition": f'attachment; filename="{quote(name)}"'}
    return StreamingResponse(tar_stream(members(folder, run_dir)), media_type="application/x-tar", headers=headers)
