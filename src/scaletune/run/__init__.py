"""`scaletune train` before the loop: entry, preflight, re-exec under torchrun, the run directory."""

from __future__ import annotations

from scaletune.run.entry import run_from_cli, train
from scaletune.run.preflight import check_data, predicted_memory, prepare
from scaletune.run.reexec import reexec_under_torchrun

__all__ = ["check_data", "predicted_memory", "prepare", "reexec_under_torchrun", "run_from_cli", "train"]
