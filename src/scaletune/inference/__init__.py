"""Inference on a trained run or any model: loading (adapters on their base), generation, chat, evaluation, samples."""

# Layer: beside trainer.py (the trainer's samples use it); below cli/. Imports models/, data/ and
# loss.py, never trainer or strategies: a run is loaded from its files, not from a live engine.

from scaletune.inference.generate import Prompt, Sampling, generate, prompt_text, read_prompts, stream
from scaletune.inference.loading import LoadedModel, find_target, load_for_inference, load_model_config

__all__ = [
    "LoadedModel",
    "Prompt",
    "Sampling",
    "find_target",
    "generate",
    "load_for_inference",
    "load_model_config",
    "prompt_text",
    "read_prompts",
    "stream",
]
