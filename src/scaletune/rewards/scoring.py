"""The reward functions a config names (`training.rl.rewards`): loaded and checked before training
(`load_rewards`, `check_rewards`), then called on each step's completions (`score`): values [n, F],
the weighted total [n], and one :class:`RewardError` naming the function and the prompt for anything
that goes wrong. Reward functions are user code: imported by reference and called, never `eval`ed;
nothing here logs what they are given.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from scaletune.config.user_code import import_callable
from scaletune.errors import Problem, UserError
from scaletune.rewards.builtin import kwargs_problems

CHECK = "reward functions"
PREFIX = "training.rl.rewards"  # a stage's: f"stages[{i}].training.rl.rewards"
RESERVED = ("prompts", "completions")  # the arguments every reward function gets
PROBE_COMPLETIONS = ("", "The answer is 42.")  # what check_rewards scores
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_SHOWN = 8  # prompt indices named in a message


class RewardError(UserError):
    """A reward function failed on a step's completions: it raised, returned something other than one
    real number per completion, or a value that is None, not a real number or not finite. One
    message names the function and, where it can be located, the prompt (the data record's index).

    Attributes:
        function: the function's reference (`pkg.module:fn`).
        prompt_index: the data record of the offending completion, or None when not one.
    """

    def __init__(self, message: str, function: str, prompt_index: int | None = None) -> None:
        self.function = function
        self.prompt_index = prompt_index
        super().__init__(message, title="reward function failed")


@dataclass(frozen=True)
class RewardFunction:
    """One loaded reward function.

    Attributes:
        name: its reference as the config gives it (`pkg.module:fn` or `path/file.py:fn`).
        weight: its weight in the total reward.
        fn: the callable.
        kwargs: the config's fixed keyword arguments, passed on every call.
    """

    name: str
    weight: float
    fn: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def short(self) -> str:
        """The function's attribute name: `exact_answer` of `scaletune.rewards:exact_answer`,
        `build` of `mod:Class.build`."""
        return self.name.rpartition(":")[2].rpartition(".")[2]

    @property
    def key(self) -> str:
        """The metric suffix `reward_<short>` (unique in a list only through :func:`metric_names`)."""
        return f"reward_{self.short}"


def metric_names(rewards: Sequence[RewardFunction]) -> list[str]:
    """The metric name of each reward (metrics.jsonl, rollouts.jsonl): its `key`, the second of a
    repeated key suffixed `_2`, the third `_3`, ... (`[a, b, a]` -> reward_a, reward_b, reward_a_2)."""
    seen: set[str] = set()
    out = []
    for reward in rewards:
        name, k = reward.key, 1
        while name in seen:
            k += 1
            name = f"{reward.key}_{k}"
        seen.add(name)
        out.append(name)
    return out


def signature_problems(fn: Callable[..., Any], ref: str, weight: Any, kwargs: Any, key: str) -> list[Problem]:
    """What is wrong with one imported reward function before it is ever called: a weight that is
    not a finite number, kwargs that are not a mapping or use a reserved name, a signature that does
    not take `prompts`, `completions` (by keyword) and `**kwargs`, a built-in's kwargs."""
    out: list[str] = []
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        out.append(f"{key} {ref!r}: weight {weight!r} is not a finite number")
    if not isinstance(kwargs, dict):
        out.append(f"{key} {ref!r}: kwargs must be a mapping of keyword arguments, not {type(kwargs).__name__}")
        kwargs = {}
    out += [
        f"{key} {ref!r}: kwargs.{name}: every reward function gets `{name}` from the trainer; rename it"
        for name in RESERVED
        if name in kwargs
    ]
    try:
        signature: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        signature = None
    params = signature.parameters if signature is not None else {}
    by_keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    named = all(n in params and params[n].kind in by_keyword for n in RESERVED)
    if not named or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        shown = (
            f"its signature is {ref.rpartition(':')[2]}{signature}"
            if signature is not None
            else "its signature cannot be read"
        )
        out.append(
            f"{key} {ref!r}: a reward function is called as fn(prompts=[...], completions=[...], **fields, "
            f"**kwargs) and must take `prompts` and `completions` by keyword and a `**kwargs` for the data "
            f"fields it does not use; {shown}"
        )
    return [Problem(CHECK, key, m) for m in out] + kwargs_problems(fn, kwargs, key, ref)


def load_rewards(specs: Sequence[tuple[str, float, dict]], prefix: str = PREFIX) -> list[RewardFunction]:
    """The reward functions of `(function, weight, kwargs)` specs, imported and checked.

    Args:
        specs: the config's `training.rl.rewards`, in order.
        prefix: their config key, for messages (a stage's: `stages[0].training.rl.rewards`).

    Raises:
        UserError: naming every problem with its key (`training.rl.rewards[1].function`): no spec,
            a reference that does not import (config.user_code's reasons), a signature that does not
            fit the contract, a weight that is not finite, a built-in's missing or bad kwargs
            (`regex_match`'s pattern that does not compile).
    """
    if not specs:
        raise UserError(
            Problem(CHECK, prefix, f"{prefix}: no reward function; give at least one"), title="invalid reward functions"
        )
    problems: list[Problem] = []
    out = []
    for i, (ref, weight, kwargs) in enumerate(specs):
        key = f"{prefix}[{i}].function"
        try:
            fn = import_callable(ref, key)
        except UserError as exc:
            problems += [Problem(CHECK, key, p) for p in exc.problems]
            continue
        found = signature_problems(fn, ref, weight, kwargs, key)
        problems += found
        if not found:
            out.append(RewardFunction(ref, float(weight), fn, dict(kwargs)))
    if problems:
        raise UserError(problems, title="invalid reward functions")
    return out


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _prompts(prompt_index: Sequence[int]) -> str:
    """`prompts 3, 7` (each once, in order; the first few and the count when there are many)."""
    unique = list(dict.fromkeys(prompt_index))
    shown = ", ".join(str(i) for i in unique[:_SHOWN])
    more = f", ... ({len(unique)} prompts)" if len(unique) > _SHOWN else ""
    return f"prompt{'s' if len(unique) > 1 else ''} {shown}{more}"


def _columns(fields: Sequence[dict[str, Any]]) -> dict[str, list[Any]]:
    """One record's fields per completion -> one list per field (None where a record lacks it)."""
    names = list(dict.fromkeys(name for record in fields for name in record))
    return {name: [record.get(name) for record in fields] for name in names}


def _real(value: Any) -> float | None:
    """`value` as a float when it is a real number (bool, int, float, numpy number, 0-dim tensor or
    array), else None; a number too large for a float gives inf."""
    if isinstance(value, torch.Tensor | np.ndarray) and value.ndim == 0:
        value = value.item()
    if isinstance(value, bool | np.bool_):
        return float(value)
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _values(reward: RewardFunction, out: Any, prompt_index: Sequence[int]) -> list[float]:
    """A function's return value as n finite floats, or the RewardError saying why not."""
    n, name = len(prompt_index), reward.name
    if isinstance(out, torch.Tensor | np.ndarray) and out.ndim == 1:
        items = out.tolist()
    elif isinstance(out, list | tuple):
        items = list(out)
    else:
        shape = f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor | np.ndarray) else ""
        raise RewardError(
            f"{name} returned a {type(out).__name__}{shape}, not a list of {n} numbers (one per completion), "
            f"on the completions of {_prompts(prompt_index)}",
            name,
        )
    if len(items) != n:
        raise RewardError(
            f"{name} returned {len(items)} values for {n} completions (expected {n}, got {len(items)}), "
            f"on the completions of {_prompts(prompt_index)}",
            name,
        )
    values = []
    for i, item in enumerate(items):
        x = _real(item)
        why = (
            "None, not a number"
            if item is None
            else f"a {type(item).__name__}, not a real number"
            if x is None
            else "not finite"
            if not math.isfinite(x)
            else "outside float32's range"
            if abs(x) > _FLOAT32_MAX
            else None
        )
        if why:
            raise RewardError(
                f"{name} returned {_show(item)} ({why}) for completion {i}, of prompt {prompt_index[i]}",
                name,
                prompt_index[i],
            )
        values.append(x)
    return values


