"""The run directory (`output_dir`): whether a run may start in it, and preparing it (rank 0)."""

from __future__ import annotations

import os
import shutil

from scaletune.config import dump_config
from scaletune.resolve import Problem, RunSpec

#: Files whose presence makes a folder a scaletune run.
RUN_MARKERS = ("config.yaml", "metrics.jsonl", "final")
#: What a run writes, removed when `overwrite: true` replaces it.
RUN_OUTPUTS = (
    *RUN_MARKERS,
    "loss.png",
    "tensorboard",
    "checkpoints",
    "plan.json",
    "memory.json",
    "samples.md",
    "samples.jsonl",
    "wandb",
)


def run_dir_problems(spec: RunSpec) -> list[Problem]:
    """A run may start in `output_dir` unless it holds another run and neither `overwrite` nor
    `training.resume` says what to do with it."""
    run_dir, cfg = spec.run_dir, spec.config
    if not run_dir.exists():
        return []
    if not run_dir.is_dir():
        return [Problem("run directory", "output_dir", f"output_dir {run_dir} exists and is not a directory")]
    held = [m for m in RUN_MARKERS if (run_dir / m).exists()]
    if held and not cfg.overwrite and cfg.training.resume is None:
        what = "a finished run (final/ present)" if "final" in held else f"a previous run ({', '.join(held)})"
        return [
            Problem(
                "run directory",
                "output_dir",
                f"output_dir {run_dir} holds {what}",
                "choose another output_dir, set overwrite: true to replace it, or training.resume: auto to continue it",
            )
        ]
    return []


def prepare_run_dir(spec: RunSpec) -> None:
    """Rank 0 creates the run directory (clearing a previous run only under `overwrite: true`)
    and writes the resolved config. A fresh start under `resume: auto` keeps an earlier run's
    metrics as `metrics.jsonl.prev` rather than mixing the two curves."""
    if not spec.env.is_main:
        return
    cfg, run_dir = spec.config, spec.run_dir
    resuming = spec.resume_from is not None
    metrics = run_dir / "metrics.jsonl"
    if not resuming and cfg.training.resume == "auto" and metrics.exists():
        os.replace(metrics, run_dir / "metrics.jsonl.prev")
    if cfg.overwrite and run_dir.exists() and cfg.training.resume is None:
        for m in RUN_OUTPUTS:
            target = run_dir / m
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
