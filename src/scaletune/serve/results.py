"""Talk to the result and ship it: chat with a run's model, evaluate and export it as small tasks,
download final/ or a checkpoint as one archive.

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
from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse

from scaletune.serve import auth
from scaletune.serve import policy as P
from scaletune.serve.archive import members, tar_stream
from scaletune.serve.chatting import ModelSlot, answer
from scaletune.serve.jobs import JobNotFound
from scaletune.serve.schemas import problems_responses, refusal
from scaletune.serve.states import ACTIVE, QUEUED
from scaletune.serve.tasks import Busy, Task, Tasks, fresh, last_json, stamp
from scaletune.serve.teams import need_owner, record

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
E409_422 = problems_responses(409, 422)
E422 = problems_responses(422)


class Refused(Exception):
    """A request the job's state or files refuse: answered as `schemas.refusal`."""

    def __init__(self, title: str, problems: list[str], status: int = 409) -> None:
        super().__init__(title)
        self.title, self.problems, self.status = title, problems, status


class Turn(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=32_000)


class ChatRequest(BaseModel):
    checkpoint: str = Field("final", max_length=300, description="final, or checkpoints/step-N of this job.")
    messages: list[Turn] = Field(
        min_length=1, max_length=200, description="The conversation; the last turn is the user's."
    )
    max_new_tokens: int = Field(128, ge=1, le=2048)
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0: greedy.")
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    seed: int = Field(0, ge=0, le=2**31)


class EvalRequest(BaseModel):
    data: str = Field(
        min_length=1, max_length=4096, description="A data file, folder or data set name (as data.train.path)."
    )
    checkpoint: str = Field("final", max_length=300)
    format: Literal["alpaca", "messages", "text"] | None = Field(None, description="Default: the run's.")
    max_seq_length: int | None = Field(None, ge=8, le=1 << 20)


class ExportRequest(BaseModel):
    checkpoint: str = Field(
        "final", max_length=300, description="final (the run's last checkpoint) or checkpoints/step-N."
    )
    format: Literal["hf", "gguf"] = "hf"
    merge_lora: bool = False
    dtype: Literal["bfloat16", "float16", "float32"] | None = None
    gguf_type: Literal["f16", "bf16", "q8_0", "f32"] | None = None


def _real(p: Path) -> Path:
    return Path(os.path.realpath(p))


def run_dir_here(job) -> Path:
    """The job's run directory on this machine.

    Raises:
        Refused: it is not here (a Modal job's files are on its volume).
    """
    run_dir = Path(job.run_dir)
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


