"""Math answer extraction and verification, and the ``math_answer`` / ``format`` rewards.

The final answer of a completion is, in order of preference: the last ``\\boxed{...}``, the last
``Answer:`` line, the last ``#### N`` (GSM8K's format, Cobbe et al. 2021), else the last number.
Numbers are compared numerically; anything else (LaTeX) goes through ``math-verify``.
"""

from __future__ import annotations

import math
import re
import threading
from fractions import Fraction
from typing import Any

_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
_ANSWER_LINE = re.compile(r"\banswer[*_\s]*:[*_\s]*(.*)$", re.IGNORECASE | re.MULTILINE)
_HASHES = re.compile(r"####[ \t]*(.*)$", re.MULTILINE)
# A number in running text: optional minus (not one between two operands, as in "5-3"), digits
# with optional thousands commas, an optional decimal part, an optional "/denominator".
_NUMBER_IN_TEXT = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+|(?=\.\d))(?:\.\d+)?(?:/\d+)?")
# "18 dollars", "$18 per day": a number followed by words only; the number is the answer.
_NUMBER_WITH_UNIT = re.compile(r"(-?\d[\d,]*(?:\.\d+)?)\s+[A-Za-z][A-Za-z\s]*")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+|(?=\.\d))(?:\.\d+)?(?:/\d+)?")

_REL_TOL = 1e-6
_ABS_TOL = 1e-9
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


def _clean(candidate: str) -> str:
    """Strip markdown emphasis, surrounding ``$``, a full stop and a unit (``18 dollars``)."""
    cleaned = candidate.strip().strip("*").strip()
    if cleaned.startswith("\\$"):
        cleaned = cleaned[2:]
    cleaned = cleaned.strip("$").strip().rstrip(".").strip()
    with_unit = _NUMBER_WITH_UNIT.fullmatch(cleaned)
    return with_unit.group(1) if with_unit else cleaned


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
    numbers = _NUMBER_IN_TEXT.findall(text)
    return numbers[-1] if numbers else None


def parse_number(text: str) -> Fraction | None:
    """``"1,000"``, ``"-3.5"``, ``"$18."``, ``"3/4"``, ``"50%"`` as an exact Fraction, else None."""
    cleaned = _clean(text).replace("\\!", "").replace(" ", "").rstrip("%")
    if not _PLAIN_NUMBER.fullmatch(cleaned):
        return None
    numerator, _, denominator = cleaned.replace(",", "").partition("/")
    try:
        value = Fraction(numerator)
        return value / int(denominator) if denominator else value
    except (ValueError, ZeroDivisionError):
        return None


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


def numbers_match(predicted: Fraction, gold: Fraction) -> bool:
    """Integers exactly (so 1450001 != 1450000), others within rel 1e-6 / abs 1e-9."""
    if predicted.denominator == 1 and gold.denominator == 1:
        return predicted == gold
    return math.isclose(float(predicted), float(gold), rel_tol=_REL_TOL, abs_tol=_ABS_TOL)


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
