"""The countdown verifier: a safe parser (never eval) and the reward."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from postrl.rewards import countdown_reward, evaluate_expression, extract_expression


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("1+2*3", Fraction(7)),
        ("(1+2)*3", Fraction(9)),
        ("10-4-3", Fraction(3)),  # left-associative
        ("12/4/3", Fraction(1)),
        ("7/2", Fraction(7, 2)),
        ("7/2*2", Fraction(7)),  # exact fractions, no float rounding
        (" ( ( 25 - 5 ) ) * 3 ", Fraction(60)),
        ("42", Fraction(42)),
    ],
)
def test_evaluate_expression(expression: str, value: Fraction) -> None:
    assert evaluate_expression(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "",
        "8/(3-3)",  # division by zero
        "1/0",
        "2**3",
        "-3+5",  # no unary signs
        "((1)",
        "(1))",
        "1 2",
        "1.5+2",
        "1+",
        "__import__('os')",
        "__import__('os').system('echo hacked')",
        "().__class__.__bases__[0]",
        "open('/etc/passwd')",
        "exec('1')",
        "1e9",
        "0x10",
        "1_000",
        "1" * 201,  # over-long
    ],
)
def test_evaluate_expression_rejects(expression: str) -> None:
    with pytest.raises(ValueError):
        evaluate_expression(expression)


def _render(tree: object) -> tuple[str, Fraction]:
    """An expression tree as fully parenthesised text, with its value computed directly."""
    if isinstance(tree, int):
        return str(tree), Fraction(tree)
    operator, left, right = tree  # type: ignore[misc]
    left_text, left_value = _render(left)
    right_text, right_value = _render(right)
    if operator == "/" and right_value == 0:
        right_text, right_value = f"({right_text}+1)", right_value + 1
    value = {
        "+": lambda: left_value + right_value,
        "-": lambda: left_value - right_value,
        "*": lambda: left_value * right_value,
        "/": lambda: left_value / right_value,
    }[operator]()
    return f"({left_text}{operator}{right_text})", value


_trees = st.recursive(
    st.integers(0, 100),
    lambda children: st.tuples(st.sampled_from("+-*/"), children, children),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(_trees)
def test_evaluate_expression_matches_direct_arithmetic(tree: object) -> None:
    text, value = _render(tree)
    assert evaluate_expression(text) == value


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_evaluate_expression_fails_only_with_value_error(text: str) -> None:
    try:
        evaluate_expression(text)
    except ValueError:
        pass


@pytest.mark.parametrize(
    ("completion", "expression"),
    [
        ("Let me think.\nAnswer: (25 - 5) * 3", "(25 - 5) * 3"),
        ("answer: 1+2\nAnswer: 3*4.", "3*4"),
        ("Answer: \\boxed{(25-5)*3}", "(25-5)*3"),
        ("So \\boxed{(25 - 5) \\times 3 = 60}", "(25 - 5) * 3"),
        ("Try 25 + 5 = 30\nThen:\n(25 - 5) × 3 = 60\nDone!", "(25 - 5) * 3"),
        ("$8 \\div 2$", "8 / 2"),
        ("No expression here.", None),
        ("12", None),
    ],
)
def test_extract_expression(completion: str, expression: str | None) -> None:
    assert extract_expression(completion) == expression


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("Answer: (25 - 5) * 3", 1.0),
        ("I tried things.\n(25-5)*3 = 60", 1.0),
        ("\\boxed{(25 - 5) \\times 3}", 1.0),
        ("Answer: 3 * (25 - 5)", 1.0),
        ("Answer: 25 * 3 - 5", 0.0),  # wrong value
        ("Answer: (25 - 5) * 3 * 1", 0.0),  # a number that is not given
        ("Answer: (25 - 5) * 3 + 5 - 5", 0.0),  # reuses 5
        ("Answer: 25 * 3", 0.0),  # misses 5 (75)
        ("Answer: 20 * 3", 0.0),  # misses 25 and 5, uses 20
        ("Answer: (25 - 5) * 3 / (5 - 5)", 0.0),  # division by zero
        ("Answer: 60", 0.0),
        ("Answer: __import__('os').system('echo hacked')", 0.0),
        ("Answer: (lambda: 60)()", 0.0),
        ("", 0.0),
    ],
)
def test_countdown_reward(completion: str, reward: float) -> None:
    assert countdown_reward(["q"], [completion], numbers=[[25, 5, 3]], target=[60]) == [reward]


def test_countdown_reward_uses_numbers_as_a_multiset() -> None:
    completions = ["Answer: 4 + 4 - 2", "Answer: 4 + 6 - 2", "Answer: 4 * 2"]
    rewards = countdown_reward(["q"] * 3, completions, numbers=[[4, 4, 2]] * 3, target=[6, 8, 8])
    assert rewards == [1.0, 0.0, 0.0]


def test_countdown_reward_needs_an_exact_fractional_target() -> None:
    completions = ["Answer: 7 / 2 * 2", "Answer: 7 / 2"]
    rewards = countdown_reward(["q"] * 2, completions, numbers=[[7, 2, 2], [7, 2]], target=[7, 3])
    assert rewards == [1.0, 0.0]
