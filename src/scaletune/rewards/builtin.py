"""The built-in reward functions, `scaletune.rewards:exact_answer`, `regex_match` and `length_penalty`,
and the rules of the keyword arguments a config gives them (`kwargs_problems`, checked on loading).

Each follows the reward-function contract (TRL's GRPOTrainer `reward_funcs`; docs/rl.md): called as
`fn(prompts=[str], completions=[str], **fields, **kwargs)`, it returns one float per completion;
`prompts[i]` is the rendered prompt of `completions[i]`, each data field (`answer`, ...) is a list
aligned with the completions, and fields a function does not use land in its `**_`. Pure Python:
nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from scaletune.errors import Problem

BOXED = "\\boxed{"
# "answer:" or "answer is" (optionally "answer is:"), any case, with the spaces or tabs after it:
# also the end of "Final Answer:" and "The answer is". Never inside a word ("answers:", "reanswer:").
ANSWER_MARKER = re.compile(r"\banswer(?:[ \t]*:|[ \t]+is\b[ \t]*:?)[ \t]*", re.IGNORECASE)
# Stripped from both ends of an answer (quotes, Markdown bold, LaTeX's inline-math dollars, and
# punctuation); a period only from the end, so ".5" stays a number.
_LEAD = "\"'`\u201c\u201d\u2018\u2019\u00ab\u00bb*$,;:!? "
_TRAIL = _LEAD + "."
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d{1,3})?")  # casefolded: `e`, not `E`
_MAX_NUMBER_CHARS = 100  # longer digit strings compare as text (no 10**999999 in a reward)


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` whose braces close (nested braces counted), or None.
    A box left open (a completion cut at `max_new_tokens`) is passed over for an earlier one; an
    earlier box can only close before a later open one starts, so each character is read once."""
    limit, start = len(text), text.rfind(BOXED)
    while start != -1:
        depth, begin = 1, start + len(BOXED)
        for j in range(begin, limit):
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            if depth == 0:
                return text[begin:j]
        limit, start = start, text.rfind(BOXED, 0, start)
    return None


def final_answer(completion: str) -> str:
    """The part of a completion that is its final answer, in this order:

    1. the content of the last `\\boxed{...}` (braces nested inside counted): `"so \\boxed{\\frac{1}{2}}"`
       -> `"\\frac{1}{2}"`;
    2. else the text after the last `answer:` or `answer is` (any case, so `Final Answer:` and
       `The answer is` too) and the spaces after it, up to the end of its line, or the next
       non-empty line when that is empty: `"The answer is 42.\\nDone"` -> `"42."`;
    3. else the last non-empty line: `"3 + 4\\n7\\n"` -> `"7"`.
    """
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed
    marks = list(ANSWER_MARKER.finditer(completion))
    if marks:
        rest = completion[marks[-1].end() :].splitlines()
        return next((line for line in rest if line.strip()), "")
    return next((line for line in reversed(completion.splitlines()) if line.strip()), "")


def normalise(value: Any) -> str | Fraction:
    """An answer in the form answers are compared in: `str(value)` with whitespace collapsed to
    single spaces, casefolded, quotes, `*`, `$` and `,;:!?` stripped from both ends and a period
    from the end; a number (`-3`, `2.50`, `.5`, `1e3`, `1,000` with thousands separators) becomes
    its exact value (a Fraction), so `"3.0"`, `3` and `"3"` are equal, as are `"1,000"` and `1000`.

    Examples: `' "Paris." '` -> `"paris"`; `"**1,000**"` -> `Fraction(1000)`; `"1,00"` -> `"1,00"`.
    """
    text = " ".join(str(value).split()).casefold().lstrip(_LEAD).rstrip(_TRAIL)
    number = text.replace(",", "") if _THOUSANDS.fullmatch(text) else text
    if len(number) <= _MAX_NUMBER_CHARS and _NUMBER.fullmatch(number):
        return Fraction(number)
    return text


