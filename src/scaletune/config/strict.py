"""The base of every config section (its own module so that section modules beside the schema share it)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """Base of every section: unknown keys, bad assignments and non-finite numbers (an `inf` learning
    rate, refused before a GPU-hour is spent) are errors; each field's docstring is its description."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )
