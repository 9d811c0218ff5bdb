"""The built-in reward functions (rewards/builtin.py) against values worked out by hand: the final
answer a completion gives, answers compared after normalisation (numbers by value), the format
reward's full match, the length penalty's formula at its corners, and their argument errors."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import pytest

import scaletune.rewards as rewards
from scaletune.rewards import exact_answer, length_penalty, regex_match
from scaletune.rewards.builtin import final_answer, normalise


def test_the_package_exports_the_three_builtins():
    """`scaletune.rewards:NAME` is what a config names; `__all__` is the list the service's policy
    treats as built-in (anything else is user code)."""
    assert sorted(rewards.__all__) == ["exact_answer", "length_penalty", "regex_match"]
    assert all(callable(getattr(rewards, name)) for name in rewards.__all__)


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("We get \\boxed{\\frac{1}{2}} in the end.", "\\frac{1}{2}"),  # nested braces kept whole
        ("First \\boxed{3}, corrected: \\boxed{4}", "4"),  # the last box
        ("\\boxed{3} and then \\boxed{4", "3"),  # a box left open (cut off): the earlier one
        ("\\boxed{7}\nAnswer: 8", "7"),  # a box wins over a marker
        ("Some work.\nAnswer: 12\nThat is all.", "12"),  # the rest of the marker's line only
        ("The answer is 7 apples", "7 apples"),
        ("answer is: x=2", "x=2"),
        ("FINAL ANSWER:\n\n  5  \nbye", "  5  "),  # nothing after it on its line: the next non-empty line
        ("answer: 1\nwait, Answer: 2", "2"),  # the last marker
        ("My answers: 3\n4\n\n", "4"),  # `answers:` is no marker: the last non-empty line
        ("", ""),
    ],
)
def test_final_answer(completion, expected):
    assert final_answer(completion) == expected


@pytest.mark.parametrize(
    "value, expected",
    [
        (' "Paris." ', "paris"),
        ("  The   Eiffel\tTower ", "the eiffel tower"),
        ("**42**", Fraction(42)),
        ("$1,000$", Fraction(1000)),
        ("-1,234,567.5", Fraction(-2469135, 2)),
        ("3.0", Fraction(3)),
        (".5", Fraction(1, 2)),  # a leading period is part of the number
        ("2.", Fraction(2)),  # a trailing one is not
        ("1e3", Fraction(1000)),
        (3, Fraction(3)),
        (2.5, Fraction(5, 2)),
        ("1,00", "1,00"),  # not a thousands separator: text
        ("(a)", "(a)"),  # brackets are kept
        ("9" * 101, "9" * 101),  # too long to be read as a number
    ],
)
def test_normalise(value, expected):
    got = normalise(value)
    assert got == expected and type(got) is type(expected)


def test_exact_answer_by_hand():
    cases = [  # completion, answer, reward
        ("so the total is \\boxed{1,000}", 1000, 1.0),
        ("Answer: 3.0", "3", 1.0),
        ("Answer: 3.0", 3, 1.0),
        ("The answer is 2.50.", 2.5, 1.0),
        ("the answer is 'PARIS'.", "Paris", 1.0),
        ("Answer: -0", 0, 1.0),
        ("Answer: 3.01", 3, 0.0),
        ("Answer: 1,00", 100, 0.0),  # 1,00 is no thousands separator
        ("I think it is 4", 4, 0.0),  # the last line is the whole sentence
        ("work\n4", 4, 1.0),
        ("\\boxed{5}\nAnswer: 4", 4, 0.0),  # the box is the final answer
        ("", "", 0.0),  # an empty answer matches nothing
        ("Answer: 4", None, 0.0),  # no reference
    ]
    completions = [c for c, _, _ in cases]
    got = exact_answer(["q"] * len(cases), completions, [a for _, a, _ in cases], level=[1] * len(cases))
    assert got == [r for _, _, r in cases]


def test_exact_answer_wants_the_field_aligned():
    with pytest.raises(TypeError, match="answer must be the data field, a list aligned with the completions, not str"):
        exact_answer(["q"], ["4"], "4")
    with pytest.raises(ValueError, match="answer has 1 values for 2 completions"):
        exact_answer(["q", "q"], ["4", "5"], ["4"])


def test_regex_match_is_a_full_match_across_lines():
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    completions = [
        "<think>a\nb</think> <answer>4</answer>\n",  # DOTALL, stripped
        "  <think></think><answer></answer>",
        "<answer>4</answer>",
        "<think>a</think> <answer>4</answer> and more",  # a prefix match is not enough
    ]
    assert regex_match(["q"] * 4, completions, pattern=pattern, answer=[1, 2, 3, 4]) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(re.error):
        regex_match(["q"], ["x"], pattern="(")


def test_length_penalty_formula():
    """-min(1, max(0, len - 10) / 10): 0 up to 10 characters, -1 from 20 on."""
    lengths = [0, 5, 10, 11, 15, 20, 100]
    got = length_penalty(["q"] * len(lengths), ["x" * n for n in lengths], max_chars=10)
    assert got == [0.0, 0.0, 0.0, -0.1, -0.5, -1.0, -1.0]
    assert all(math.copysign(1, v) == 1 for v in got[:3])  # 0.0, not -0.0, in metrics.jsonl
    assert length_penalty(["q"], ["é" * 12], max_chars=10) == [-0.2]  # characters, not bytes
    for bad in (0, -5, 2.5, True, "10"):
        with pytest.raises(ValueError, match="max_chars must be a positive whole number"):
            length_penalty(["q"], ["x"], max_chars=bad)