def exact_answer(prompts: list[str], completions: list[str], answer: Sequence[Any], **_: Any) -> list[float]:
    """1.0 where the completion's final answer equals the data's `answer`, else 0.0.

    Args:
        prompts: the rendered prompts, one per completion (not read).
        completions: the decoded completions.
        answer: the data field `answer`, one per completion: a str, int or float (None: no
            reference, 0.0).

    The final answer is :func:`final_answer`'s (the last `\\boxed{...}`, else the text after the
    last `answer:` / `answer is`, else the last non-empty line); both sides go through
    :func:`normalise` (case, spacing, surrounding quotes and punctuation, thousands separators;
    numbers compared by value). An empty final answer matches nothing.

    Example: completions `["... so \\boxed{1,000}", "Answer: 3.0", "I think it is 4"]` with answer
    `[1000, "3", 5]` -> `[1.0, 1.0, 0.0]`.
    """
    if isinstance(answer, str | bytes) or not isinstance(answer, Sequence):
        raise TypeError(
            f"answer must be the data field, a list aligned with the completions, not {type(answer).__name__}"
        )
    if len(answer) != len(completions):
        raise ValueError(f"answer has {len(answer)} values for {len(completions)} completions")
    out = []
    for completion, expected in zip(completions, answer):
        got = normalise(final_answer(completion))
        out.append(1.0 if expected is not None and got != "" and got == normalise(expected) else 0.0)
    return out


def regex_match(prompts: list[str], completions: list[str], pattern: str, **_: Any) -> list[float]:
    """1.0 where the whole stripped completion matches `pattern`, else 0.0: a format reward.

    `re.fullmatch(pattern, completion.strip(), re.DOTALL)`, the pattern compiled once per call;
    `pattern` comes from the config's `kwargs` (checked when the rewards are loaded).

    Example: pattern `<think>.*</think>\\s*<answer>.*</answer>` gives
    `["<think>a\\nb</think> <answer>4</answer>\\n", "<answer>4</answer>"]` -> `[1.0, 0.0]`.
    """
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.fullmatch(c.strip()) else 0.0 for c in completions]


def length_penalty(prompts: list[str], completions: list[str], max_chars: int, **_: Any) -> list[float]:
    """0 for a completion of at most `max_chars` characters, falling linearly to -1 at twice that:

        reward = -min(1, max(0, len(completion) - max_chars) / max_chars)

    in [-1, 0]; lengths are Python string lengths (Unicode code points) of the decoded text.

    Example: max_chars 10 gives completions of 4, 10, 15 and 40 characters -> `[0.0, 0.0, -0.5, -1.0]`.
    """
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or max_chars <= 0:
        raise ValueError(f"max_chars must be a positive whole number of characters, not {max_chars!r}")
    return [0.0 - min(1.0, max(0, len(c) - max_chars) / max_chars) for c in completions]


def _pattern_error(value: Any) -> str | None:
    if not isinstance(value, str):
        return f"must be a regular expression (a string), not {type(value).__name__}"
    try:
        re.compile(value, re.DOTALL)
    except re.error as exc:
        return f"{value!r} is not a regular expression: {exc}"
    return None


def _max_chars_error(value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return f"must be a positive whole number of characters, not {value!r}"
    return None


# The config `kwargs` each built-in takes, every one required, with its check (None: fine).
_KWARGS: dict[Callable[..., Any], dict[str, Callable[[Any], str | None]]] = {
    exact_answer: {},
    regex_match: {"pattern": _pattern_error},
    length_penalty: {"max_chars": _max_chars_error},
}


def kwargs_problems(fn: Callable[..., Any], kwargs: dict[str, Any], key: str, ref: str) -> list[Problem]:
    """The problems of a built-in's config `kwargs` (none for another function): a name it does not
    take (its `**_` would swallow a typo silently), one it needs that is missing, a bad value
    (`regex_match`'s pattern that does not compile, `length_penalty`'s max_chars not positive)."""
    rules = next((r for f, r in _KWARGS.items() if f is fn), None)  # by identity: fn may not hash
    if rules is None:
        return []
    takes = ", ".join(rules) or "none"
    out = [
        f"{key} {ref!r}: kwargs.{name}: not an argument of this built-in (its kwargs: {takes})"
        for name in kwargs
        if name not in rules
    ]
    for name, check in rules.items():
        error = check(kwargs[name]) if name in kwargs else "missing: this built-in needs it"
        if error:
            out.append(f"{key} {ref!r}: kwargs.{name}: {error}")
    return [Problem("reward functions", key, m) for m in out]
