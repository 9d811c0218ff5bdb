"""The training loop and its parts: loop, step, stages, batches, metrics, MLflow tracking, model set-up, freezing."""

from __future__ import annotations

from scaletune.trainer.batches import model_inputs
from scaletune.trainer.loop import Trainer
from scaletune.trainer.step import DivergenceError, StepResult, evaluate, seed_everything, train_step

__all__ = ["DivergenceError", "StepResult", "Trainer", "evaluate", "model_inputs", "seed_everything", "train_step"]
