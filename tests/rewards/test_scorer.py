"""The Scorer: weights, None handling, and errors that name the function and the sample."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from postrl.errors import ConfigError, DataError, RewardError
from postrl.rewards import Scorer


def only_even(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
    """Applies to even samples only: 2.0 there, None elsewhere."""
    return [2.0 if index % 2 == 0 else None for index in range(len(completions))]


def never_applies(prompts: list[str], completions: list[str], **_: Any) -> list[float | None]:
    return [None] * len(completions)


def returning(values: list[Any]) -> Any:
    def bad_reward(prompts: list[str], completions: list[str], **_: Any) -> Any:
        return values

    return bad_reward


def test_weighted_sum_of_builtins() -> None:
    scorer = Scorer([("math_answer", 1.0), ("format", 0.5)])
    completions = ["Answer: 4", "Answer: 5", "it is 4", "nothing"]
    scored = scorer.score(["q"] * 4, completions, {"answer": ["4"] * 4})
    assert scored.per_function == {
        "math_answer": [1.0, 0.0, 1.0, 0.0],
        "format": [1.0, 1.0, 0.0, 0.0],
    }
    assert scored.total == pytest.approx([1.5, 0.5, 1.0, 0.0])
    assert scorer.names == ["math_answer", "format"]


def test_countdown_columns_reach_the_function() -> None:
    scorer = Scorer([("countdown", 1.0)])
    columns = {"numbers": [[1, 2], [1, 2]], "target": [3, 4], "unused": ["x", "y"]}
    scored = scorer.score(["q", "q"], ["Answer: 1+2", "Answer: 1+2"], columns)
    assert scored.total == [1.0, 0.0]


def test_none_is_left_out_of_the_sum() -> None:
    scorer = Scorer([(only_even, 1.0), ("format", 3.0)])
    scored = scorer.score(["q"] * 3, ["Answer: 1", "x", "y"], {})
    assert scored.per_function["only_even"] == [2.0, None, 2.0]
    assert scored.total == pytest.approx([5.0, 0.0, 2.0])


def test_a_sample_no_function_applies_to_is_an_error() -> None:
    scorer = Scorer([(only_even, 1.0), (never_applies, 1.0)])
    with pytest.raises(RewardError, match=r"sample 1 \(all None\)"):
        scorer.score(["q"] * 3, ["a", "b", "c"], {})


def test_a_function_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.py"
    path.write_text(
        "def brevity(prompts, completions, **_):\n    return [-len(c) for c in completions]\n"
    )
    scored = Scorer([(f"{path}:brevity", 0.1)]).score(["q", "q"], ["ab", "abcd"], {})
    assert scored.per_function == {"brevity": [-2.0, -4.0]}
    assert scored.total == pytest.approx([-0.2, -0.4])


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([1.0], r"'bad_reward' returned 1 values for 2 completions"),
        ([1.0, 2.0, 3.0], r"'bad_reward' returned 3 values for 2 completions"),
        ((1.0, "high"), r"'bad_reward' returned 'high' \(str\) for sample 1"),
        ([math.nan, 1.0], r"'bad_reward' returned nan for sample 0"),
        ([1.0, math.inf], r"'bad_reward' returned inf for sample 1"),
        ([1.0, [1.0]], r"'bad_reward' returned \[1.0\] \(list\) for sample 1"),
        ({"a": 1.0}, r"'bad_reward' returned a dict"),
    ],
)
def test_unusable_return_values(values: Any, message: str) -> None:
    with pytest.raises(RewardError, match=message):
        Scorer([(returning(values), 1.0)]).score(["q", "q"], ["a", "b"], {})


def test_integers_and_bools_are_accepted_as_floats() -> None:
    scored = Scorer([(returning([1, True]), 1.0)]).score(["q", "q"], ["a", "b"], {})
    assert scored.per_function["bad_reward"] == [1.0, 1.0]
    assert all(type(value) is float for value in scored.per_function["bad_reward"])


def test_a_raising_function_is_wrapped() -> None:
    scorer = Scorer([("math_answer", 1.0)])
    with pytest.raises(RewardError, match=r"'math_answer' raised TypeError") as caught:
        scorer.score(["q"], ["Answer: 1"], {})  # no `answer` column
    assert isinstance(caught.value.__cause__, TypeError)


def test_misaligned_batch() -> None:
    scorer = Scorer([("format", 1.0)])
    with pytest.raises(DataError, match=r"2 prompts but 1 completions"):
        scorer.score(["q", "q"], ["a"], {})
    with pytest.raises(DataError, match=r"column 'answer' has 1 values for 2 samples"):
        scorer.score(["q", "q"], ["a", "b"], {"answer": ["1"]})


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        ([], r"at least one reward function"),
        ([("format", math.nan)], r"reward 'format': weight must be a finite number"),
        ([("format", "1")], r"weight must be a finite number"),
        ([("format", 1.0), ("format", 2.0)], r"same name: \['format'\]"),
        ([("no_such_reward", 1.0)], r"unknown reward 'no_such_reward'"),
        ([(3, 1.0)], r"reward 3 is neither"),
    ],
)
def test_configuration_errors(specs: list[Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Scorer(specs)