def _call(
    reward: RewardFunction,
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: dict,
    prompt_index: Sequence[int],
) -> list[float]:
    """One function over the whole list: its n values, or the RewardError."""
    name = reward.name
    for field_name in columns:
        if field_name in RESERVED or field_name in reward.kwargs:
            what = "an argument every reward function gets" if field_name in RESERVED else "a name in its config kwargs"
            raise RewardError(f"{name}: the data field {field_name!r} is also {what}; rename one", name)
    unique = set(prompt_index)
    try:
        out = reward.fn(
            prompts=list(prompts),
            completions=list(completions),
            **{k: list(v) for k, v in columns.items()},
            **reward.kwargs,
        )
    except Exception as exc:
        raise RewardError(
            f"{name} raised {_first_line(exc)}, on the completions of {_prompts(prompt_index)}",
            name,
            next(iter(unique)) if len(unique) == 1 else None,
        ) from exc
    return _values(reward, out, prompt_index)


def score(
    rewards: Sequence[RewardFunction],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Sequence[dict[str, Any]],
    prompt_index: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every reward function called once over all n completions.

    Args:
        rewards: the loaded functions (F of them).
        prompts: the rendered prompt of each completion (a prompt repeats over its group).
        completions: the decoded completions, n of them.
        fields: each completion's data record fields (`answer`, ...), one dict per completion; passed
            as keyword arguments, one list per field (None where a record lacks one).
        prompt_index: the data record index of each completion, for messages.

    Returns:
        (values [n, F] float32, one column per function; total [n] float32 = sum over the functions
        of weight * value, summed in float64).

    Raises:
        RewardError: one message naming the function (and the prompt index where it can be
            located): it raised, returned something other than a list, tuple or 1-D array of n
            values, a value that is None, not a real number, not finite or beyond float32; a data
            field whose name is also `prompts`, `completions` or one of its config kwargs.
    """
    n = len(completions)
    if not len(prompts) == len(fields) == len(prompt_index) == n:
        raise ValueError(
            f"score: {len(prompts)} prompts, {len(fields)} field records and {len(prompt_index)} prompt indices "
            f"for {n} completions: one each per completion"
        )
    values = torch.zeros((n, len(rewards)), dtype=torch.float64)
    if n:
        columns = _columns(fields)
        for j, reward in enumerate(rewards):
            values[:, j] = torch.tensor(_call(reward, prompts, completions, columns, prompt_index), dtype=torch.float64)
    total = (values * torch.tensor([r.weight for r in rewards], dtype=torch.float64)).sum(dim=1)
    bad = (total.abs() > _FLOAT32_MAX).nonzero()
    if len(bad):
        i = int(bad[0])
        names = ", ".join(r.name for r in rewards)
        raise RewardError(
            f"the weighted total of {names} is {total[i].item():g} for completion {i}, of prompt {prompt_index[i]}: "
            "outside float32's range",
            names,
            prompt_index[i],
        )
    return values.to(torch.float32), total.to(torch.float32)


def check_rewards(
    rewards: Sequence[RewardFunction],
    prompt: str,
    fields: dict[str, Any],
    prefix: str = PREFIX,
    prompt_index: int = 0,
) -> list[Problem]:
    """The pre-training check: each function called once on one prompt with two completions (`""`
    and a short text) and that record's fields, as :func:`score` calls it; a problem per function
    that fails (`scaletune train` then exits 2 before training), keyed `training.rl.rewards[i].function`.

    Args:
        rewards: the loaded functions, in the config's order.
        prompt: a rendered prompt of the training data (its first record's, say).
        fields: that record's fields.
        prefix: the rewards' config key (a stage's: `stages[0].training.rl.rewards`).
        prompt_index: that record's index, for messages.
    """
    out = []
    for i, reward in enumerate(rewards):
        key = f"{prefix}[{i}].function"
        try:
            score([reward], [prompt] * 2, list(PROBE_COMPLETIONS), [fields] * 2, [prompt_index] * 2)
        except RewardError as exc:
            message = "; ".join(exc.problems)
            out.append(Problem(CHECK, key, f"{key}: {message} (checked before training, on 2 completions)"))
    return out
