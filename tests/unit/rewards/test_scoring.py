"""Reward functions loaded, checked and called (rewards/scoring.py): the metric names, every load
problem reported at once with its key, one call per function over the whole list with the data
fields as aligned lists, values and weighted totals against hand-computed numbers, and one message
naming the function and the prompt index for each way a function can fail."""

from __future__ import annotations

import pytest
import torch

from scaletune.errors import Problem, UserError
from scaletune.rewards import exact_answer, length_penalty, regex_match
from scaletune.rewards.scoring import (
    RewardError,
    RewardFunction,
    check_rewards,
    load_rewards,
    metric_names,
    score,
)
from tests.unit.rewards import bad_rewards

BAD = "tests.unit.rewards.bad_rewards"


def one(name: str, weight: float = 1.0, **kwargs) -> RewardFunction:
    """A RewardFunction of bad_rewards' `name`, as load_rewards would build it."""
    return RewardFunction(f"{BAD}:{name}", weight, getattr(bad_rewards, name), kwargs)


def test_metric_names_disambiguate_repeats():
    rewards = [
        RewardFunction("scaletune.rewards:exact_answer", 1.0, exact_answer),
        RewardFunction("my/rewards.py:fmt", 1.0, regex_match),
        RewardFunction("pkg.mod:exact_answer", 1.0, exact_answer),
        RewardFunction("pkg.mod:Scorer.fmt", 1.0, regex_match),
        RewardFunction("other:exact_answer", 1.0, exact_answer),
    ]
    assert [r.key for r in rewards] == [
        "reward_exact_answer",
        "reward_fmt",
        "reward_exact_answer",
        "reward_fmt",
        "reward_exact_answer",
    ]
    assert metric_names(rewards) == [
        "reward_exact_answer",
        "reward_fmt",
        "reward_exact_answer_2",
        "reward_fmt_2",
        "reward_exact_answer_3",
    ]


def test_load_rewards_builds_each_function():
    loaded = load_rewards(
        [
            ("scaletune.rewards:exact_answer", 1, {}),
            ("scaletune.rewards:regex_match", 0.5, {"pattern": "<a>.*</a>"}),
            ("scaletune.rewards:length_penalty", 0.25, {"max_chars": 100}),
            (f"{BAD}:recording", -2.0, {"scale": 3}),
        ]
    )
    assert [(r.fn, r.weight, r.kwargs) for r in loaded] == [
        (exact_answer, 1.0, {}),
        (regex_match, 0.5, {"pattern": "<a>.*</a>"}),
        (length_penalty, 0.25, {"max_chars": 100}),
        (bad_rewards.recording, -2.0, {"scale": 3}),
    ]
    assert isinstance(loaded[0].weight, float) and loaded[3].name == f"{BAD}:recording"


def test_load_rewards_reports_every_problem_with_its_key(tmp_path):
    broken = tmp_path / "broken_reward.py"
    broken.write_text("raise RuntimeError('boom at import')\n")
    specs = [  # index 0 is sound; each other one breaks one rule
        ("scaletune.rewards:exact_answer", 1.0, {}),
        (f"{BAD}_nowhere:fn", 1.0, {}),  # 1: module does not import
        (f"{BAD}:missing", 1.0, {}),  # 2: no such attribute
        (f"{BAD}:NOT_CALLABLE", 1.0, {}),  # 3
        (f"{BAD}:no_var_keyword", 1.0, {}),  # 4: no **kwargs
        (f"{BAD}:positional", 1.0, {}),  # 5: takes p, c
        ("scaletune.rewards:regex_match", 1.0, {"pattern": "(unclosed"}),  # 6: bad regex
        ("scaletune.rewards:regex_match", 1.0, {}),  # 7: no pattern
        ("scaletune.rewards:length_penalty", 1.0, {"max_chars": 0}),  # 8
        ("scaletune.rewards:length_penalty", 1.0, {"max_chars": 9, "max_char": 10}),  # 9: a typo
        (f"{BAD}:recording", 1.0, {"prompts": ["x"]}),  # 10: a reserved name
        (f"{BAD}:recording", float("nan"), {}),  # 11
        (f"{broken}:fn", 1.0, {}),  # 12: a file that does not import
    ]
    with pytest.raises(UserError) as exc:
        load_rewards(specs)
    problems = exc.value.problems
    expected = {
        1: f"module '{BAD}_nowhere' does not import: ModuleNotFoundError",
        2: "has no attribute 'missing'",
        3: "NOT_CALLABLE is a int, not a callable",
        4: "must take `prompts` and `completions` by keyword and a `**kwargs` for the data fields it does not use; "
        "its signature is no_var_keyword(prompts, completions)",
        5: "its signature is positional(p, c, **_)",
        6: "kwargs.pattern: '(unclosed' is not a regular expression: missing ), unterminated subpattern",
        7: "kwargs.pattern: missing: this built-in needs it",
        8: "kwargs.max_chars: must be a positive whole number of characters, not 0",
        9: "kwargs.max_char: not an argument of this built-in (its kwargs: max_chars)",
        10: "kwargs.prompts: every reward function gets `prompts` from the trainer; rename it",
        11: "weight nan is not a finite number",
        12: "does not import: RuntimeError: boom at import",
    }
    assert len(problems) == len(expected), "\n".join(problems)
    for i, said in expected.items():
        key = f"training.rl.rewards[{i}].function"
        (line,) = [p for p in problems if p.startswith(f"{key} ")]
        assert said in line and specs[i][0] in line, (i, line)
    assert not any("rewards[0]" in p for p in problems)
    assert exc.value.format().startswith("invalid reward functions (12 problems):")


