"""The math verifier against the number formats models write, in both directions: a right
answer in any of them scores 1, a wrong one 0 (``math_answer`` on completion and gold).

Which part does what (also in docs/rewards.md): postrl finds the final answer in free text
and reads numbers exactly (signs, separators, decimals, fractions, percent, currency, units,
scientific notation); math-verify compares what is not a number (LaTeX expressions)."""

from __future__ import annotations

import pytest

from postrl.rewards import math_answer

RIGHT = 1.0
WRONG = 0.0

CORPUS = {
    "signs": [
        ("The answer is -42.", "-42", RIGHT),
        ("The answer is \u221242.", "-42", RIGHT),  # U+2212, the minus sign
        ("The answer is \u221242.", "42", WRONG),
        ("Answer: +7", "7", RIGHT),
        ("Answer: 7", "+7", RIGHT),
        ("\\boxed{7}", "-7", WRONG),
        ("Answer: -0", "0", RIGHT),
        ("the difference 8-5 is 3", "3", RIGHT),  # 8-5 is no negative 5
        ("The answer is 12 - 5 = 7", "7", RIGHT),
    ],
    "thousands separators": [
        ("So we get 1,234 apples.", "1234", RIGHT),
        ("The answer is 1,234,567", "1234567", RIGHT),
        ("The answer is 1000", "#### 1,000", RIGHT),
        ("\\boxed{1,500}", "1500", RIGHT),
        ("\\boxed{1\\,000}", "1000", RIGHT),
        ("\\boxed{1{,}000}", "1000", RIGHT),
        ("The answer is 1\u202f000", "1000", RIGHT),  # narrow no-break space
        ("The answer is 1\u00a0000 apples", "1000", RIGHT),
        ("Answer: 1 234", "1234", RIGHT),
        ("Answer: 1,5", "15", WRONG),  # not a thousands group
        ("Answer: 12,34", "1234", WRONG),
        ("Answer: 2,5", "2.5", WRONG),  # a decimal comma is not read
    ],
    "decimals and trailing zeros": [
        ("The answer is 3.50", "3.5", RIGHT),
        ("The answer is 3.5", "3.50", RIGHT),
        ("The answer is 5.00.", "5", RIGHT),
        ("The answer is .5", "0.5", RIGHT),
        ("Answer: 007", "7", RIGHT),
        ("\\boxed{1000.}", "1000", RIGHT),
        ("Answer: 1450000.0", "1450000", RIGHT),
        ("Answer: 1450000.5", "1450000", WRONG),  # exact, not within a relative 1e-6
        ("The answer is 1450001", "1450000", WRONG),
        ("Answer: 7.0000001", "7", WRONG),
        ("Answer: 10.", "100", WRONG),
    ],
    "fractions": [
        ("The answer is 1/2", "0.5", RIGHT),
        ("Answer: 2/4", "1/2", RIGHT),
        ("Answer: -1/2", "-0.5", RIGHT),
        ("Answer: 3 1/2", "3.5", RIGHT),  # a mixed number
        ("Answer: -3 1/2", "-7/2", RIGHT),
        ("\\boxed{\\frac{1}{2}}", "0.5", RIGHT),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", RIGHT),
        ("\\boxed{\\tfrac12}", "1/2", RIGHT),
        ("\\boxed{-\\frac{1}{2}}", "-0.5", RIGHT),
        ("\\boxed{\\frac{1}{2}}", "-0.5", WRONG),
        ("The answer is $\\frac{7}{2}$.", "3.5", RIGHT),  # LaTeX in running text
        ("The answer is \\(\\frac{7}{2}\\).", "7/2", RIGHT),
        ("Answer: 0.67", "2/3", RIGHT),  # a repeating value, rounded to the places written
        ("Answer: 0.6667", "2/3", RIGHT),
        ("Answer: 0.66", "2/3", WRONG),
        ("Answer: 0.3", "1/3", WRONG),  # one place is too coarse
        ("Answer: 1/3", "0.33", RIGHT),
        ("Answer: 10/0", "10", WRONG),
    ],
    "percentages": [
        ("The answer is 50%", "50", RIGHT),
        ("Answer: 12.5%", "12.5", RIGHT),
        ("Answer: 12.5\\%", "12.5", RIGHT),
        ("\\boxed{15\\%}", "15", RIGHT),
        ("The answer is 10 %", "10", RIGHT),
        ("The answer is 50%.", "0.5", WRONG),  # the sign is dropped, not applied
        ("Answer: 25%", "50", WRONG),
    ],
    "currency and units": [
        ("The answer is $18.", "18", RIGHT),
        ("The answer is \\$18.00", "18", RIGHT),
        ("It costs $1,200.50 in total.", "1200.5", RIGHT),
        ("Answer: $\\$5.50$", "5.5", RIGHT),
        ("The answer is \u20ac18", "18", RIGHT),
        ("The answer is \u00a35", "5", RIGHT),
        ("Answer: USD 5", "5", RIGHT),
        ("The answer is 18 dollars.", "18", RIGHT),
        ("The answer is 18", "$18", RIGHT),
        ("The answer is 18", "18 dollars", RIGHT),
        ("He runs 5 km.", "5", RIGHT),
        ("Answer: 5km", "5", RIGHT),
        ("\\boxed{\\text{5 dollars}}", "5", RIGHT),
        ("\\boxed{5 \\text{ apples}}", "5", RIGHT),
        ("Answer: 5 (five)", "5", RIGHT),
        ("Answer: 6 dollars", "5", WRONG),
        ("Answer: 5 apples and 3 pears", "5", WRONG),  # two numbers: not a unit
    ],
    "scientific notation": [
        ("The answer is 1e3", "1000", RIGHT),
        ("The answer is 1.5e3", "1500", RIGHT),
        ("The answer is 2.5E-2", "0.025", RIGHT),
        ("The answer is 1.5 \\times 10^3", "1500", RIGHT),
        ("It is 3\u00d710^2.", "300", RIGHT),
        ("\\boxed{2 \\times 10^{-1}}", "0.2", RIGHT),
        ("Answer: 1e3", "100", WRONG),
    ],
    "boxed and ####": [
        ("\\boxed{1500}", "1500", RIGHT),
        ("\\boxed{-7}", "-7", RIGHT),
        ("Answer: 7\n\\boxed{8}\n#### 9", "8", RIGHT),
        ("#### 72", "72", RIGHT),
        ("#### 72\n", "#### 72", RIGHT),
        ("The final answer is #### 1,000", "1000", RIGHT),
        ("#### The answer is 5", "5", RIGHT),
        ("The answer is 18", "\\boxed{18}", RIGHT),
        ("\\boxed{19}", "18", WRONG),
    ],
    "words around the number": [
        ("Answer: 17", "17", RIGHT),
        ("**Answer:** 17", "17", RIGHT),
        ("Final answer: 17 apples", "17", RIGHT),
        ("So she has **12** apples.", "12", RIGHT),
        ("The answer is **-3**", "-3", RIGHT),
        ("There are 7 apples. So 7.", "7", RIGHT),
        ("Step 1: 4. Step 2: 9", "9", RIGHT),
        ("Answer: x = 5", "5", RIGHT),
        ("The answer is forty-two", "42", WRONG),
        ("no number here", "5", WRONG),
        ("The answer is x2", "2", WRONG),
        ("Answer: 12:30", "12", WRONG),
        ("Answer: 3 - 1", "3", WRONG),
    ],
    "LaTeX through math-verify": [
        ("Answer: 2^10", "1024", RIGHT),
        ("Answer: \\sqrt{4}", "2", RIGHT),
        ("\\boxed{x=5}", "5", RIGHT),
        ("\\boxed{\\sqrt{2}}", "2^{1/2}", RIGHT),
        ("Answer: 2x", "2y", WRONG),
        ("\\boxed{x^2+1}", "x^2+2", WRONG),
    ],
}
CASES = [(kind, *case) for kind, cases in CORPUS.items() for case in cases]


def test_the_corpus_covers_every_format_both_ways():
    assert len(CASES) >= 90
    for kind, cases in CORPUS.items():
        assert {expected for *_, expected in cases} == {RIGHT, WRONG}, kind


@pytest.mark.parametrize(("kind", "completion", "gold", "expected"), CASES,
                         ids=[f"{c[0]}: {c[1]!r} vs {c[2]!r}" for c in CASES])
def test_answer_formats(kind: str, completion: str, gold: str, expected: float) -> None:
    assert math_answer([""], [completion], [gold]) == [expected]
