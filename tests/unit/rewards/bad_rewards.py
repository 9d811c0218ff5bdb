"""Reward functions for tests/unit/rewards: one that follows the contract and one per way of
breaking it, imported by reference (`tests.unit.rewards.bad_rewards:NAME`) as a config names them."""

from __future__ import annotations

import math

import numpy as np
import torch

CALLS: list[dict] = []  # what `recording` was called with, for the tests to read


def recording(prompts, completions, scale=1.0, **fields):
    """Follows the contract: records its call; the completion's length times `scale`."""
    CALLS.append({"prompts": prompts, "completions": completions, "scale": scale, **fields})
    return [scale * len(c) for c in completions]


def mixed_types(prompts, completions, **_):
    """Every kind of real number the scorer takes, for four completions."""
    return [True, np.float32(0.5), torch.tensor(-2.0), np.int64(3)][: len(completions)]


def as_tensor(prompts, completions, **_):
    return torch.arange(len(completions), dtype=torch.float64)


def raises(prompts, completions, **_):
    raise ValueError("no such key 'answer'\nsecond line never shown")


def wrong_length(prompts, completions, **_):
    return [1.0] * (len(completions) - 1)


def nan_value(prompts, completions, **_):
    return [0.0, math.nan, 1.0, 1.0][: len(completions)]


def none_value(prompts, completions, **_):
    return [0.0, 1.0, None, 1.0][: len(completions)]


def text_value(prompts, completions, **_):
    return ["1.0"] * len(completions)


def huge_value(prompts, completions, **_):
    return [1e300] * len(completions)


def a_float(prompts, completions, **_):
    return 1.0


def a_matrix(prompts, completions, **_):
    return np.zeros((len(completions), 2))


def no_var_keyword(prompts, completions):
    return [0.0] * len(completions)


def positional(p, c, **_):
    return [0.0] * len(c)


NOT_CALLABLE = 3
