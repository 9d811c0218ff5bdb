"""Chat with a run's model: its next turn streamed as server-sent events. Needs submit (it costs
compute) but not the job's ownership (it changes nothing); the model is the service's one chat
model (`jobs/chatting.py`, on `app.state.model_slot`)."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
import json
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse

from scaletune.serve.api.jobs import job_or_404
from scaletune.serve.api.results import Refused, model_target
from scaletune.serve.api.schemas import E409_422
from scaletune.serve.edge.access import Submitter, Svc
from scaletune.serve.edge.teams import record
from scaletune.serve.jobs.chatting import answer

router = APIRouter()


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


@router.post("/api/jobs/{job_id}/chat", tags=["results"], responses=E409_422)
async def chat(job_id: str, req: ChatRequest, request: Request, c: Submitter, svc: Svc):
    """The model's next turn in `messages`, streamed as server-sent events: `model` (what was
    loaded), `token` ({"text"}) as the tokens arrive, then `done` ({"answer"}: the whole turn) or
    `error`. 409: the job runs, its files are not here, the checkpoint is not one of its, or
    the model cannot be loaded."""
    from scaletune.inference import Sampling

    job = job_or_404(svc, job_id)
    target, _ = model_target(job, req.checkpoint)
    if req.messages[-1].role != "user":
        raise Refused("invalid request", ["messages: the last turn is the user's"], 422)
    record(svc.Session, c.name, "job.chat", job_id, req.checkpoint)
    sampling = Sampling(max_new_tokens=req.max_new_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed)
    turns = [t.model_dump() for t in req.messages]
    (kind, value), q, gone = await answer(request.app.state.model_slot, target, turns, sampling)
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
