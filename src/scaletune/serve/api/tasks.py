"""Evaluate and export a run's model as small tasks (`jobs/tasks.py`, on `app.state.tasks`, recorded
in the job database): they write into the run's folder (eval/, exports/), so they need its owner or
an admin, as stop and resume do, and so does deleting an export; listing them needs a read token."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
import json
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, Field

from scaletune.errors import UserError, texts
from scaletune.serve.api.jobs import job_or_404
from scaletune.serve.api.results import Refused, model_target
from scaletune.serve.api.schemas import E409_422, E422, Deleted
from scaletune.serve.edge import auth
from scaletune.serve.edge import policy as P
from scaletune.serve.edge.access import Reader, Submitter, Svc
from scaletune.serve.edge.teams import need_owner, record
from scaletune.serve.jobs import removal
from scaletune.serve.jobs.datasets import check_eval_data, is_area_name
from scaletune.serve.jobs.service import JobService
from scaletune.serve.jobs.tasks import Busy, Task, Tasks, fresh, last_json, stamp

router = APIRouter()

#: An export's upload without a token for the job's owner: (message, fix), naming no value.
NO_TOKEN = (
    "no Hugging Face token for this job's owner",
    "the operator maps one: scaletune serve --job-secret OWNER:HF_TOKEN=VAR, the token in the service's environment "
    "as VAR",
)


class EvalRequest(BaseModel):
    data: str = Field(
        min_length=1,
        max_length=4096,
        description="A file of the data area by its name (GET /api/data), or the path of a local data file or "
        "folder under the service's read roots.",
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
    verify: bool | None = Field(
        None,
        description="Load the export in a fresh process in the runtime it is for and compare it with the "
        "checkpoint (`scaletune export --verify`): a Hugging Face folder through transformers (peft for an "
        "adapter), its logits, and a model folder in vLLM where the service has it (SCALETUNE_VLLM_PYTHON); a "
        "GGUF file in llama.cpp (the service needs `scaletune[llamacpp]`), the log-probabilities of its "
        "greedy continuation of a probe. An export that fails is not kept. Default: "
        "on for format hf, off for gguf.",
    )
    push_to_hub: str | None = Field(
        None,
        max_length=200,
        description="Then upload the export to this Hugging Face Hub model repo, OWNER/NAME (created private if "
        "it does not exist; `scaletune export --push-to-hub`). The Hub token is never sent here: it is the "
        "HF_TOKEN the operator maps to the job's owner (`scaletune serve --job-secret OWNER:HF_TOKEN=VAR`, "
        "OWNER * for every owner): a variable of the service's environment, never stored, shown or recorded. "
        "Without one the request is refused (a job's own submitted secrets end with it).",
    )


def task_runner(request: Request) -> Tasks:
    """The app's tasks (`app.state.tasks`)."""
    return request.app.state.tasks


Runner = Annotated[Tasks, Depends(task_runner)]


@router.get("/api/jobs/{job_id}/tasks", tags=["results"], responses=E422)
def list_tasks(job_id: str, c: Reader, svc: Svc, tasks: Runner):
    """The job's evaluate and export tasks, newest first, kept across service restarts: state
    running, succeeded, failed or interrupted (its service stopped while it ran), with the tail of
    its output when it failed or was interrupted, who started it, and the result."""
    job_or_404(svc, job_id)
    return tasks.list(job_id)


def start(svc: JobService, tasks: Tasks, c: auth.Caller, job, kind: str, what: str, args: list[str], finish) -> dict:
    try:
        listed = tasks.start(svc.files(job), kind, what, args, finish, owner=c.name)
    except Busy as exc:
        raise Refused("a task is running", [str(exc)]) from None
    record(svc.Session, c.name, f"job.{kind}", job.id, what)
    return listed