def add_result_routes(app: FastAPI, svc, need) -> None:
    """`need(scope)` is the app's scope-check dependency factory ("read", "submit", "admin")."""
    Reader = Annotated[auth.Caller, Depends(need("read"))]  # noqa: N806
    Submitter = Annotated[auth.Caller, Depends(need("submit"))]  # noqa: N806
    slot, tasks = ModelSlot(), Tasks()
    app.state.model_slot, app.state.tasks = slot, tasks

    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            yield state
        tasks.stop_all()  # a task is the service's child: it ends with it

    app.router.lifespan_context = lifespan

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        return refusal(exc.title, exc.problems, exc.status)

    def job_of(job_id: str):
        job = svc.get(job_id)
        if job is None:
            raise JobNotFound(job_id)
        return job

    def model_target(job, checkpoint: str) -> tuple[Path, Path]:
        """(what scaletune.inference loads: the run directory for final/, else the checkpoint; the run directory)."""
        not_running(job)
        run_dir = run_dir_here(job)
        folder = entry(run_dir, checkpoint, ("checkpoints",))
        return (run_dir if checkpoint == "final" else folder), run_dir

    @app.get("/api/jobs/{job_id}/models", tags=["results"], responses=E422)
    def models(job_id: str, c: Reader):
        """The models of the job to chat with, evaluate or export (`final`, `checkpoints/step-N`), its
        exports, and why none can be used now (`refused`: running, files not here), or null."""
        job = job_of(job_id)
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

    @app.post("/api/jobs/{job_id}/chat", tags=["results"], responses=E409_422)
    async def chat(job_id: str, req: ChatRequest, request: Request, c: Submitter):
        """The model's next turn in `messages`, streamed as server-sent events: `model` (what was
        loaded), `token` ({"text"}) as the tokens arrive, then `done` ({"answer"}: the whole turn) or
        `error`. 409: the job runs, its files are not here, the checkpoint is not one of its, or
        the model cannot be loaded."""
        from scaletune.inference import Sampling

        job = job_of(job_id)
        target, _ = model_target(job, req.checkpoint)
        if req.messages[-1].role != "user":
            raise Refused("invalid request", ["messages: the last turn is the user's"], 422)
        record(svc.Session, c.name, "job.chat", job_id, req.checkpoint)
        sampling = Sampling(
            max_new_tokens=req.max_new_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed
        )
        turns = [t.model_dump() for t in req.messages]
        (kind, value), q, gone = await answer(slot, target, turns, sampling)
        if kind == "refused":
            raise Refused("the model cannot be loaded", value.problems)
        if kind == "error":
            return JSONResponse({"detail": f"the model cannot be loaded: {value}"}, status_code=500)

        async def events():
            try:
                yield {"event": "model", "data": json.dumps({"model": value, "checkpoint": req.checkpoint})}
                while True:
                    what, data = await q.get()
                    if what == "token":
                        yield {"event": "token", "data": json.dumps({"text": data})}
                    elif what == "done":
                        yield {"event": "done", "data": json.dumps({"answer": data})}
                        return
                    else:
                        yield {"event": "error", "data": json.dumps({"detail": str(data)})}
                        return
            finally:
                gone.set()  # the client left (or the answer ended): stop generating

        return EventSourceResponse(events(), ping=15)

    @app.get("/api/jobs/{job_id}/samples", tags=["results"], responses=E422)
    def samples(job_id: str, c: Reader):
        """samples.jsonl of the run (training.sample_prompts answered before and after training):
        `{prompt, base, trained}` rows; [] when the run has none (or its files are not here)."""
        job = job_of(job_id)
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

    @app.get("/api/jobs/{job_id}/tasks", tags=["results"], responses=E422)
    def list_tasks(job_id: str, c: Reader):
        """The job's evaluate and export tasks, newest first: state running, succeeded or failed
        (with the tail of its output), and the result."""
        job_of(job_id)
        return tasks.list(job_id)

    def start(c, job, kind: str, what: str, args: list[str], finish) -> dict:
        try:
            task = tasks.start(svc.files(job), kind, what, args, finish)
        except Busy as exc:
            raise Refused("a task is running", [str(exc)]) from None
        record(svc.Session, c.name, f"job.{kind}", job.id, what)
        return task.public()

    @app.post("/api/jobs/{job_id}/tasks/eval", status_code=202, tags=["results"], responses=E409_422)
    def start_eval(job_id: str, req: EvalRequest, c: Submitter):
        """Evaluate a model of the job on a data set (`scaletune eval --data`: loss and perplexity
        over the tokens training would train); the result is written to the run's
        eval/data-TIME.json. The data path is checked as a submitted config's data."""
        job = job_of(job_id)
        need_owner(c, job)
        target, run_dir = model_target(job, req.checkpoint)
        places = P.Places(jobs_home=svc.home, job_dir=Path(job.job_dir), db_file=svc.db_file, workdir=svc.workdir)
        problems, _ = P.check({"data": {"train": {"path": req.data}}}, svc.policy, places)
        if problems:
            raise Refused(
                "refused by the service's policy", [p.replace("data.train.path", "data") for p in problems], 422
            )
        args = ["eval", str(target), "--data", req.data, "--json"]
        args += ["--format", req.format] if req.format else []
        args += ["--max-seq-length", str(req.max_seq_length)] if req.max_seq_length else []

        def finish(task: Task, stdout: str) -> dict:
            result = last_json(stdout)
            out = fresh(run_dir / "eval" / f"data-{stamp()}.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            written = {"format": "data", "data": req.data, "model": req.checkpoint, **result}
            out.write_text(json.dumps(written, indent=2) + "\n")
            return {**written, "file": f"eval/{out.name}"}

        return start(c, job, "eval", f"{req.checkpoint} on {req.data}", args, finish)

    @app.post("/api/jobs/{job_id}/tasks/export", status_code=202, tags=["results"], responses=E409_422)
    def start_export(job_id: str, req: ExportRequest, c: Submitter):
        """Export a checkpoint of the job (`scaletune export`; `final`: the run's last checkpoint)
        into the run's exports/NAME: a Hugging Face folder (LoRA merged or not, a dtype) or a GGUF
        file; then downloadable as an archive."""
        from scaletune.checkpoint.save import latest_checkpoint

        job = job_of(job_id)
        need_owner(c, job)
        _, run_dir = model_target(job, req.checkpoint)
        problems = []
        if req.format == "gguf" and (req.dtype or req.merge_lora):
            problems.append("a GGUF export is always merged; its weights type is gguf_type, not dtype")
        if req.format == "hf" and req.gguf_type:
            problems.append("gguf_type applies to format gguf")
        if problems:
            raise Refused("invalid request", problems, 422)
        source = latest_checkpoint(run_dir) if req.checkpoint == "final" else run_dir / req.checkpoint
        if source is None:
            raise Refused(
                "nothing to export",
                ["this run kept no checkpoint; its final/ is a Hugging Face folder already: download it"],
            )
        kind = f"gguf-{req.gguf_type or 'f16'}" if req.format == "gguf" else ("merged" if req.merge_lora else "hf")
        out = fresh(run_dir / "exports" / f"{source.name}-{kind}-{req.dtype or 'as-trained'}-{stamp()}")
        args = ["export", str(source), "-o", str(out), "--format", req.format]
        args += ["--merge-lora"] if req.merge_lora else []
        args += ["--dtype", req.dtype] if req.dtype else []
        args += ["--gguf-type", req.gguf_type] if req.gguf_type else []
        rel = f"exports/{out.name}"

        def finish(task: Task, stdout: str) -> dict:
            return {"path": rel, "archive": f"api/jobs/{job_id}/archive/{rel}"}

        return start(c, job, "export", f"{source.name} -> {rel}", args, finish)

    @app.get("/api/jobs/{job_id}/archive/{path:path}", tags=["results"], responses=E409_422)
    def archive(job_id: str, path: str, c: Reader):
        """final/, checkpoints/NAME or exports/NAME of the run as one tar file, streamed as it is
        read (named JOB-PATH.tar); links inside are followed only where they stay in the run."""
        job = job_of(job_id)
        run_dir = run_dir_here(job)
        folder = entry(run_dir, path, ("checkpoints", "exports"))
        name = f"{job.id}-{posixpath.normpath(path).replace('/', '-')}.tar"
        headers = {"content-disposition": f'attachment; filename="{quote(name)}"'}
        return StreamingResponse(tar_stream(members(folder, run_dir)), media_type="application/x-tar", headers=headers)
