"""A run's files (its allow-list of artifacts) as attachments, from the run directory or a Modal
volume; nothing outside the allow-list, `..` and links resolved before it is checked."""

# No `from __future__ import annotations`: FastAPI reads the route's signature at definition.
import mimetypes
import posixpath
from urllib.parse import quote

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, StreamingResponse

from scaletune.serve.api.jobs import job_or_404
from scaletune.serve.api.schemas import E422
from scaletune.serve.edge.access import Svc, read
from scaletune.serve.jobs.dispatch.base import ArtifactMissing, ArtifactUnreachable

ARTIFACTS = (
    *("final", "loss.png", "metrics.jsonl", "config.yaml", "plan.json", "memory.json", "checkpoints", "eval"),
    *("samples.md", "samples.jsonl", "exports", "rollouts.jsonl"),
)
router = APIRouter()


@router.get(
    "/api/jobs/{job_id}/artifacts/{path:path}",
    dependencies=[read],
    responses={**E422, 502: {"description": "Modal's volume could not be asked: where it is, how to fetch it"}},
)
def artifact(job_id: str, path: str, svc: Svc):
    """A file of the run's allow-list (or a listing of a folder of it), as an attachment: read
    from the run directory, or from the Modal volume for a Modal job (502, naming the volume,
    the path and the `modal volume get` command, when Modal cannot be asked)."""
    job = job_or_404(svc, job_id)
    if "\x00" in path or "\\" in path:
        raise HTTPException(404, "not an artifact of this run")
    rel = posixpath.normpath(path)  # `final/../X` is `X`: the allow-list sees what is served
    # The allow-list, here only and before any target is asked: dispatchers get `rel` checked.
    if rel.startswith(("/", "..")) or rel.split("/")[0] not in ARTIFACTS:
        raise HTTPException(404, "not an artifact of this run")
    try:
        found = svc.dispatchers[job.target].artifact(svc.files(job), job.run_dir, rel)
    except ArtifactMissing as exc:
        raise HTTPException(404, str(exc)) from None
    except ArtifactUnreachable as exc:
        raise HTTPException(502, str(exc)) from None
    if isinstance(found, list):
        return found
    if found.path is not None:
        return FileResponse(found.path, filename=found.name, content_disposition_type="attachment")
    name = quote(found.name)  # as FileResponse words it
    disposition = f'attachment; filename="{name}"' if name == found.name else f"attachment; filename*=utf-8''{name}"
    headers = {"content-disposition": disposition}
    if found.size is not None:
        headers["content-length"] = str(found.size)
    kind = mimetypes.guess_type(found.name)[0] or "application/octet-stream"
    return StreamingResponse(found.chunks, media_type=kind, headers=headers)
