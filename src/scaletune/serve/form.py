"""The form over the YAML: shipped examples, model choices, and the form <-> YAML round trip."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
from fastapi import FastAPI


def add_form_routes(app: FastAPI, svc, need) -> None:
    """`need(scope)` is the app's scope-check dependency factory ("read", "submit", "admin")."""
