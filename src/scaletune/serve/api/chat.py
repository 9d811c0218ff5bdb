"""Chat with a run's model, or with the model it was trained from (`model: base`, for the page's side
by side): its next turn streamed as server-sent events. Needs submit (it costs compute) but not the
job's ownership (it changes nothing); the model is the service's one chat model
(`jobs/chatting.py`, on `app.state.model_slot`)."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
import json
from pathlib import Path
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse

from scaletune.errors import UserError
from scaletune.serve.api.jobs import job_or_404
from scaletune.serve.api.results import Refused, model_target
from scaletune.serve.api.schemas import E409_422
from scaletune.serve.edge import policy as P
from scaletune.serve.edge.access import Submitter, Svc
from scaletune.serve.edge.teams import record
from scaletune.serve.jobs.chatting import Choice, answer, base, tuned
from scaletune.serve.jobs.service import JobService

router = APIRouter()


class Turn(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=32_000)


class ChatRequest(BaseModel):
    checkpoint: str = Field("final", max_length=300, description="final, or checkpoints/step-N of this job.")
    messages: list[Turn] = Field(
        min_length=1,
        max_length=200,
        description="The conversation; the last turn is the user's. A first `system` turn is the system prompt "
        "(seen by a model prompted with a chat template; an Alpaca or plain-text prompt has no place for it).",
    )
    model: Literal["tuned", "base"] = Field(
        "tuned",
        description="tuned: the job's model (final or the checkpoint); base: the model the run started from, "
        "prompted as the run was (a LoRA run's adapter switched off; a full run's model.name_or_path).",
    )
    max_new_tokens: int = Field(128, ge=1, le=2048)
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0: greedy.")
    top_p: float = Field(0.9, gt=0.0, le=1.0)
    seed: int = Field(0, ge=0, le=2**31)


def base_choice(svc: JobService, job, target: Path) -> Choice:
    """The base of the job's run (`chatting.base`), its local model paths checked against the
    service's policy as a submitted config's are (the run's config.yaml is the run's own file).

    Raises:
        Refused: 409 naming why the base cannot be loaded.
    """
    try:
        choice = base(target)
    except UserError as exc:
        raise Refused("the base model cannot be loaded", exc.problems) from None
    places = P.Places(jobs_home=svc.home, job_dir=Path(job.job_dir), db_file=svc.db_file, workdir=svc.workdir)
    problems, _ = P.check({"model": choice.reads}, svc.policy, places)
    if problems:
        raise Refused("the base model cannot be loaded", problems)
    return choice


@router.post("/api/jobs/{job_id}/chat", tags=["results"], responses=E409_422)
async def chat(job_id: str, req: ChatRequest, request: Request, c: Submitter, svc: Svc):
    """The model's next turn in `messages`, streamed as server-sent events: `model` (what was
    loaded), `token` ({"text"}) as the tokens arrive, then `done` ({"answer"}: the whole turn) or
    `error`. `model: base` answers with the model the run started from. 409: the job runs, its
    files are not here, the checkpoint is not one of its, or the model (or its base) cannot be
    loaded."""
    from scaletune.inference import Sampling

    job = job_or_404(svc, job_id)
    target, _ = model_target(job, req.checkpoint)
    if req.messages[-1].role != "user":
        raise Refused("invalid request", ["messages: the last turn is the user's"], 422)
    choice = tuned(target) if req.model == "tuned" else base_choice(svc, job, target)
    record(svc.Session, c.name, "job.chat", job_id, req.checkpoint + (" (base)" if req.model == "base" else ""))
    sampling = Sampling(max_new_tokens=req.max_new_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed)
    turns = [t.model_dump() for t in req.messages]
    (kind, value), q, gone = await answer(request.app.state.model_slot, choice, turns, sampling)
    if kind == "refused":
        too_long = value.title == "conversation too long"
        raise Refused(
            value.title if too_long else "the model cannot be loaded", value.problems, 422 if too_long else 409
        )
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
