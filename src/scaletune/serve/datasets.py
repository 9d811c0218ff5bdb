"""Bring data: upload a file into the service's data area and preview it as training renders it."""

# No `from __future__ import annotations`: FastAPI reads Annotated[..., Depends(...)] at definition.
from fastapi import FastAPI


def add_data_routes(app: FastAPI, svc, need) -> None:
    """`need(scope)` is the app's scope-check dependency factory ("read", "submit", "admin")."""
