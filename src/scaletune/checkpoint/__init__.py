"""Checkpoints: atomic saves, resume (validated whole, restricted unpickling), resharding, export."""

from scaletune.checkpoint.export import export_checkpoint, export_problems
from scaletune.checkpoint.resume import (
    check_shapes,
    checkpoint_problems,
    incompatible_changes,
    load_rng,
    read_progress,
    resolve_resume,
)
from scaletune.checkpoint.save import (
    FORMAT_VERSION,
    LATEST,
    Progress,
    checkpoints_dir,
    latest_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

__all__ = [
    "FORMAT_VERSION",
    "LATEST",
    "Progress",
    "check_shapes",
    "checkpoint_problems",
    "checkpoints_dir",
    "export_checkpoint",
    "export_problems",
    "incompatible_changes",
    "latest_checkpoint",
    "load_rng",
    "read_progress",
    "resolve_resume",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
]
