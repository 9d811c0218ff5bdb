"""The base of every config section (strict: unknown keys, non-finite numbers and bad assignments
are errors; field docstrings are descriptions)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated, numbers
    are finite, and each field's docstring is its description."""

    # Infinite or NaN numbers (an `inf` learning rate) are refused here rather than found as a
    # divergence after training started.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )
