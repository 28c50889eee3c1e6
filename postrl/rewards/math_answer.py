"""Math answer extraction and verification, and the ``math_answer`` / ``format`` rewards.

The final answer of a completion is, in order of preference: the last ``\\boxed{...}``, the last
``Answer:`` line, the last ``#### N`` (GSM8K's format, Cobbe et al. 2021), else the last number
of the text. postrl's part is finding that answer and reading numbers exactly: signs (the
minus sign too), thousands separators, decimals, plain, mixed and LaTeX fractions, percent,
currency, units, scientific notation; two numbers are equal when their exact values are
(:func:`numbers_match`). Anything that is not a number (LaTeX expressions, ``x = 5``) goes to
``math-verify`` (Kydlíček, HuggingFace 2025). docs/rewards.md has the rules and their limits.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Any

_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
_ANSWER_LINE = re.compile(r"\banswer[*_\s]*:[*_\s]*(.*)$", re.IGNORECASE | re.MULTILINE)
_HASHES = re.compile(r"####[ \t]*(.*)$", re.MULTILINE)
# Number forms, each a regex fragment. A plain number: optional sign, digits with optional
# thousands commas, an optional decimal part, an optional exponent (1.5e3).
_PLAIN = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+|(?=\.\d))(?:\.\d+)?(?:[eE][-+]?\d+)?"
_FRACTION = r"-?(?:\d+|(?=\.\d))(?:\.\d+)?/\d+"  # 3/4, -1/2
# \frac{7}{2}, \tfrac12
_LATEX_FRACTION = r"-?\\[dt]?frac\s*(?:\{\s*-?\d+\s*\}\s*\{\s*\d+\s*\}|\d\d)"
_TIMES_TEN = (r"[-+]?\d+(?:\.\d+)?\s*(?:\\times|\\cdot|×|\*)\s*10\s*\^\s*"
              r"(?:\{\s*[-+]?\d+\s*\}|[-+]?\d+)")  # 1.5 \times 10^{3}
_MIXED = r"-?\d+\s+\d+/\d+"  # 3 1/2
# In running text: the longest form first; a sign only where it cannot be a binary minus (5-3).
_NUMBER_IN_TEXT = re.compile(
    rf"(?<![\w.\\])(?:{_LATEX_FRACTION}|{_TIMES_TEN.replace('[-+]?', '-?', 1)}"
    rf"|{_FRACTION}|{_PLAIN.replace('[-+]?', '-?', 1)})")
_NUMBER = re.compile(rf"(?:{_LATEX_FRACTION}|{_TIMES_TEN}|{_MIXED}|{_FRACTION}|{_PLAIN})")
# "18 dollars", "5 (five)": one number, then words or a remark without digits.
_NUMBER_THEN_WORDS = re.compile(rf"({_FRACTION}|{_PLAIN})\s*%?\s+[^\d=<>+*/^]*")
# Currency before the number: $18, \$18, €5, USD 5.
_CURRENCY = re.compile(r"^(?:\\\$|[$€£¥₹]|(?:USD|EUR|GBP|INR|Rs\.?)\s)\s*")
_TEXT_COMMAND = re.compile(r"\\(?:text|textbf|mathrm|mbox|textrm|mathbf)\s*\{([^{}]*)\}")
_MATH_DELIMITERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
# Characters models write that mean a plain one: the minus sign, and the spaces that group
# thousands (no-break, thin, narrow no-break; LaTeX's \, and {,}).
_SAME_AS = str.maketrans({"\u2212": "-", "\u00a0": " ", "\u2009": " ", "\u202f": " "})
_GROUPED_THOUSANDS = re.compile(r"(?<=\d)(?: |\\,|\{,\})(?=\d{3}(?!\d))")

_MATH_VERIFY_MAX_CHARS = 1000  # longer strings are not worth a symbolic comparison
_MATH_VERIFY_TIMEOUT_S = 5


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or (TRL conversational format) a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces (None if there is none)."""
    found = None
    for match in _BOXED_OPEN.finditer(text):
        depth, start = 1, match.end()
        for index in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[index], 0)
            if depth == 0:
                found = text[start:index]
                break
    return found


def _last_group(pattern: re.Pattern[str], text: str) -> str | None:
    contents = [m.group(1).strip() for m in pattern.finditer(text)]
    contents = [c for c in contents if c]
    return contents[-1] if contents else None


def last_answer_line(text: str) -> str | None:
    """What follows the last ``Answer:`` (case-insensitive; ``**Answer:**`` too), or None."""
    return _last_group(_ANSWER_LINE, text)


def _normalise(text: str) -> str:
    r"""The minus sign as ``-``; thousands grouped by thin or no-break spaces (``1 234``,
    ``1\,234``, ``1{,}234``) joined. Plain spaces join digits only inside an answer
    (:func:`_clean`), where ``1 234`` cannot be two numbers of running text."""
    text = re.sub(r"(?<=\d)[\u00a0\u2009\u202f](?=\d{3}(?!\d))", "", text)
    return text.translate(_SAME_AS)


def _clean(candidate: str) -> str:
    r"""The bare answer: without markdown emphasis, math delimiters, ``\text{}``, currency,
    a full stop, or words after a number (``18 dollars``, ``5 (five)``)."""
    cleaned = _normalise(candidate).strip().strip("*").strip()
    for opening, closing in _MATH_DELIMITERS:
        if cleaned.startswith(opening) and cleaned.endswith(closing) and len(cleaned) > 2:
            cleaned = cleaned[len(opening):-len(closing)].strip()
    cleaned = _TEXT_COMMAND.sub(r"\1", cleaned).strip()
    cleaned = _CURRENCY.sub("", cleaned).strip("$").strip().rstrip(".").strip()
    cleaned = _GROUPED_THOUSANDS.sub("", cleaned)
    with_words = _NUMBER_THEN_WORDS.fullmatch(cleaned)
    return with_words.group(1) if with_words else cleaned


def explicit_answer(text: str) -> str | None:
    """The answer the completion states explicitly: ``\\boxed{}``, ``Answer:`` or ``####``."""
    for candidate in (last_boxed(text), last_answer_line(text), _last_group(_HASHES, text)):
        if candidate is not None and _clean(candidate):
            return _clean(candidate)
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of ``text`` (see the module docstring for the order), or None."""
    explicit = explicit_answer(text)
    if explicit is not None:
        return explicit
    numbers = _NUMBER_IN_TEXT.findall(_normalise(text))
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """An answer as an exact Fraction, else None: ``1,000``, ``-3.5``, ``$18.``, ``3/4``,
    ``3 1/2``, ``\\frac{7}{2}``, ``50%`` (as 50), ``1.5e3``, ``1.5 \\times 10^{3}``."""
    cleaned = _clean(text).replace("\\!", "").strip()
    cleaned = re.sub(r"\s*\\?%$", "", cleaned)
    if not _NUMBER.fullmatch(cleaned):
        return None
    try:
        return _fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _fraction(number: str) -> Fraction:
    """The value of a string that :data:`_NUMBER` matches whole."""
    negative = number.startswith("-")
    digits = re.findall(r"\d+(?:\.\d+)?", number)
    if "frac" in number:
        parts = digits if len(digits) == 2 else list(digits[0])  # \tfrac12
        value = Fraction(int(parts[0]), int(parts[1]))
        return -value if negative else value
    if re.fullmatch(_TIMES_TEN, number):
        mantissa, exponent = re.split(r"\s*(?:\\times|\\cdot|×|\*)\s*10\s*\^\s*", number)
        return Fraction(mantissa) * Fraction(10) ** int(exponent.strip("{} "))
    whole, _, fraction = number.replace(",", "").partition(" ")
    if fraction:  # a mixed number
        value = abs(Fraction(whole)) + Fraction(fraction)
        return -value if negative else value
    numerator, _, denominator = whole.partition("/")
    value = Fraction(numerator)
    return value / int(denominator) if denominator else value


def _math_verify_match(predicted: str, gold: str) -> bool:
    """``math_verify.verify`` that never raises; signal timeouts only where signals work."""
    if len(predicted) > _MATH_VERIFY_MAX_CHARS or len(gold) > _MATH_VERIFY_MAX_CHARS:
        return False
    # math-verify times out with SIGALRM, which only the main thread may install.
    in_main = threading.current_thread() is threading.main_thread()
    timeout = _MATH_VERIFY_TIMEOUT_S if in_main else None
    try:
        from math_verify import parse, verify

        def parsed(text: str) -> list[Any]:
            delimited = text if "$" in text or "\\boxed" in text else f"${text}$"
            return parse(delimited, parsing_timeout=timeout) or parse(text, parsing_timeout=timeout)

        gold_parsed, predicted_parsed = parsed(gold), parsed(predicted)
        if not gold_parsed or not predicted_parsed:
            return False
        return bool(verify(gold_parsed, predicted_parsed, timeout_seconds=timeout))
    except Exception:  # a verifier failure is a wrong answer, not a crash
        return False


def _decimals(value: Fraction) -> int | None:
    """Digits after the point of ``value`` written as a decimal; None if it repeats (its
    denominator has a prime factor other than 2 and 5)."""
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    return max(twos, fives) if denominator == 1 else None


def numbers_match(predicted: Fraction, gold: Fraction) -> bool:
    """Exactly (so 1450001 != 1450000.5 != 1450000); except that a value whose decimal
    expansion repeats (1/3) equals a decimal of at least two places that is it rounded to
    those places (0.33, 0.333; not 0.3)."""
    if predicted == gold:
        return True
    decimals = (_decimals(predicted), _decimals(gold))
    if (decimals[0] is None) == (decimals[1] is None):
        return False
    written, exact = (predicted, gold) if decimals[1] is None else (gold, predicted)
    places = decimals[0] if decimals[1] is None else decimals[1]
    return places >= 2 and abs(written - exact) <= Fraction(1, 2 * 10**places)


def answers_match(predicted: str | None, gold: str | None) -> bool:
    """True when ``predicted`` equals ``gold``: numerically (see numbers_match), by string, or
    symbolically through ``math-verify`` (Kydlíček, HuggingFace 2025)."""
    if predicted is None or gold is None:
        return False
    predicted, gold = str(predicted).strip(), str(gold).strip()
    predicted_number, gold_number = parse_number(predicted), parse_number(gold)
    if predicted_number is not None and gold_number is not None:
        return numbers_match(predicted_number, gold_number)
    if " ".join(predicted.split()) == " ".join(gold.split()):
        return True
    return _math_verify_match(predicted, gold)


def gold_answer(gold: Any) -> str | None:
    """The final answer in a gold value: after ``####`` (GSM8K), a ``\\boxed{}``, or as is."""
    if gold is None:
        return None
    text = str(gold)
    if "####" in text:
        return _clean(text.rsplit("####", 1)[1])
    boxed = last_boxed(text)
    return _clean(boxed) if boxed is not None else _clean(text)


def math_answer(
    prompts: list[str], completions: list[Any], answer: list[Any], **_: Any
) -> list[float | None]:
    """1.0 when the completion's final answer equals the gold ``answer``, else 0.0.

    A sample whose gold answer is None gets None (not applicable).
    """
    rewards: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        expected = gold_answer(gold)
        if expected is None:
            rewards.append(None)
            continue
        predicted = extract_answer(completion_text(completion))
        rewards.append(1.0 if answers_match(predicted, expected) else 0.0)
    return rewards


def format_reward(prompts: list[str], completions: list[Any], **_: Any) -> list[float | None]:
    """1.0 when the completion states its answer explicitly (``\\boxed{}``, ``Answer:``,
    ``####``), else 0.0."""
    return [
        1.0 if explicit_answer(completion_text(completion)) is not None else 0.0
        for completion in completions
    ]