def test_load_rewards_wants_one_and_names_a_stage():
    with pytest.raises(UserError, match=r"training.rl.rewards: no reward function; give at least one"):
        load_rewards([])
    with pytest.raises(UserError, match=r"stages\[1\].training.rl.rewards\[0\].function 'os:nothing_here'"):
        load_rewards([("os:nothing_here", 1.0, {})], prefix="stages[1].training.rl.rewards")


def test_score_by_hand():
    """Three functions, four completions of two prompts; each function called once with the data
    fields as aligned lists (a field a record lacks is None there)."""
    bad_rewards.CALLS.clear()
    rewards = [
        RewardFunction("scaletune.rewards:exact_answer", 1.0, exact_answer),
        RewardFunction("scaletune.rewards:length_penalty", 0.5, length_penalty, {"max_chars": 10}),
        one("recording", 2.0, scale=0.1),
    ]
    completions = ["\\boxed{4}", "Answer: 5" + "!" * 11, "4", ""]  # 9, 20, 1 and 0 characters
    fields = [{"answer": 4, "level": 1}, {"answer": 4}, {"answer": "4", "level": 2}, {"answer": 4}]
    values, total = score(rewards, ["p7", "p7", "p9", "p9"], completions, fields, [7, 7, 9, 9])
    # exact: 1, 0 (5 != 4), 1, 0 (empty); length: 0, -(20-10)/10, 0, 0; recording: 0.1 * length
    expected = torch.tensor([[1.0, 0.0, 0.9], [0.0, -1.0, 2.0], [1.0, 0.0, 0.1], [0.0, 0.0, 0.0]])
    assert values.dtype == total.dtype == torch.float32 and values.shape == (4, 3) and total.shape == (4,)
    torch.testing.assert_close(values, expected)
    # 1*exact + 0.5*length + 2*recording
    torch.testing.assert_close(total, torch.tensor([2.8, 3.5, 1.2, 0.0]))
    (call,) = bad_rewards.CALLS
    assert call == {
        "prompts": ["p7", "p7", "p9", "p9"],
        "completions": completions,
        "scale": 0.1,
        "answer": [4, 4, "4", 4],
        "level": [1, None, 2, None],
    }


def test_score_accepts_every_real_number():
    rewards = [one("mixed_types"), one("as_tensor", weight=-1.0)]
    values, total = score(rewards, ["p"] * 4, ["a", "b", "c", "d"], [{}] * 4, [0, 0, 1, 1])
    torch.testing.assert_close(values, torch.tensor([[1.0, 0.0], [0.5, 1.0], [-2.0, 2.0], [3.0, 3.0]]))
    torch.testing.assert_close(total, torch.tensor([1.0, -0.5, -4.0, 0.0]))
    values, total = score(rewards, [], [], [], [])  # no completions: nothing called
    assert values.shape == (0, 2) and total.shape == (0,)


