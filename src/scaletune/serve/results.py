"""Talk to the result and ship it: chat with a run's model, evaluate and export it as small tasks,
download final/ or a checkpoint as one archive."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
from fastapi import FastAPI


def add_result_routes(app: FastAPI, svc, need) -> None:
    """`need(scope)` is the app's scope-check dependency factory ("read", "submit", "admin")."""
