"""The API's request and response bodies (pydantic models, so /openapi.json types every main route)
and its one refusal shape: `{"detail": "<what was refused>", "problems": ["<each problem>", ...]}`,
for a config the checks refuse and for a request FastAPI cannot read alike."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from scaletune.config import error_messages
from scaletune.serve.jobs.records import validated
from scaletune.serve.jobs.vault import MAX_VALUE_CHARS


class JobRequest(BaseModel):
    config: str = Field(description="The YAML config, as text.")
    overrides: list[str] = Field(default_factory=list, description="Dotted overrides, as on the command line.")
    target: str = Field("local", description="local | slurm | modal")
    resources: dict[str, Any] = Field(default_factory=dict, description="Target resources (nodes, gpus_per_node, ...).")
    dry_run: bool = Field(False, description="Return the resolved plan and what would be submitted; submit nothing.")
    request_id: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9._:-]{1,64}$",
        description="The client's id for this submission: the same token sending it again gets the same job "
        "(200, `replayed`) instead of a second one. `remote submit` sends one (--request-id).",
    )
    wait_s: float | None = Field(
        None,
        ge=0,
        le=3600,
        description="Seconds to wait for the config's check (the preflight): past them the answer is 202 with the "
        "job `checking`, which becomes `queued` or `failed` (reason `bad input`) on its own. Default: until it ends.",
    )


class ResumeRequest(BaseModel):
    checkpoint: str | None = Field(None, description="A checkpoints/step-N folder; default: the latest.")
    target: str | None = Field(None, description="Another target; default: the job's.")
    resources: dict[str, Any] | None = Field(None, description="Other resources (e.g. more ranks).")
    overrides: list[str] = Field(default_factory=list, description="Added overrides, e.g. distributed.num_processes=2.")


class CloneRequest(BaseModel):
    overrides: list[str] = Field(default_factory=list)


class SecretsRequest(BaseModel):
    secrets: dict[str, Annotated[str, Field(max_length=MAX_VALUE_CHARS)]] = Field(
        max_length=64,
        description="NAME -> value: each secret variable the job was submitted with (and no other), given again. "
        "Kept as a submission's are: in the service's memory and, with SCALETUNE_SECRETS_KEY, sealed on the record.",
    )


class ReportEvent(BaseModel):
    kind: str = Field(max_length=32)
    data: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _fits(self) -> ReportEvent:
        validated(self.kind, self.data)  # ValueError: a 422 naming what does not fit
        return self


class ReportRequest(BaseModel):
    events: list[ReportEvent] = Field(max_length=1000)


class PolicyUpdate(BaseModel):
    """Admin settings to change (the others stay); see docs/serve.md."""

    allow_factories: bool | None = None
    allow_remote_code: bool | None = None
    env_prefixes: list[str] | None = None
    disabled_targets: list[Literal["local", "slurm", "modal"]] | None = Field(
        None, description="Targets jobs may not be sent to"
    )
    read_roots: list[str] | None = None
    write_roots: list[str] | None = None
    trusted_hosts: list[str] | None = None
    trusted_origins: list[str] | None = None
    max_upload_bytes: int | None = Field(None, ge=1, description="The largest data file POST /api/data takes")
    max_data_bytes: int | None = Field(None, ge=1, description="The data area's quota: every uploaded file together")
    keep_checkpoints_days: int | None = Field(
        None,
        ge=0,
        le=36500,
        description="Days a job that ended succeeded, failed or cancelled keeps its checkpoints/step-* folders "
        "(the sweep deletes them; final/ and exports stay); 0: for ever",
    )


class Deleted(BaseModel):
    """What a DELETE removed, and what it left and why (a folder outside the service's run folders, a
    link's target, the run on Modal's volume or SLURM's own record)."""

    deleted: str = Field(description="what was deleted: `job ID`, `data file NAME`, `export exports/NAME of job ID`")
    removed: list[str] = Field(description="the files and folders removed on this machine")
    kept: list[str] = Field(description="what was not deleted, each with why (and how to delete it by hand)")


class JobSummary(BaseModel):
    """A job as the API shows it (`db.Job.summary`)."""

    # A field the record gains later (an owner, ...) is passed on, not dropped by this model.
    model_config = ConfigDict(extra="allow")

    id: str
    name: str
    state: str = Field(
        description="checking queued needs_secrets starting running stopping stopped succeeded failed cancelled"
    )
    phase: str | None = Field(None, description="loading data, loading model, training, checkpointing, exporting")
    stage: str | None = None
    step: int = 0
    reason: str | None = Field(None, description="why it failed: bad input, out of memory, diverged, lost, ...")
    message: str | None = None
    target: str
    target_id: str | None = Field(None, description="PID, SLURM job id or Modal call id")
    run_dir: str
    overrides: list[str] = Field(default_factory=list)
    resources: dict[str, Any] = Field(default_factory=dict)
    last_metrics: dict[str, Any] | None = None
    exit_code: int | None = None
    flag: str | None = Field(
        None, description="why the run is flagged although it may have succeeded: a non-finite or diverged loss"
    )
    owner: str = Field("", description="the name of the token that submitted it (local on a token-less service)")
    created: str = Field(description="ISO 8601, UTC")
    updated: str = Field(description="ISO 8601, UTC")


class Submitted(BaseModel):
    """201: the job queued (`id`, `state`); 202: recorded, its check going on (`checking`); 200: a
    request id sent before (`replayed`: that job, in its state now), or a dry run (`id` null, `state`
    dry_run and the plan)."""

    id: str | None
    state: str
    replayed: bool | None = Field(None, description="the job an earlier request with this request_id made")
    plan: dict[str, Any] | None = Field(None, description="dry run only: the resolved plan and what would run")


class MetricsSummary(BaseModel):
    """A run's metrics lines summed up (`jobs/metric_summary.summarize`), as the compare page's
    table shows them; what the run never logged is absent (`final`) or null, never 0."""

    keys: list[str] = Field(description="the metrics its lines carry: train keys and eval_* keys, sorted")
    final: dict[str, float | str] = Field(
        description="each metric's last logged value (a non-finite one as NaN, Infinity or -Infinity)"
    )
    best_eval_loss: float | None = Field(description="the lowest finite eval_loss")
    steps: int | None = Field(description="the last logged optimizer step")
    tokens: int | None = Field(
        description="non-padding tokens trained: each train line's tokens times the steps since the line before"
    )
    tokens_estimated: bool = Field(description="true where lines were not logged every step (log_every > 1)")
    elapsed_s: float | None = Field(
        description="training time: each process's last elapsed_s (a resume restarts it), summed"
    )


class QueueAhead(BaseModel):
    id: str
    state: str
    remaining_s: float | None = Field(description="seconds it still needs (null: unknown)")
    basis: str = Field(description="how that was told: its pace, a typical job's time, or what is missing")


class QueuePlace(BaseModel):
    """Where a queued local job stands and about when it starts (`jobs/records.queue_eta`): null numbers where
    nothing the service knows supports one, and `why` says what is missing."""

    state: str
    position: int | None = Field(description="1: the next to start; null: not queued on this service")
    ahead: list[QueueAhead] = Field(description="the running jobs, then the queued ones before it")
    typical_s: float | None = Field(description="the median duration of the jobs that finished here (null: none)")
    finished: int = Field(description="how many finished jobs that median is of")
    start_in_s: float | None = Field(description="seconds until it starts, about (null: unknown)")
    why: str = Field(description="what the estimate rests on, or what is missing")


class TokenRequest(BaseModel):
    name: str | None = Field(None, description="Who holds it (1-64 of A-Z a-z 0-9 _ . @ -); default SCOPE-N.")
    scope: Literal["read", "submit", "admin"] = "read"


class TokenInfo(BaseModel):
    name: str
    scope: str
    created: str = Field(description="ISO 8601, UTC")
    created_by: str = Field(description="the token name that made it; cli or environment outside the API")
    revoked: str | None = Field(None, description="ISO 8601, UTC; a revoked token authenticates nothing")
    configured: bool = Field(
        False,
        description="installed by SCALETUNE_ADMIN_TOKEN at each start (admin-env): revoked here, it comes back at "
        "the next start while the variable holds it; rotate or remove it there",
    )


class TokenCreated(TokenInfo):
    token: str = Field(description="The value, shown this once (stored hashed).")


class AuditEntry(BaseModel):
    id: int
    at: str = Field(description="ISO 8601, UTC")
    actor: str = Field(description="the token's name (local on a token-less service)")
    action: str = Field(description="job.submit job.stop job.cancel job.resume job.clone token.create ...")
    job_id: str | None = None
    detail: str = ""


class Whoami(BaseModel):
    name: str
    scope: str


class Health(BaseModel):
    status: str = Field(description="ok | unavailable")
    detail: str | None = None


class Problems(BaseModel):
    """Every refusal of a request's content (422), or of an action in the job's state (409)."""

    detail: str = Field(description="what was refused")
    problems: list[str] = Field(description="every problem, one line each")


def refusal(title: str, problems: list[str], status: int = 422) -> JSONResponse:
    return JSONResponse({"detail": title, "problems": problems}, status_code=status)


def validation_lines(exc: RequestValidationError) -> list[str]:
    """FastAPI's per-field errors as lines `where: message` by the one pydantic formatter
    (`config.error_messages`; FastAPI keeps pydantic's error dicts): a body field by its
    name alone, as the config's problems name keys; `query.offset`, `path.job_id`."""
    lines = [line.removeprefix("body.") for line in error_messages(exc)]  # type: ignore[arg-type]
    return lines or ["the request could not be read"]


def problems_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI entries of the refusals a route answers (FastAPI's own 422 schema replaced)."""
    what = {409: "refused in the job's state", 422: "invalid request or config: every problem"}
    return {s: {"model": Problems, "description": what[s]} for s in statuses}


E422 = problems_responses(422)  # FastAPI's own 422 schema replaced by the one refusal shape
E409_422 = problems_responses(409, 422)
