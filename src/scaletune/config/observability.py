"""Where a run's metrics go besides metrics.jsonl: TensorBoard and Weights & Biases."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from scaletune.config.strict import _Strict


class WandbConfig(_Strict):
    """Weights & Biases logging from rank 0 through the `wandb` package (`pip install
    'scaletune[wandb]'`). The API key comes from `wandb login` or WANDB_API_KEY, never from this
    file; the resolved config is sent with secret-looking values redacted."""

    project: str
    """W&B project."""
    entity: str | None = None
    """W&B team or user (default: your default entity)."""
    name: str | None = None
    """Run name (default: W&B's)."""
    group: str | None = None
    """Group runs together (e.g. the runs of one sweep)."""
    tags: list[str] = Field(default_factory=list)
    """Tags on the run."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """online, offline (files under `output_dir/wandb`, upload later with `wandb sync`) or disabled;
    null: WANDB_MODE, else online."""


class LoggingConfig(_Strict):
    """Where metrics go besides metrics.jsonl."""

    tensorboard: bool = True
    """TensorBoard event files under `output_dir/tensorboard`."""
    wandb: WandbConfig | None = None
    """Weights & Biases run; null: none."""
