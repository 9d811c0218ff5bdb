"""The data routes: list the data area, upload a file into it (the request body streamed to disk,
counted against `max_upload_bytes`), preview a file as training renders it, delete one (its uploader
or an admin). The data area itself is `jobs/datasets.py`; the preview `jobs/data_preview.py`."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
import asyncio
import hashlib
import json
import os
import secrets
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.requests import ClientDisconnect

from scaletune.errors import UserError
from scaletune.serve.api.schemas import E409_422, E422, Deleted, refusal
from scaletune.serve.edge.access import Submitter, Svc, read
from scaletune.serve.edge.policy import data_area
from scaletune.serve.edge.teams import record
from scaletune.serve.jobs import removal
from scaletune.serve.jobs.data_formats import detect_file
from scaletune.serve.jobs.datasets import (
    META,
    area_file,
    check_file,
    file_entry,
    is_image,
    listing,
    place,
    stored_name,
)

E413_422 = {**E422, 413: {"description": "the file is over max_upload_bytes, or the data area over max_data_bytes"}}
router = APIRouter()


class PreviewRequest(BaseModel):
    file: str = Field(description="a file of the data area (GET /api/data), by name")
    config: str = Field("", description="the YAML config: model (its tokenizer) and data (format, template, length)")
    records: int = Field(5, ge=1, le=50, description="how many of the first records to render")


@router.get("/api/data", dependencies=[read], tags=["data"])
def list_data(svc: Svc):
    """The uploaded data files: name, size (bytes), records, `path`, what a config's
    `data.train.path` names, `format`, the `data.train.format` whose keys its first record has
    (null: no format's; `image` for an image, whose records are null), and `by`, the token that
    uploaded it (null: not recorded)."""
    return listing(svc.home)


@router.post("/api/data", status_code=201, tags=["data"], responses=E413_422)
async def upload_data(request: Request, c: Submitter, svc: Svc, name: Annotated[str, Query(max_length=1024)]):
    """Store the request body as the data file `name` (JSON, JSONL, CSV or Parquet) in the data
    area, or as an image its records name (PNG, JPEG, WebP: `{"type": "image", "path": "name.png"}`
    in a vision-language model's chat records, the path relative to the records' file). 201 with the
    file's entry (`name` may carry a suffix `-2` when that name holds other bytes); 200 with the
    existing entry when the same bytes are there already under that name; 413 over the admin's
    `max_upload_bytes`; 422 for a refused name or a file that does not parse (the file and line
    named)."""
    clean, why = stored_name(name)
    if why:
        return refusal("upload refused", [why])
    area = data_area(svc.home)
    area.mkdir(mode=0o700, exist_ok=True)
    # The quota counts every file of the area, uploads under way included (their temporary files).
    room = svc.policy.max_data_bytes - sum(f.stat().st_size for f in area.iterdir() if f.is_file())
    limit = min(svc.policy.max_upload_bytes, max(room, 0))
    tmp = area / f".upload-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    h, size = hashlib.sha256(), 0
    try:
        with os.fdopen(fd, "wb") as f:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    if limit < svc.policy.max_upload_bytes:
                        why = (
                            f"{name}: the data area's files take {svc.policy.max_data_bytes - room:,} of its "
                            f"{svc.policy.max_data_bytes:,} bytes, and this file is larger than the rest "
                            "(admin setting: max_data_bytes, PUT /api/admin/policy)"
                        )
                    else:
                        why = (
                            f"{name}: over {limit / 2**20:g} MiB, the largest data file this service takes "
                            "(admin setting: max_upload_bytes, PUT /api/admin/policy)"
                        )
                    return refusal("upload refused", [why], 413)
                h.update(chunk)
                f.write(chunk)
        try:
            records = await asyncio.to_thread(check_file, tmp, clean)
        except UserError as exc:
            return refusal(f"{name}: not a readable data file", exc.problems)
        path, fresh = place(tmp, clean, h.hexdigest())
        if fresh:
            fmt = "image" if is_image(path.name) else detect_file(path)
            meta = {"records": records, "sha256": h.hexdigest(), "by": c.name, "format": fmt}
            path.with_name(META.format(path.name)).write_text(json.dumps(meta))
            record(svc.Session, c.name, "data.upload", detail=f"{path.name} {size} bytes")
        return JSONResponse(file_entry(path), status_code=201 if fresh else 200)
    except ClientDisconnect:
        return JSONResponse({"detail": "the upload ended before its last byte"}, status_code=400)
    finally:
        tmp.unlink(missing_ok=True)


@router.delete("/api/data/{name}", response_model=Deleted, tags=["data"], responses=E409_422)
def delete_data(name: str, c: Submitter, svc: Svc):
    """Delete the data file `name` from the data area: its uploader (`by` in GET /api/data) or an
    admin; a file uploaded before uploaders were recorded, any submit token. 409 while a job that
    has not ended names its path; 404 for a name the area does not hold. Audited (`data.delete`)."""
    try:
        by = file_entry(area_file(svc.home, name)).get("by")
    except UserError:
        raise HTTPException(404, f"no data file {name!r} in the data area (GET /api/data lists them)") from None
    if c.scope != "admin" and by and by != c.name:
        raise HTTPException(
            403, f"data file {name} was uploaded by {by}: only its uploader or an admin token may delete it"
        )
    try:
        out = removal.delete_data(svc, name)
    except removal.Missing as exc:
        raise HTTPException(404, str(exc)) from None
    except UserError as exc:
        return refusal(exc.title, exc.problems, 409)
    record(svc.Session, c.name, "data.delete", detail=f"{name} (uploaded by {by or '-'})")
    return out.public()


@router.post("/api/data/preview", tags=["data"], responses=E422)
def preview_data(req: PreviewRequest, c: Submitter, svc: Svc):
    """The first `records` records of an uploaded file rendered as training renders them (the
    config's model's tokenizer, format, prompt format or chat template, max_seq_length), each
    with its tokens and which are trained; a token-length histogram and the counts that
    max_seq_length truncates and drops, over the first records (at most 5,000, as many as
    about 5 s allow: `measured` says how many).
    503 while two previews are already rendering (try again).
    422 with every problem, each naming its key (`model.name_or_path`, `data.train.format`,
    ...) or the file."""
    from scaletune.serve.jobs.data_preview import PREVIEW_SLOTS, preview

    # At most PREVIEW_SLOTS previews at once; another is answered 503 at once instead of holding a
    # request thread while it waits (44 previews of a template that loops for its 10 s bound each
    # took every thread, and /healthz with them: issue 34).
    if not PREVIEW_SLOTS.acquire(blocking=False):
        return JSONResponse(
            {"detail": "every preview slot is busy (other previews are rendering); try again in a few seconds"},
            status_code=503,
            headers={"Retry-After": "5"},
        )
    try:
        path = area_file(svc.home, req.file)
        return preview(svc, path, req.config, req.records)
    except UserError as exc:
        return refusal(exc.title, exc.problems)
    finally:
        PREVIEW_SLOTS.release()
