"""The reward functions of online RL (GRPO): the built-ins, and loading, checking and calling them."""

from scaletune.rewards.builtin import exact_answer, length_penalty, regex_match

# The built-ins: `scaletune.rewards:NAME` for a NAME here is never user code (serve/edge/policy.py).
__all__ = ["exact_answer", "length_penalty", "regex_match"]
