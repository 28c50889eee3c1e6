"""Answer extraction and matching, by hand-made cases in every format."""

from __future__ import annotations

import threading

import pytest

from postrl.rewards import answers_match, extract_answer, format_reward, math_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # \boxed{}: the last one, with balanced braces, preferred over everything else.
        ("So the answer is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{a{b}c} and a truncated \\boxed{unclosed", "a{b}c"),
        ("Answer: 7\n\\boxed{8}\n#### 9", "8"),
        # Answer: lines, case-insensitive, the last one, markdown and units stripped.
        ("Answer: 17", "17"),
        ("answer: 3\nFinal ANSWER: 5", "5"),
        ("**Answer:** 42", "42"),
        ("The final answer:\n\n17", "17"),
        ("Answer: $1,000.", "1,000"),
        ("Answer: 18 dollars", "18"),
        ("Answer: $18 per day.", "18"),
        ("Answer: 3 apples and 4 oranges", "3 apples and 4 oranges"),
        ("Answer: 7\n#### 9", "7"),
        # #### N (GSM8K).
        ("Some work\n#### 18", "18"),
        ("#### 1\n#### -10", "-10"),
        # The last number in the text.
        ("She makes 9 * 2 = $18 every day.", "18"),
        ("It costs $2.50.", "2.50"),
        ("It cost 1,000 dollars", "1,000"),
        ("x is -7", "-7"),
        ("5-3", "3"),
        ("about 3/4 of it", "3/4"),
        ("reduced by .5", ".5"),
        ("+12 and then 1,234,567.", "1,234,567"),
        ("no numbers here", None),
        ("", None),
        ("\\boxed{}", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("predicted", "gold"),
    [
        ("18", "18"),
        ("18.00", "18"),
        ("1,000", "1000"),
        ("$18.", "18"),
        ("-3", "-3"),
        ("3/4", "0.75"),
        ("0.3333333333", "1/3"),
        ("50%", "50"),
        ("\\frac{1}{2}", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("\\dfrac{1}{2}", "\\frac12"),
        ("\\sqrt{2}", "2^{1/2}"),
        ("x^2+1", "1+x^2"),
        ("yes", "yes"),
    ],
)
def test_answers_match(predicted: str, gold: str) -> None:
    assert answers_match(predicted, gold)


@pytest.mark.parametrize(
    ("predicted", "gold"),
    [
        ("17", "18"),
        ("1450001", "1450000"),  # integers compare exactly, not within 1e-6
        ("-18", "18"),
        ("0.34", "1/3"),
        ("\\frac{1}{3}", "0.5"),
        ("2x+3", "2"),
        (None, "18"),
        ("18", None),
        ("", "18"),
        ("\\frac{" * 400, "1"),  # malformed LaTeX: False, never an exception
    ],
)
def test_answers_do_not_match(predicted: str | None, gold: str | None) -> None:
    assert not answers_match(predicted, gold)


def test_math_verify_works_outside_the_main_thread() -> None:
    """math-verify's timeouts use SIGALRM, which only the main thread may install."""
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(answers_match("\\frac{1}{2}", "0.5")))
    thread.start()
    thread.join(timeout=30)
    assert results == [True]


def test_math_answer_reward() -> None:
    completions = [
        "The answer is \\boxed{18}.",
        "Answer: 17",
        "I think it is 18",
        "\\boxed{\\frac{1}{2}}",
        [{"role": "assistant", "content": "Answer: 18"}],  # TRL's conversational format
        "anything",
    ]
    gold = ["18", "18", "Work\n#### 18", "0.5", "18", None]
    rewards = math_answer(["q"] * 6, completions, answer=gold)
    assert rewards == [1.0, 0.0, 1.0, 1.0, 1.0, None]


def test_math_answer_reads_a_boxed_or_numeric_gold() -> None:
    assert math_answer(["q", "q"], ["Answer: 4", "Answer: 4"], answer=["\\boxed{4}", 4]) == [
        1.0,
        1.0,
    ]


def test_format_reward() -> None:
    completions = ["\\boxed{3}", "Answer: 3", "#### 3", "it is 3", "\\boxed{}", "Answer:"]
    assert format_reward(["q"] * 6, completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