@pytest.mark.parametrize(
    "name, said, located",
    [
        ("raises", "raised ValueError: no such key 'answer', on the completions of prompts 7, 9", None),
        (
            "wrong_length",
            "returned 3 values for 4 completions (expected 4, got 3), on the completions of prompts 7, 9",
            None,
        ),
        (
            "a_float",
            "returned a float, not a list of 4 numbers (one per completion), on the completions of prompts 7, 9",
            None,
        ),
        ("a_matrix", "returned a ndarray of shape (4, 2), not a list of 4 numbers", None),
        ("nan_value", "returned nan (not finite) for completion 1, of prompt 7", 7),
        ("none_value", "returned None (None, not a number) for completion 2, of prompt 9", 9),
        ("text_value", "returned '1.0' (a str, not a real number) for completion 0, of prompt 7", 7),
        ("huge_value", "returned 1e+300 (outside float32's range) for completion 0, of prompt 7", 7),
    ],
)
def test_each_failure_names_the_function_and_the_prompt(name, said, located):
    with pytest.raises(RewardError) as exc:
        score([one("recording"), one(name)], ["p"] * 4, ["a", "b", "c", "d"], [{}] * 4, [7, 7, 9, 9])
    (message,) = exc.value.problems
    assert message.startswith(f"{BAD}:{name} "), message
    assert said in message, message
    assert "second line" not in message  # an exception's first line only
    assert exc.value.function == f"{BAD}:{name}" and exc.value.prompt_index == located
    assert isinstance(exc.value, UserError) and str(exc.value) == f"reward function failed: {message}"


def test_a_failure_on_one_prompt_is_located_and_long_lists_are_cut():
    with pytest.raises(RewardError) as exc:
        score([one("raises")], ["p"] * 2, ["a", "b"], [{}] * 2, [4, 4])
    assert "on the completions of prompt 4" in str(exc.value) and exc.value.prompt_index == 4
    with pytest.raises(RewardError, match=r"prompts 0, 1, 2, 3, 4, 5, 6, 7, \.\.\. \(20 prompts\)$"):
        score([one("raises")], ["p"] * 20, ["a"] * 20, [{}] * 20, list(range(20)))


def test_field_names_that_clash_are_errors():
    with pytest.raises(
        RewardError, match=f"{BAD}:recording: the data field 'scale' is also a name in its config kwargs; rename one"
    ):
        score([one("recording", scale=2.0)], ["p"], ["a"], [{"scale": 1}], [0])
    with pytest.raises(
        RewardError, match="the data field 'completions' is also an argument every reward function gets"
    ):
        score([one("recording")], ["p"], ["a"], [{"completions": "x"}], [0])


def test_a_weighted_total_beyond_float32_is_an_error():
    with pytest.raises(RewardError, match=r"weighted total of .*:recording is 1e\+39 for completion 0, of prompt 3"):
        score([one("recording", weight=1e38)], ["p"], ["0123456789"], [{}], [3])


def test_score_wants_aligned_lists():
    with pytest.raises(ValueError, match="1 prompts, 2 field records and 2 prompt indices for 2 completions"):
        score([one("recording")], ["p"], ["a", "b"], [{}, {}], [0, 0])


def test_check_rewards_calls_each_function_once_before_training():
    """The pre-training check: a problem per failing function, keyed by its place in the config;
    the sound ones pass, a built-in missing its data field fails with the function named."""
    bad_rewards.CALLS.clear()
    rewards = load_rewards(
        [
            ("scaletune.rewards:exact_answer", 1.0, {}),
            (f"{BAD}:recording", 1.0, {}),
            (f"{BAD}:nan_value", 1.0, {}),
            (f"{BAD}:wrong_length", 1.0, {}),
        ]
    )
    problems = check_rewards(rewards, "What is 6 * 7?", {"answer": "42"}, prompt_index=5)
    assert [p.key for p in problems] == ["training.rl.rewards[2].function", "training.rl.rewards[3].function"]
    assert all(isinstance(p, Problem) and p.check == "reward functions" for p in problems)
    assert problems[0].message.startswith(f"training.rl.rewards[2].function: {BAD}:nan_value returned nan")
    assert "completion 1, of prompt 5" in problems[0].message
    assert "expected 2, got 1" in problems[1].message
    (call,) = bad_rewards.CALLS
    assert call["completions"] == ["", "The answer is 42."] and call["answer"] == ["42", "42"]
    assert call["prompts"] == ["What is 6 * 7?"] * 2
    (missing,) = check_rewards(rewards[:1], "What is 6 * 7?", {}, prefix="stages[0].training.rl.rewards")
    assert missing.key == "stages[0].training.rl.rewards[0].function"
    assert "scaletune.rewards:exact_answer raised TypeError" in missing.message and "'answer'" in missing.message