@router.post("/api/jobs/{job_id}/tasks/eval", status_code=202, tags=["results"], responses=E409_422)
def start_eval(job_id: str, req: EvalRequest, c: Submitter, svc: Svc, tasks: Runner):
    """Evaluate a model of the job on a data set (`scaletune eval --data`: loss and perplexity
    over the tokens training would train); the result is written to the run's
    eval/data-TIME.json. `data` is a file of the data area by its name, or a local path checked
    as a submitted config's data is (the read roots). Before the task starts the file must
    exist, be readable by the service and its first records be of the format evaluated (`format`,
    else the run's): otherwise 422 naming every problem, and no task."""
    job = job_or_404(svc, job_id)
    need_owner(c, job)
    target, run_dir = model_target(job, req.checkpoint)
    path = eval_path(svc, job, req, run_dir)
    args = ["eval", str(target), "--data", str(path), "--json"]
    args += ["--format", req.format] if req.format else []
    args += ["--max-seq-length", str(req.max_seq_length)] if req.max_seq_length else []

    def finish(task: Task, stdout: str) -> dict:
        result = last_json(stdout)
        out = fresh(run_dir / "eval" / f"data-{stamp()}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        written = {"format": "data", "data": req.data, "model": req.checkpoint, **result}
        out.write_text(json.dumps(written, indent=2) + "\n")
        return {**written, "file": f"eval/{out.name}"}

    return start(svc, tasks, c, job, "eval", f"{req.checkpoint} on {req.data}", args, finish)


def eval_path(svc: JobService, job, req: EvalRequest, run_dir: Path) -> Path:
    """The file `req.data` names, checked (`jobs/datasets.check_eval_data`); a path outside the data area
    is first checked against the policy's read roots, as a submitted config's data.

    Raises:
        Refused: 422 with every problem.
    """
    if not is_area_name(req.data):
        places = P.Places(jobs_home=svc.home, job_dir=Path(job.job_dir), db_file=svc.db_file, workdir=svc.workdir)
        problems, _ = P.check({"data": {"train": {"path": req.data}}}, svc.policy, places)
        if problems:
            raise Refused(
                "refused by the service's policy", [p.replace("data.train.path", "data") for p in problems], 422
            )
    path, problems = check_eval_data(req.data, req.format, run_dir, svc.home, svc.workdir)
    if path is None:
        raise Refused("the data to evaluate on cannot be used", problems, 422)
    return path


@router.post("/api/jobs/{job_id}/tasks/export", status_code=202, tags=["results"], responses=E409_422)
def start_export(job_id: str, req: ExportRequest, c: Submitter, svc: Svc, tasks: Runner):
    """Export a checkpoint of the job (`scaletune export`; `final`: the run's last checkpoint)
    into the run's exports/NAME: a Hugging Face folder (LoRA merged or not, a dtype; verified in a
    fresh process unless `verify` is false) or a GGUF file; then downloadable as an archive."""
    from scaletune.checkpoint.save import latest_checkpoint

    job = job_or_404(svc, job_id)
    need_owner(c, job)
    _, run_dir = model_target(job, req.checkpoint)
    problems = []
    if req.format == "gguf" and (req.dtype or req.merge_lora):
        problems.append("a GGUF export is always merged; its weights type is gguf_type, not dtype")
    if req.format == "hf" and req.gguf_type:
        problems.append("gguf_type applies to format gguf")
    if req.format == "gguf" and req.verify:
        from scaletune.checkpoint.verify_gguf import require_llamacpp

        try:
            require_llamacpp()
        except RuntimeError as exc:
            problems.append(f"verify: {exc}")
    verify = req.format == "hf" if req.verify is None else req.verify
    if req.push_to_hub is not None:
        from scaletune.checkpoint.hub import push_problems

        # The token the task will hold: the operator's `--job-secret` mapping for the job's owner.
        has_token = bool(svc.files(job).env.get("HF_TOKEN"))
        problems += texts(
            push_problems(
                req.push_to_hub, option="push_to_hub", check="push to the Hub", has_token=has_token, no_token=NO_TOKEN
            )
        )
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
    args += ["--verify"] if verify else []
    args += ["--push-to-hub", req.push_to_hub] if req.push_to_hub else []
    rel = f"exports/{out.name}"

    def finish(task: Task, stdout: str) -> dict:
        # A folder that fails the check is not kept and the task fails: a result means it passed.
        result = {"path": rel, "archive": f"api/jobs/{job_id}/archive/{rel}", "verified": verify}
        if req.push_to_hub:
            # The export printed its folder, then the Hub's commit URL (a link on the page: http(s) only).
            lines = stdout.strip().splitlines()
            url = lines[-1] if len(lines) > 1 and lines[-1].startswith(("https://", "http://")) else None
            result |= {"pushed_to": req.push_to_hub, "commit_url": url}
        return result

    return start(svc, tasks, c, job, "export", f"{source.name} -> {rel}", args, finish)


@router.delete("/api/jobs/{job_id}/exports/{name}", response_model=Deleted, tags=["results"], responses=E409_422)
def delete_export(job_id: str, name: str, c: Submitter, svc: Svc, tasks: Runner):
    """Delete the export `exports/NAME` of the job's run folder (its owner or an admin); the export
    task that made it is then listed with `deleted` and the export is no longer offered. 409 while a
    task of the job runs, or for a Modal job (its exports are on its volume). Audited
    (`export.delete`)."""
    job = job_or_404(svc, job_id)
    need_owner(c, job)
    tasks.sweep()  # a task a stopped service left `running` holds nothing
    try:
        out = removal.delete_export(svc, job, name)
    except removal.Missing as exc:
        raise HTTPException(404, str(exc)) from None
    except UserError as exc:
        raise Refused(exc.title, exc.problems) from None
    record(svc.Session, c.name, "export.delete", job_id, f"exports/{name}: {out.summary()}")
    return out.public()
