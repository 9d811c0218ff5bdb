"""The form's routes over the YAML (`page/form.py`): the shipped examples, the model choices, and
the form <-> YAML round trip (`/api/config/fields`, `/api/config/apply`)."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, Field

from scaletune.serve.api.schemas import E422, refusal
from scaletune.serve.edge.access import Reader, Svc
from scaletune.serve.page.form import (
    FormProblem,
    apply_fields,
    defaults_of,
    describe,
    examples,
    fields_of,
    local_models,
    read_yaml,
)

router = APIRouter()


class ConfigText(BaseModel):
    config: str = Field(description="The YAML config, as text (empty: an empty config).")
    world_size: int = Field(1, ge=1, le=1 << 20, description="Ranks the batch arithmetic assumes (the plan's).")


class ApplyRequest(ConfigText):
    fields: dict[str, Any] = Field(
        description="Field -> value: a dotted config key (any, e.g. data.train.path) or method / "
        "gradient_accumulation; null removes the key (its default applies)."
    )


class FormFields(BaseModel):
    fields: dict[str, Any] = Field(description="The form's fields as the YAML sets them (null: not set).")
    defaults: dict[str, Any] = Field(description="The schema's default of each field not set.")


class Applied(FormFields):
    config: str = Field(description="The YAML with the fields set (comments are not kept).")
    overrides: list[str] = Field(description="The command-line overrides that make the same config.")


class Example(BaseModel):
    name: str
    description: str
    config: str | None = None


class ModelChoice(BaseModel):
    value: str = Field(description="What model.name_or_path takes.")
    kind: str = Field(description="pretrained | preset | local")
    description: str


@router.get("/api/examples", response_model=list[Example], tags=["form"], responses=E422)
def list_examples(c: Reader, svc: Svc):
    """The shipped example configs (`examples/*.yaml`): name and description."""
    return [Example(name=n, description=describe(p.read_text())) for n, p in examples(svc.workdir).items()]


@router.get("/api/examples/{name}", response_model=Example, tags=["form"], responses=E422)
def get_example(name: str, c: Reader, svc: Svc):
    """One example's YAML (404 for a name the listing does not hold)."""
    path = examples(svc.workdir).get(name)
    if path is None:
        raise HTTPException(404, f"no example {name!r}")
    text = path.read_text()
    return Example(name=name, description=describe(text), config=text)


@router.get("/api/models", response_model=list[ModelChoice], tags=["form"], responses=E422)
def list_models(c: Reader, svc: Svc):
    """What model.name_or_path may be besides a hub id (owner/name): the pretrained models
    fetched on first use, the presets (shapes for the plan preview; a tiny one trains from the
    folder `scaletune init-model` writes) and the local model folders the policy allows."""
    from scaletune.models import PRETRAINED
    from scaletune.models.presets import PRESETS

    out = [ModelChoice(value=n, kind="pretrained", description=s.description) for n, s in PRETRAINED.items()]
    out += [
        ModelChoice(value=n, kind="preset", description=f"{p.description}; plan preview only")
        for n, p in PRESETS.items()
    ]
    out += [
        ModelChoice(value=p, kind="local", description="a model folder this service may read")
        for p in local_models(svc.policy, svc.workdir, svc.home)
    ]
    return out


@router.post("/api/config/fields", response_model=FormFields, tags=["form"], responses=E422)
def config_fields(req: ConfigText, c: Reader):
    """The form's fields as the YAML sets them (dotted keys; `method`, `gradient_accumulation`
    at `world_size`), and the defaults of those it does not set."""
    try:
        values = fields_of(read_yaml(req.config), req.world_size)
    except FormProblem as exc:
        return refusal("the YAML cannot be read", exc.problems)
    return {"fields": values, "defaults": defaults_of(values)}


@router.post("/api/config/apply", response_model=Applied, tags=["form"], responses=E422)
def config_apply(req: ApplyRequest, c: Reader, svc: Svc):
    """The YAML with the fields set, as the CLI's overrides set them (the overrides are in the
    answer), and the form's fields read back from it. Comments are not kept."""
    limit = svc.policy.max_depth
    deep = [k for k, v in req.fields.items() if _deeper_than(v, limit)]
    if deep:  # bounded as a submitted config is (the YAML writer recurses)
        return refusal("the fields cannot be set", [f"{k}: nested deeper than {limit} levels" for k in deep])
    try:
        text, data, overrides = apply_fields(req.config, req.fields, req.world_size)
    except FormProblem as exc:
        return refusal("the fields cannot be set", exc.problems)
    values = fields_of(data, req.world_size)
    return {"config": text, "overrides": overrides, "fields": values, "defaults": defaults_of(values)}


def _deeper_than(value: Any, limit: int) -> bool:
    """True when lists and mappings in `value` nest deeper than `limit` (read without recursion)."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return False
